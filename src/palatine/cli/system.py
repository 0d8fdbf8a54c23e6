"""``palatine system``: serve the system (registry, supervision) until stopped.

While it serves, the system records its job (`palatine.job.records`): its address, its
cluster token's file, its log dir and its own pid, so that ``palatine ps`` lists the job
and ``palatine top --job ID`` reaches it; the record goes when the system ends. The
record's id is the execution id (``PALATINE_EXECUTION_ID``, which every role of a local
job shares), else the job id its launcher hands it (``PALATINE_JOB_ID``), else a new one. A launcher that records the job itself (`SlurmJob`) sets
``PALATINE_JOB_RECORD=launcher`` and the system records nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from palatine.cli.role import ready_line, run_role
from palatine.config import roles
from palatine.config.roles import SystemOptions

__all__ = ["add_arguments", "run", "job_record_id"]

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--system-addr", required=True, help="address to serve (tcp:HOST:PORT, unix:...)"
    )
    roles.add_arguments(p, SystemOptions)  # the options, declared there


def run(args: argparse.Namespace) -> int:
    from palatine.hosting.proctitle import name_process

    name_process("palatine system")
    return run_role(lambda stop: serve_system(args, stop))


def job_record_id(environ: Mapping[str, str] | None = None) -> str:
    """The id this system records its job under (see the module)."""
    from palatine.job.records import job_id_of
    from palatine.system.worlds import execution_id_from_env

    environ = os.environ if environ is None else environ
    return job_id_of(environ) or execution_id_from_env(environ)


class _Recorder:
    """Writes the job's record once the system serves, and removes it at the end."""

    def __init__(self) -> None:
        from palatine.job.records import RecordDir

        self.dir = RecordDir()
        self.job_id: str | None = None

    def ready(self, addr: str) -> None:
        from palatine.channel.token import TOKEN_ENV, TOKEN_FILE_ENV, default_token_path
        from palatine.job.records import RECORD_ENV, SHAPE_ENV, JobRecord

        if os.environ.get(RECORD_ENV) == "launcher":
            return
        job_id = job_record_id()
        try:
            restarted = self.dir.exists(job_id)  # (a restarted system's predecessor's)
            if TOKEN_ENV in os.environ:
                token_file = self.dir.write_token(job_id, os.environ[TOKEN_ENV])
            elif os.environ.get(TOKEN_FILE_ENV):
                token_file = Path(os.environ[TOKEN_FILE_ENV]).absolute()
            else:
                token_file = default_token_path()
            rec = JobRecord(
                id=job_id,
                system_addr=addr,
                token_file=str(token_file),
                log_dir=os.environ.get("PALATINE_LOG_DIR", ""),
                pid=os.getpid(),
                started=time.time(),
                shape=os.environ.get(SHAPE_ENV, ""),
                machine=socket.gethostname(),
            )
            path = self.dir.write(rec)
        except (OSError, ValueError) as e:
            log.warning("job %s: cannot write its record in %s: %s", job_id, self.dir.path, e)
            return
        self.job_id = job_id
        log.info("job %s recorded in %s%s", job_id, path, " again" if restarted else "")

    def close(self) -> None:
        if self.job_id is not None:
            with contextlib.suppress(OSError):
                self.dir.remove(self.job_id)


async def serve_system(args: argparse.Namespace, stop: asyncio.Event) -> int:
    """The role `palatine serve` runs for ``Run.System``, from the command line: exit 2
    when the metrics cannot be served, 1 when the system cannot."""
    from palatine.cli.serving import SystemCommand, check_cli_args, run_system

    cmd = roles.from_args(SystemCommand, args)
    recorder = _Recorder()

    def on_ready(role: str, addr: Any, **extra: str | None) -> None:
        ready_line(role, addr, **extra)
        recorder.ready(str(addr))

    try:
        refused = await run_system(cmd, check_cli_args(cmd), stop, on_ready)
    finally:
        recorder.close()
    if refused is None:
        return 0
    print(f"palatine system: {refused.text}", file=sys.stderr)
    return refused.exit_code
