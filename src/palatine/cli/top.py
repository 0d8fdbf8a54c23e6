"""``palatine top``: a live view of a running system's worlds and procs.

    palatine top --system-addr ADDR [--world W ...] [--interval-in-sec 1] [--once]

One frame is a table per world: each proc's health, host, pid, heartbeat age, event-loop
lag, failed actors and, for procs on this machine, CPU and RSS (from ``psutil``; ``-``
for procs elsewhere). It refreshes every ``--interval-in-sec``; ``q`` (or Ctrl-C) quits.
``--once`` prints one frame and exits, for scripts and tests. Over ``tcp:`` and ``tls:``
as every client; a wrong token is refused at once (exit 1), and a missing one is never
made up (`palatine.channel.token`).

A proc's CPU figure is its use between two readings, so each proc keeps its sampler
across refreshes; a proc seen for the first time shows ``-`` until its second reading,
and ``--once`` reads every proc twice, ``--interval-in-sec`` apart, before it prints.
Not on a terminal (a pipe, a file), the table is printed whole, however wide: a cell is
never cut to a terminal's 80 columns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import select
import socket
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["add_arguments", "run", "frame"]

log = logging.getLogger(__name__)

_ANSWER_S = 10.0
_PIPE_WIDTH = 100_000  # columns of output that is not a terminal: no table is that wide


def add_arguments(p: argparse.ArgumentParser) -> None:
    from palatine.cli.target import add_target_flags

    add_target_flags(p)
    p.add_argument("--world", action="extend", nargs="+", default=[], metavar="W",
                   help="only these worlds (repeatable)")  # fmt: skip
    p.add_argument("--interval-in-sec", type=float, default=1.0, help="refresh period")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


def _local_usage(pid: int | None, host: str, cpu: dict[int, Any]) -> tuple[str, str]:
    """CPU % and RSS of ``pid`` when it runs on this machine; ``-`` otherwise."""
    if pid is None or host != socket.gethostname():
        return "-", "-"
    import psutil

    try:
        proc = cpu.get(pid)
        if proc is None:
            proc = cpu[pid] = psutil.Process(pid)
            proc.cpu_percent(None)  # the first reading only starts the interval
            use = "-"
        else:
            use = f"{proc.cpu_percent(None):.0f}%"
        return use, f"{proc.memory_info().rss / 2**20:.0f} MiB"
    except psutil.Error:
        cpu.pop(pid, None)
        return "-", "-"


def _start_samplers(snap: Any, cpu: dict[int, Any]) -> None:
    """Take the first CPU reading of every live proc of ``snap`` on this machine."""
    for world in snap.worlds.values():
        for e in world.procs.values():
            if e.health == "Alive":
                _local_usage(e.pid, e.host, cpu)


def frame(snap: Any, cpu: dict[int, Any]) -> Any:
    """The rich renderable of one snapshot."""
    from rich.console import Group
    from rich.table import Table

    tables = []
    for name, world in snap.worlds.items():
        alive = sum(1 for e in world.procs.values() if e.health == "Alive")
        table = Table(
            title=f"world {name}: {world.status}, {alive}/{len(world.procs)} procs alive",
            title_justify="left",
        )
        for col in ("proc", "health", "host", "pid", "heartbeat", "loop lag", "cpu", "rss",
                    "doing", "failed actors", "reason"):  # fmt: skip
            table.add_column(col)
        for proc, e in world.procs.items():
            age = "-" if e.last_heartbeat_age_s is None else f"{e.last_heartbeat_age_s:.1f} s ago"
            lag = "-" if e.loop_lag_s is None else f"{e.loop_lag_s * 1e3:.1f} ms"
            use, rss = _local_usage(e.pid, e.host, cpu) if e.health == "Alive" else ("-", "-")
            failed = ", ".join(f.actor_id for f in e.failed_actors) or "-"
            doing = e.activity or "-"
            table.add_row(proc, e.health, e.host, str(e.pid or "-"), age, lag, use, rss,
                          doing, failed, e.reason or "")  # fmt: skip
        tables.append(table)
    return Group(*tables) if tables else "no worlds"


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import ask_system, setup_logging
    from palatine.cli.target import resolve_target

    setup_logging()
    resolve_target(args, "top")
    t = args.interval_in_sec
    if not (t > 0 and math.isfinite(t)):
        print(f"palatine top: --interval-in-sec must be > 0, got {t:g}", file=sys.stderr)
        return 2
    return int(ask_system("top", args.system_addr, lambda: _main(args)))


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """Single key presses from a terminal stdin (nothing when stdin is not one)."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from palatine.channel.token import resolve_token
    from palatine.core import runtime
    from palatine.system.service import System

    runtime.adopt_current_loop()
    async with asyncio.timeout(_ANSWER_S + 1):
        resolve_token(create=False)  # a client never makes one up: see token.py
        client = await System(args.system_addr).attach(timeout_s=_ANSWER_S)
    cpu: dict[int, Any] = {}
    try:

        async def snapshot() -> Any:
            async with asyncio.timeout(_ANSWER_S):
                return await client.snapshot(args.world or None)

        # Not a terminal: as wide as the table is (rich would cut every cell at 80).
        console = Console() if sys.stdout.isatty() else Console(width=_PIPE_WIDTH)
        if args.once:
            _start_samplers(await snapshot(), cpu)
            await asyncio.sleep(args.interval_in_sec)
            console.print(frame(await snapshot(), cpu))
            return 0
        with _keys() as key_fd, Live(frame(await snapshot(), cpu), console=console,
                                     auto_refresh=False) as live:  # fmt: skip
            while True:
                deadline = asyncio.get_running_loop().time() + args.interval_in_sec
                while asyncio.get_running_loop().time() < deadline:
                    pressed = key_fd is not None and select.select([key_fd], [], [], 0)[0]
                    if pressed and os.read(key_fd, 1) in (b"q", b"Q"):
                        return 0
                    await asyncio.sleep(0.05)
                live.update(frame(await snapshot(), cpu), refresh=True)
    finally:
        try:
            await client.close()
        except Exception as e:  # noqa: BLE001 - leaving anyway: the system drops the link
            log.debug("closing the system client: %s", e)
