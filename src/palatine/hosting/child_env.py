"""What a host hands each child proc, and the child's side of the contract.

Pure helpers, free of the process machinery in `palatine.hosting.children`: the environment
table a host adds for an exec'd proc (`child_env`), where the proc's log and stack-dump
files go (`log_path_for`, `stack_path_for`), the human text for a
process end (`describe_exit`), and `arm_parent_death_signal`, which a bootstrapping proc
calls so that it dies with the host that started it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from palatine import config
from palatine.config import format_seconds
from palatine.output.logs import default_log_dir

__all__ = [
    "Handoff",
    "arm_parent_death_signal",
    "child_env",
    "describe_exit",
    "log_path_for",
    "stack_path_for",
]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def describe_exit(exit_code: int | None, exit_signal: int | None) -> str:
    """Human text for a process end: ``killed by signal 9 (SIGKILL)``, ``exited with code 3``.

    Used verbatim in exit reports and in the errors users see.
    """
    if exit_signal is not None:
        try:
            name = signal.Signals(exit_signal).name
        except ValueError:
            return f"killed by signal {exit_signal}"
        return f"killed by signal {exit_signal} ({name})"
    if exit_code is not None:
        return f"exited with code {exit_code}"
    return "exited (status unknown)"


_INDEX_RE = re.compile(r"\[(\d+)\]")


def _flat(name: object) -> str:
    """``hostw[0]`` -> ``hostw_0``: an id as one safe path component."""
    text = _INDEX_RE.sub(r"_\1", str(name))
    return text.replace(os.sep, "_").replace("\0", "_") or "_"


def log_path_for(
    log_dir: str | os.PathLike[str] | None,
    execution_id: str,
    host_proc: object,
    proc_id: object,
) -> Path:
    """The per-proc log file: ``<log_dir>/<execution_id>/<hostW_h>/<W>_<r>.log``.

    ``log_dir`` ``None`` means `default_log_dir`. Ids may be given as text or as id objects.
    """
    base = default_log_dir() if log_dir is None else Path(log_dir)
    return base / _flat(execution_id) / _flat(host_proc) / f"{_flat(proc_id)}.log"


def stack_path_for(log_path: Path) -> Path:
    """The child's stack-dump file (``PALATINE_STACK_FILE``), next to its log."""
    return log_path.with_suffix(".stack")


class Handoff(msgspec.Struct, frozen=True, kw_only=True):
    """What a parent hands a process it starts, in ``PALATINE_*`` variables, typed.

    The one place that names them: a host writes them for each proc (`child_env`), the
    proc reads them back (`from_env`); a launcher hands a role its lifeline pipe, a
    host its fork server their socket, and `palatine launch` a client script its job the
    same way. Empty text and ``None`` mean "not
    handed"; a number that does not parse reads as ``None``.
    """

    world_id: str = ""
    proc_id: str = ""
    bootstrap_addr: str = ""
    world_size: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    execution_id: str = ""
    host_proc_id: str = ""
    parent_pid: int | None = None
    stack_file: str = ""
    lifeline_fd: int | None = None
    fork_server_fd: int | None = None
    # GPUs per host: a worker keeps entry LOCAL_RANK % n of CUDA_VISIBLE_DEVICES
    devices_per_host: int | None = None
    # what `palatine launch` hands the client script it runs: `palatine.connect()` with
    # no arguments attaches to this system's worker world
    system_addr: str = ""
    worker_world: str = ""
    job_id: str = ""

    @staticmethod
    def variable(field: str) -> str:
        """``PALATINE_`` and the upper-cased field: ``proc_id`` -> ``PALATINE_PROC_ID``."""
        return "PALATINE_" + field.upper()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Handoff:
        """What this process was handed (``os.environ`` by default)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, default in zip(cls.__struct_fields__, cls.__struct_defaults__, strict=True):
            text = environ.get(cls.variable(field), "").strip()
            if not text:
                continue
            if default is None:
                try:
                    values[field] = int(text)
                except ValueError:
                    continue
            else:
                values[field] = text
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The variables for what is handed (fields left empty are not set)."""
        out = {}
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if value is not None and value != "":
                out[self.variable(field)] = str(value)
        return out


def child_env(
    *,
    world_id: object,
    proc_id: object,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    bootstrap_addr: str,
    execution_id: str,
    host_proc_id: object,
    stack_file: Path | str,
    cluster_token: str | None = None,
    supervision_update_interval_s: float | None = None,
    parent_pid: int | None = None,
    inherited: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables a host adds for an exec'd proc (the table).

    Returns only the additions; `ChildProcs.spawn` lays them over ``os.environ``.
    ``PALATINE_SUPERVISION_UPDATE_INTERVAL`` is left out when ``inherited`` (by default
    ``os.environ``) already sets it, so an operator's choice wins. ``parent_pid`` defaults
    to this process, the host; ``supervision_update_interval_s`` to the configured interval.
    ``PALATINE_CLUSTER_TOKEN`` is set when a token is given.
    """
    inherited = os.environ if inherited is None else inherited
    env = Handoff(
        world_id=str(world_id),
        proc_id=str(proc_id),
        bootstrap_addr=bootstrap_addr,
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        execution_id=execution_id,
        host_proc_id=str(host_proc_id),
        parent_pid=os.getpid() if parent_pid is None else parent_pid,
        stack_file=str(stack_file),
    ).to_env()
    # torch.distributed's own names for the same facts
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world_size),
    )
    if cluster_token is not None:
        env["PALATINE_CLUSTER_TOKEN"] = cluster_token
    if not inherited.get("PALATINE_SUPERVISION_UPDATE_INTERVAL"):
        interval = (
            config.get().supervision_update_interval_s
            if supervision_update_interval_s is None
            else supervision_update_interval_s
        )
        env["PALATINE_SUPERVISION_UPDATE_INTERVAL"] = format_seconds(interval)
    return env


def arm_parent_death_signal() -> bool:
    """Child side of the parent-death contract: die with the host that started us.

    When ``PALATINE_PARENT_PID`` is set, asks Linux (``prctl(PR_SET_PDEATHSIG, SIGKILL)``)
    to SIGKILL this process when its parent ends, then checks that the parent is still
    the one named: if it already died (we were re-parented), the process exits at once
    with status 1 instead of running orphaned. Returns whether the signal was armed;
    without the variable, or off Linux, it does nothing.
    """
    text = os.environ.get(Handoff.variable("parent_pid"), "").strip()
    if not text:
        return False
    expected = Handoff.from_env().parent_pid
    if expected is None:
        log.warning("ignoring PALATINE_PARENT_PID=%r: not a pid", text)
        return False
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.prctl(
                _PR_SET_PDEATHSIG,
                ctypes.c_ulong(signal.SIGKILL),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
            )
        except (OSError, AttributeError) as e:
            log.warning("cannot arm the parent-death signal: %s", e)
        else:
            if rc == 0:
                armed = True
            else:
                err = ctypes.get_errno()
                log.warning("cannot arm the parent-death signal: %s", os.strerror(err))
    # Checked after arming: a parent dying between the two is then caught by one of them.
    if os.getppid() != expected:
        log.error("parent process %d is gone (parent is now %d); exiting", expected, os.getppid())
        logging.shutdown()
        os._exit(1)
    return armed
