"""``palatine launch``: run a client program against a job's mesh.

    palatine launch --scheduler slurm --hosts 2 --procs-per-host 2 -- python train.py

The launcher applies the job (`palatine.job.SlurmJob`: the system and the controller
start here and one host per node is submitted with ``sbatch``; `palatine.job.LocalJob`
for ``--scheduler local``), waits until every host has joined, then runs the program
with the job in its environment (``PALATINE_SYSTEM_ADDR``, ``PALATINE_WORKER_WORLD``,
``PALATINE_JOB_ID``, ``PALATINE_CLUSTER_TOKEN``), where ``palatine.connect()`` finds it.
When the program ends, however it ends (SIGKILL included), the launcher stops the job's
worker and controller worlds through the job's system at once, as the program's own
shutdown does: the controller never waits to find its client lost, and the workers stop
before anything is killed. Then the job is torn down (``scancel``, then the controller
and the system), and the launcher exits with the program's status. Inside an allocation (a
batch script, ``salloc``) nothing is submitted: the hosts run as a step of that
allocation, and that step is what ends (``--submit`` submits a job anyway).

Ctrl-C or SIGTERM goes to the program; a second one kills it. SIGHUP (an ssh session
that drops) is ignored, by the launcher and the program alike: the job goes on.
``--detach`` runs the launcher in a session of its own, its output in
``./palatine-logs/launch-*.out``, and returns at once: the job stays running. A scheduler
that refuses the job, or a job that ends before its hosts joined, is one line on stderr
and exit 1.

Inside an allocation ``--hosts`` defaults to its node count (``SLURM_JOB_NUM_NODES``);
``--procs-per-host gpu`` takes the node's GPU count (``SLURM_GPUS_ON_NODE`` inside an
allocation, else ``--gpus-per-node``, else, on a node of the job, its NVIDIA GPUs) and
makes the workers CUDA workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scheduler",
        choices=["slurm", "local"],
        default="slurm",
        help="where the hosts run: Slurm nodes, or this machine",
    )
    p.add_argument(
        "--hosts",
        type=int,
        help="hosts (nodes) of the job (default inside a Slurm allocation: its node count)",
    )
    p.add_argument(
        "--procs-per-host",
        type=_procs_per_host,
        required=True,
        metavar="N|gpu",
        help="worker procs per host, or 'gpu': one per GPU of the node",
    )
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time-limit", help="Slurm time limit (sbatch --time)")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (CUDA workers)")
    p.add_argument(
        "--transport",
        choices=["tcp", "tls"],
        default="tcp",
        help="between the nodes and this machine (slurm; tls reads PALATINE_TLS_*)",
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more sbatch argument (repeatable)",
    )
    p.add_argument(
        "--submit",
        action="store_true",
        help="inside a Slurm allocation, submit a job of its own instead of using it",
    )
    p.add_argument("--log-dir", help="where the job's logs go (kept)")
    p.add_argument(
        "--metrics-addr",
        metavar="HOST:PORT",
        help="the job's system serves Prometheus metrics there (port 0: any free port; "
        "HTTPS under --transport tls), to the scrape token in the log dir's metrics-token",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="return at once and leave the launcher (and the job) running in the background",
    )
    p.add_argument(
        "--start-timeout-in-sec",
        type=float,
        default=300.0,
        help="bound on queue time plus start-up",
    )
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")


def _procs_per_host(text: str) -> int | str:
    """``--procs-per-host``: a number, or ``gpu`` (resolved by `_resolve_shape`)."""
    if text == "gpu":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or 'gpu', not {text!r}") from None
    return n


def _node_gpus(args: argparse.Namespace) -> int:
    """The GPUs of a node of the job (`--procs-per-host gpu`); 0 if nobody says. This
    machine's own count only where it is one of the job's nodes (a local job, or the
    batch node of the allocation), never a submit host's."""
    inside = args.scheduler == "slurm" and not args.submit and os.environ.get("SLURM_JOB_ID")
    on_node = os.environ.get("SLURM_GPUS_ON_NODE", "")
    if inside and on_node.isdigit():
        return int(on_node)
    if args.gpus_per_node:
        return int(args.gpus_per_node)
    if not (inside or args.scheduler == "local"):
        return 0
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _resolve_shape(args: argparse.Namespace) -> None:
    """Fill in ``--hosts`` (an allocation's node count) and ``--procs-per-host gpu``;
    `ValueError` saying what to give when neither is known."""
    if args.hosts is None:
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or ""
        inside = args.scheduler == "slurm" and not args.submit and os.environ.get("SLURM_JOB_ID")
        if not (inside and nodes.isdigit()):
            raise ValueError("give --hosts (only inside a Slurm allocation is it its node count)")
        args.hosts = int(nodes)
    if args.procs_per_host == "gpu":
        gpus = _node_gpus(args)
        if gpus < 1:
            raise ValueError(
                "--procs-per-host gpu: no GPU count known (no SLURM_GPUS_ON_NODE, no "
                "--gpus-per-node, no NVIDIA GPU here): give a number"
            )
        args.procs_per_host = gpus
        args.gpus_per_node = args.gpus_per_node or gpus


