"""``palatine torchrun``: run a torchrun script on a palatine mesh, with torchrun's flags.

    palatine torchrun --nproc-per-node 4 train.py --lr 0.1
    palatine torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 -m pkg.train

Each rank is a palatine proc running the program as ``__main__`` with torchrun's
variables (`palatine.spmd`). What it prints appears behind its world and rank, identical
lines of several ranks once; a rank's death is named (world, rank, host, pid, signal)
milliseconds after it happened; ``palatine stacks`` / ``palatine top`` work on the job
(the system's address is printed at the start). A failure restarts the whole group, up to
``--max-restarts`` times, from the host's warm fork server. The exit status is torchrun's:
0 when every rank succeeded, 1 otherwise, after a failure summary in torchrun's layout.

``--nnodes N`` on one machine runs N groups of ``--nproc-per-node`` procs here (a mesh
``{"nodes": N, "procs": P}``); with ``--scheduler slurm`` it is N nodes of a Slurm job
(`palatine.job.SlurmJob`: submitted, or the allocation this runs in), one group each. Accepted and ignored, as they have no meaning here:
``--rdzv-backend``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf``, ``--standalone``,
``--node-rank``, ``--monitor-interval``, ``--start-method``, ``--redirects``, ``--tee``,
``--log-dir``, ``--local-addr``, ``--role``. ``--master-addr`` / ``--master-port`` are used
when given (else rank 0's machine and a free port there).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

__all__ = ["add_arguments", "nproc_per_node", "run"]

#: Accepted for torchrun's command lines, and ignored (see the module's text).
IGNORED = (
    "rdzv-backend",
    "rdzv-endpoint",
    "rdzv-id",
    "rdzv-conf",
    "node-rank",
    "monitor-interval",
    "start-method",
    "redirects",
    "tee",
    "log-dir",
    "local-addr",
    "role",
)


#: What the fork server imports before the first group is forked
#: (`palatine.hosting.forkserver`), so that every group's procs start with it: torch, and
#: what ``init_process_group`` and DDP's constructor import on first use (torch._dynamo
#: alone is ≈ 1.5 s of CPU).
WARM = "torch,torch._dynamo,torch.distributed,torch.nn.parallel,palatine.spmd.actor"
#: How long the first group waits for that import (a slower one: the ranks import cold).
WARM_S = 60.0


def _flag(p: argparse.ArgumentParser, name: str, **kw: Any) -> None:
    """``--a-b`` and torchrun's other spelling ``--a_b``."""
    p.add_argument(f"--{name}", f"--{name.replace('-', '_')}", **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    _flag(p, "nnodes", default="1", help="N or MIN:MAX (this machine: N groups of procs)")
    _flag(p, "nproc-per-node", default="1", help="N, gpu, cpu or auto")
    _flag(p, "max-restarts", type=int, default=0, help="restarts of the group on a failure")
    _flag(p, "master-addr", default=None, help="MASTER_ADDR (default: rank 0's machine)")
    _flag(p, "master-port", type=int, default=None, help="MASTER_PORT (default: a free one)")
    p.add_argument("--standalone", action="store_true", help="accepted (always standalone)")
    p.add_argument(
        "--scheduler",
        choices=["local", "slurm"],
        default="local",
        help="local: this machine; slurm: --nnodes nodes of a Slurm job (or of the allocation)",
    )
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time-limit", help="Slurm time limit (sbatch --time)")
    p.add_argument("--account", help="Slurm account")
    p.add_argument(
        "--start-timeout-in-sec", type=float, default=300.0, help="Slurm: queue time plus start-up"
    )
    for name in IGNORED:
        _flag(p, name, default=None, help=argparse.SUPPRESS)
    p.add_argument("-m", "--module", action="store_true", help="run the program as a module")
    p.add_argument("--no-python", "--no_python", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("training_script", help="the script (or module, with -m)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)


def nproc_per_node(text: str) -> int:
    """``--nproc-per-node``: a count, or ``gpu`` (the visible GPUs), ``cpu`` (the CPUs
    this process may run on), ``auto`` (GPUs when there are any, else CPUs)."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus or text == "gpu":
            if not gpus:
                raise ValueError("--nproc-per-node gpu: no GPU is visible")
            return gpus
    if text in ("cpu", "auto"):
        return len(os.sched_getaffinity(0))
    raise ValueError(f"--nproc-per-node must be a positive count, gpu, cpu or auto, not {text!r}")


def _nnodes(text: str) -> int:
    low, _, high = text.partition(":")
    if not low.isdigit() or (high and not high.isdigit()) or int(low) < 1:
        raise ValueError(f"--nnodes must be N or MIN:MAX, not {text!r}")
    return int(high or low)


def _say(line: str) -> None:
    print(f"[palatine torchrun] {line}", file=sys.stderr, flush=True)


class _Record:
    """The run's job record while it lasts (`palatine.job.records`): ``palatine ps``
    lists it, and ``palatine stacks``/``top``/``snapshot --job ID`` reach its procs."""

    def __init__(self, shape: str) -> None:
        from palatine.job.records import RecordDir

        self.shape = shape
        self.dir = RecordDir()
        self.job_id: str | None = None

    def start(self, system_addr: str) -> None:
        import secrets
        import socket
        import time

        from palatine.channel.token import resolve_token
        from palatine.job.records import JobRecord, announce

        job_id = f"torchrun-{os.getpid()}-{secrets.token_hex(2)}"
        try:
            token_file = self.dir.write_token(job_id, resolve_token(create=False).decode())
            self.dir.write(
                JobRecord(
                    id=job_id,
                    system_addr=system_addr,
                    token_file=str(token_file),
                    log_dir="",
                    pid=os.getpid(),
                    started=time.time(),
                    shape=self.shape,
                    machine=socket.gethostname(),
                )
            )
        except (OSError, ValueError) as e:
            _say(f"cannot record the job for palatine ps ({self.dir.path}): {e}")
            return
        self.job_id = job_id
        announce(job_id)

    def close(self) -> None:
        if self.job_id is not None:
            self.dir.remove(self.job_id)


def _print_stuck(stacks: dict[str, str]) -> None:
    """The ranks still running when the group stops for a failure, by stack."""
    from palatine.cli.stacks import group_stacks, rank_ranges

    for procs, text in group_stacks(stacks):
        ranks = rank_ranges([int(p.rsplit("[", 1)[1].rstrip("]")) for p in procs])
        word = "rank" if len(procs) == 1 else "ranks"
        _say(f"{word} {ranks} still running when the group stopped, in:")
        print(text.rstrip(), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import setup_logging

    if args.no_python:
        _say("--no-python is not supported: the program runs in palatine's Python procs")
        return 2
    try:
        nnodes = _nnodes(args.nnodes)
        nproc = nproc_per_node(args.nproc_per_node)
    except ValueError as e:
        _say(str(e))
        return 2
    ignored = [f"--{n}" for n in IGNORED if getattr(args, n.replace("-", "_")) is not None]
    if ignored:
        _say(f"ignoring {', '.join(ignored)}: palatine's system is the rendezvous")
    program = [*(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    extra: dict[str, str] = {}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        extra["OMP_NUM_THREADS"] = "1"  # as torchrun does
        # (here too: the fork server, which imports torch for restarts, inherits it; a
        # torch imported without it spins OpenMP threads beside each rank's program)
        os.environ["OMP_NUM_THREADS"] = "1"
        _say("OMP_NUM_THREADS=1 for each rank (as torchrun sets it); set it to choose")
    if os.environ.get("PALATINE_LOG_LEVEL"):  # else palatine's warnings and errors only
        setup_logging()
    from palatine import config

    # The fork server imports torch once the first group is up: a restarted group's
    # procs are forked with it imported (unless PALATINE_FORK_SERVER_WARM says otherwise).
    os.environ.setdefault(config.env_var("fork_server_warm"), WARM)
    config.reload()
    from palatine.errors import SchedulerError
    from palatine.spmd.launcher import Interrupted, launch
    from palatine.spmd.summary import failure_summary

    record = _Record(f"{nnodes}x{nproc}")
    job: Any = None
    if args.scheduler == "slurm":
        from palatine.job.slurm import SlurmJob

        job = SlurmJob(
            nnodes,
            1,
            partition=args.partition,
            time_limit=args.time_limit,
            account=args.account,
            startup_timeout_s=args.start_timeout_in_sec,
        )
        try:
            hosts: Any = job.host_mesh()  # (a Slurm job records itself for palatine ps)
        except (SchedulerError, RuntimeError, TimeoutError) as e:
            _say(f"the Slurm job did not start: {e}")
            job.cancel(clean=False)
            return 1
        per_host = {"procs": nproc}
    else:
        from palatine.job.hostmesh import this_host

        hosts = this_host()
        per_host = {"nodes": nnodes, "procs": nproc} if nnodes > 1 else {"procs": nproc}
    signals: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        signals.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if job is None:
            from palatine.core import runtime
            from palatine.job.hostmesh import warm_procs

            # Every rank imports torch: the fork server imports it once, before the
            # first group is forked, instead of each rank on its own (torchrun's way,
            # which on shared cores costs the first step the imports of all ranks).
            runtime.submit(lambda: warm_procs(WARM_S)).get()
        result = launch(
            program,
            hosts,
            per_host,
            max_restarts=args.max_restarts,
            say=_say,
            extra_env=extra,
            master=(args.master_addr, args.master_port),
            on_stuck=_print_stuck,
            on_start=record.start if job is None else None,
            interrupted=lambda: bool(signals),
        )
    except Interrupted:
        _say(f"{signal.Signals(signals[0]).name}: the group was stopped")
        return 128 + signals[0]
    finally:
        record.close()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if job is not None:
            job.cancel(clean=not signals)
    if result.status:
        print(failure_summary(result), file=sys.stderr, flush=True)
    return result.status
