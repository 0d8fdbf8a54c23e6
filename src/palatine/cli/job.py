"""``palatine job status|cancel JOB``: a Slurm job that palatine launched, by its job id.

``status`` prints Slurm's state of the job (state, time, nodes) and, where its record is
readable here (the submitting user, on the submitting machine), the worlds and procs
its system reports: which rank runs on which host, and how healthy it is; it leaves no
trace in the job's output. ``cancel`` runs ``scancel``, waits until Slurm no longer lists
the job, and asks the job's system to stop, unless the process that applied the job has
ended (or ends meanwhile): then the job is cancelled, and that is the answer. The
program that ran against it gets a `DeviceException` naming the lost ranks. A job that palatine runs inside its owner's allocation (a batch script)
loses only palatine's step there (its launcher then stops the rest): the allocation goes
on. A job id Slurm does not list is exit 1; ``--json`` prints one document.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["add_arguments", "run"]

_ANSWER_S = 10.0  # the system's answer to a snapshot or a stop
_GONE_S = 30.0  # a cancelled job leaving squeue


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action", choices=["status", "cancel"], help="status: show the job; cancel: end it"
    )
    p.add_argument("job_id", metavar="JOB", help="the Slurm job id")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import setup_logging
    from palatine.errors import SchedulerError
    from palatine.job.slurm import find_job

    setup_logging()
    root = logging.getLogger()
    if root.getEffectiveLevel() == logging.INFO:  # (unless DEBUG was asked for)
        root.setLevel(logging.WARNING)  # an observer's own comings and goings are no news
    job = args.job_id.strip()
    if not job.replace("_", "").isdigit():
        print(f"palatine job: {job!r} is not a Slurm job id", file=sys.stderr)
        return 2
    try:
        info, record = find_job(job)
    except SchedulerError as e:
        print(f"palatine job: {e}", file=sys.stderr)
        return 1
    if info is None:
        print(f"palatine job: job {job} is not in Slurm's queue (it ended, or never was)",
              file=sys.stderr)  # fmt: skip
        return 1
    if args.action == "cancel":
        return _cancel(job, record)
    return _status(job, info, record, args.json)


def _status(job: str, info: dict[str, str], record: Any, as_json: bool) -> int:
    import msgspec

    snap, why = (None, "no palatine record of this job is readable here")
    if record is not None:
        snap, why = _ask(record, lambda client: client.snapshot())
    if as_json:
        doc = {
            "job": {"id": job, **info},
            "record": record,
            "system": snap,
            "system_error": None if snap is not None else why,
        }
        sys.stdout.write(msgspec.json.encode(doc).decode() + "\n")
        return 0
    print(
        f"job {job}: {info.get('state', '?')} for {info.get('elapsed', '?')} on "
        f"{info.get('nodes', '?')} node(s) ({info.get('nodelist') or 'none yet'})"
    )
    if snap is None:
        print(f"  system: {why}")
        return 0
    print(f"  system {record.system_addr} ({record.transport}), launched by pid {record.pid}")
    for name, world in snap.worlds.items():
        alive = sum(1 for p in world.procs.values() if p.health == "Alive")
        print(f"  world {name}: {world.status}, {alive}/{len(world.procs)} procs alive")
        if name != record.worker_world:
            continue
        for proc, entry in sorted(world.procs.items(), key=lambda kv: _rank(kv[0])):
            reason = f" ({entry.reason})" if entry.reason else ""
            print(
                f"    {proc}: {entry.health} on {entry.host or '?'} at {entry.addr or '?'} "
                f"pid {entry.pid}{reason}"
            )
    return 0


def _rank(proc: str) -> int:
    try:
        return int(proc.rsplit("[", 1)[1].rstrip("]"))
    except (IndexError, ValueError):
        return 0


def _cancel(job: str, record: Any) -> int:
    from palatine.job.slurm import find_job

    if record is not None and record.step_name:
        return _cancel_step(job, record)
    try:
        done = subprocess.run(["scancel", job], capture_output=True, text=True,
                              timeout=_ANSWER_S * 6, check=False)  # fmt: skip
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        print(f"palatine job: scancel {job}: {e}", file=sys.stderr)
        return 1
    if done.returncode != 0:
        print(f"palatine job: scancel {job}: {done.stderr.strip()}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + _GONE_S
    while time.monotonic() < deadline and find_job(job)[0] is not None:
        time.sleep(0.2)
    left = find_job(job)[0]
    text = f"job {job}: cancelled" if left is None else f"job {job}: still {left['state']}"
    print(text + (_stop_system(record) if record is not None else ""))
    return 0 if left is None else 1


def _cancel_step(job: str, record: Any) -> int:
    """A job that runs inside its owner's allocation (a batch script): end palatine's
    step there, not the allocation. The hosts' ranks are reported lost to the program
    that runs against them, and its launcher stops the system and the controller when
    the program ends (stopping them here could beat that report to the program)."""
    from palatine.job.slurm import cancel_steps, steps_named

    steps = cancel_steps(job, record.step_name)
    deadline = time.monotonic() + _GONE_S  # (the hosts end first: the ranks are reported)
    while steps and time.monotonic() < deadline and steps_named(job, record.step_name):
        time.sleep(0.2)
    left = steps_named(job, record.step_name) if steps else []
    if not steps:
        text = f"job {job}: no step of palatine's ({record.step_name}) is running"
    elif left:
        text = f"job {job}: palatine's step {', '.join(left)} is still running"
    else:
        text = f"job {job}: palatine's step {', '.join(steps)} cancelled; the allocation goes on"
    print(text)
    return 1 if left else 0


def _stop_system(record: Any) -> str:
    """Ask the job's system to stop, unless the process that applied the job (its client
    or ``palatine launch``) is gone or goes meanwhile: the system went with it, and the
    job is simply cancelled. What to add to the report."""
    launcher = _launcher_pidfd(record)
    if launcher == _GONE:
        return ""
    try:
        ack, why = _ask(record, lambda client: client.stop(None, 5.0), launcher)
    finally:
        if launcher is not None:
            os.close(launcher)
    if ack is _LAUNCHER_ENDED:
        return ""
    if ack is not None:
        return f"; its system at {record.system_addr} is stopping"
    return f"; its system did not answer ({why})"


_GONE = -1  # `_launcher_pidfd`: the process has ended already
_LAUNCHER_ENDED: Any = object()  # `_ask`'s answer when that process ended meanwhile


def _launcher_pidfd(record: Any) -> int | None:
    """A pidfd of the process that applied the job (readable once it has ended), `_GONE`
    when it has already ended, None when that cannot be watched from here (it runs on
    another machine, or this kernel has no pidfds)."""
    if record.machine != socket.gethostname():
        return None
    try:
        return os.pidfd_open(record.pid)
    except ProcessLookupError:
        return _GONE
    except (OSError, AttributeError):
        return None


def _ask(record: Any, request: Any, launcher: int | None = None) -> tuple[Any, str]:
    """Attach to the job's system with its token and make one request; (answer, why not).
    With ``launcher`` (a pidfd of the process that applied the job), the answer is
    `_LAUNCHER_ENDED` as soon as that process ends: its system goes with it.

    The client leaves no trace in the job's output: its heartbeats stop before it
    leaves, so that none reaches the system after it has gone."""
    from palatine.channel.addr import ChannelAddr
    from palatine.channel.token import set_token
    from palatine.core import runtime
    from palatine.core.runtime import new_event_loop
    from palatine.system.service import System

    token = record.token()
    if token is None:
        return None, f"its token in {record.log_dir} is not readable here"
    set_token(token)

    async def ask() -> Any:
        runtime.adopt_current_loop()
        async with asyncio.timeout(_ANSWER_S + 1):
            client = await System(ChannelAddr.parse(record.system_addr)).attach(timeout_s=_ANSWER_S)
            try:
                return await request(client)
            finally:
                heartbeat = client.handle.agent.heartbeat
                if heartbeat is not None:
                    await asyncio.to_thread(heartbeat.stop, 1.0)
                try:
                    await client.close()
                except Exception:  # noqa: BLE001 - a stopping system may be gone already
                    pass

    async def ask_unless_gone() -> Any:
        if launcher is None:
            return await ask()
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def ended() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(launcher, ended)
        asking = asyncio.ensure_future(ask())
        try:
            await asyncio.wait([asking, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(launcher)
        if asking.done():
            return asking.result()
        asking.cancel()
        await asyncio.wait([asking], timeout=1.0)
        return _LAUNCHER_ENDED

    loop = new_event_loop()
    try:
        return loop.run_until_complete(ask_unless_gone()), ""
    except TimeoutError:
        return None, f"no answer within {_ANSWER_S:g} s"
    except Exception as e:  # noqa: BLE001 - a CLI reports and exits
        return None, str(e)
    finally:
        loop.close()