def _detach(argv: list[str]) -> int:
    """Run ``palatine launch argv`` (less ``--detach``) in a session of its own, its
    output in ``./palatine-logs/launch-<time>-<pid>.out``; report where, and return."""
    cut = argv.index("--") if "--" in argv else len(argv)
    own = [a for a in argv[:cut] if a != "--detach"] + argv[cut:]
    logs = os.path.join(os.getcwd(), "palatine-logs")
    os.makedirs(logs, exist_ok=True)
    path = os.path.join(logs, f"launch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.out")
    with open(path, "ab") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "palatine", "launch", *own],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(
        f"palatine launch: detached (pid {child.pid}); its output goes to {path}; "
        "'palatine ps' lists the job once it is up",
        file=sys.stderr,
    )
    return 0


def _job(args: argparse.Namespace) -> Any:
    if args.scheduler == "local":
        from palatine.job.local import LocalJob

        options: dict[str, Any] = {"startup_timeout_s": args.start_timeout_in_sec}
        if args.log_dir:
            options["log_dir"] = args.log_dir
        if args.metrics_addr:
            options["metrics_addr"] = args.metrics_addr
        return LocalJob(args.hosts, args.procs_per_host, **options)
    from palatine.job.slurm import SlurmJob

    metrics = {"metrics_addr": args.metrics_addr} if args.metrics_addr else {}
    return SlurmJob(
        args.hosts,
        args.procs_per_host,
        partition=args.partition,
        time_limit=args.time_limit,
        account=args.account,
        gpus_per_node=args.gpus_per_node,
        sbatch_args=args.sbatch_arg,
        log_dir=args.log_dir,
        transport=args.transport,
        startup_timeout_s=args.start_timeout_in_sec,
        use_allocation=False if args.submit else None,
        **metrics,
    )


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import setup_logging
    from palatine.errors import SchedulerError

    command = list(args.program)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("palatine launch: give the program to run after '--'", file=sys.stderr)
        return 2
    try:
        _resolve_shape(args)
    except ValueError as e:
        print(f"palatine launch: {e}", file=sys.stderr)
        return 2
    if args.detach:
        if "launch" not in sys.argv:
            print("palatine launch: --detach is for the command line", file=sys.stderr)
            return 2
        return _detach(sys.argv[sys.argv.index("launch") + 1 :])
    setup_logging()
    try:
        job = _job(args)
    except ValueError as e:
        print(f"palatine launch: {e}", file=sys.stderr)
        return 2
    interrupted: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        interrupted.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (the program's too)
    status = 1
    try:
        t0 = time.monotonic()
        job.apply()
        if interrupted:
            return 128 + interrupted[0]
        job.state()
        print(
            f"palatine launch: job {job.job_id}: {args.hosts} host(s) × {args.procs_per_host} "
            f"procs up in {time.monotonic() - t0:.1f} s; running {' '.join(command)}",
            file=sys.stderr,
            flush=True,
        )
        if job.metrics is not None:
            print(f"palatine launch: {job.metrics.describe()}", file=sys.stderr, flush=True)
        if interrupted:
            return 128 + interrupted[0]
        env = job.client_env()
        status = _run_program(command, {**os.environ, **env}, interrupted)
        _end_worlds(env)
    except SchedulerError as e:
        print(f"palatine launch: {e}", file=sys.stderr)
    except (RuntimeError, TimeoutError) as e:
        print(f"palatine launch: the job did not start: {e}", file=sys.stderr)
    finally:
        job.cancel(clean=status == 0)
        for s, h in old.items():
            signal.signal(s, h)
    return status


_END_STOP_S = 1.0  # each worker proc's stop, when the program has ended
_END_GONE_S = 2.0  # the worlds' procs all gone (a node cut off never answers)


def _end_worlds(env: dict[str, str]) -> None:
    """Stop the job's worker and controller worlds (bounded; a job that does not answer
    is torn down by the caller anyway). A program that shut its mesh down has stopped
    them already: then this is one short request."""
    import asyncio

    from palatine.channel.token import TOKEN_ENV, set_token
    from palatine.core import runtime
    from palatine.system.service import System
    from palatine.tensor.client.shutdown import stop_worlds

    async def end() -> None:
        runtime.adopt_current_loop()
        worlds = [env["PALATINE_WORKER_WORLD"], "controller"]
        async with asyncio.timeout(_END_STOP_S + _END_GONE_S + 2.0):
            client = await System(env["PALATINE_SYSTEM_ADDR"]).attach(timeout_s=_END_STOP_S)
            try:
                client.client.quiet_returns = True
                await stop_worlds(client, worlds, _END_STOP_S, _END_GONE_S)
            finally:
                await client.close()

    set_token(env[TOKEN_ENV])
    loop = runtime.new_event_loop()
    try:
        loop.run_until_complete(end())
    except Exception as e:  # noqa: BLE001 - the teardown that follows stops the job anyway
        log.debug("stopping the job's worlds: %s", e)
    finally:
        loop.close()


def _terminal_signals_group() -> bool:
    """Whether this process group is the terminal's foreground group (so a Ctrl-C there
    reaches the program as well, and passing it on would deliver it twice)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _run_program(command: list[str], env: dict[str, str], interrupted: list[int]) -> int:
    """Run ``command``; pass the first signal on, kill on the second; its exit status."""
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as e:
        print(f"palatine launch: cannot run {command[0]}: {e}", file=sys.stderr)
        return 127
    passed = 0
    while True:
        try:
            code = child.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        if len(interrupted) > passed:
            passed = len(interrupted)
            if passed > 1:
                child.kill()
            elif interrupted[0] != signal.SIGINT or not _terminal_signals_group():
                child.send_signal(interrupted[0])  # a Ctrl-C at the terminal reached it too
    return code if code >= 0 else 128 - code
