"""``palatine top``: a live view of a running system's worlds and procs.

    palatine top [--job ID|latest | --system-addr ADDR] [--world W ...]
                 [--sort rank|cpu|rss|lag] [--interval-in-sec 1] [--once]

One frame is a table per world: each proc's health, host, pid, heartbeat age, event-loop
lag, CPU, RSS and, where its host has NVML and the proc a GPU, GPU utilisation and
memory, the op it runs and its failed actors. CPU, RSS and GPU come with each proc's
heartbeats (`palatine.hosting.resources`), so procs on every host show them; a proc
whose heartbeats carry none (a proc of an older palatine) is read here with ``psutil``
when it runs on this machine, ``-`` elsewhere. Rows are in rank order, or with
``--sort`` the busiest first (by CPU, RSS or loop lag); on a terminal the keys ``c``,
``m``, ``l`` and ``r`` sort by CPU, memory, lag and rank, and a mesh taller than the
terminal scrolls (``j``/``k`` a row, space or ``f``/``b`` a page, ``g`` the top; the
table says which rows it shows). It refreshes every
``--interval-in-sec``; ``q`` (or Ctrl-C) quits. ``--once`` prints one frame and exits,
for scripts and tests. Over ``tcp:`` and ``tls:`` as every client; a wrong token is
refused at once (exit 1), and a missing one is never made up (`palatine.channel.token`).

A proc's CPU figure is its use between two readings: a proc seen for the first time
shows ``-`` until its second, and ``--once`` reads every proc twice,
``--interval-in-sec`` apart, before it prints.
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

__all__ = ["SORT_KEYS", "add_arguments", "run", "frame", "usage_of"]

#: Row orders of ``--sort`` (and the key that picks each in the live view).
SORT_KEYS = ("rank", "cpu", "rss", "lag")
_SORT_BY_KEY = {b"c": "cpu", b"m": "rss", b"l": "lag", b"r": "rank"}
#: Scrolling keys of the live view: rows moved (``None``: back to the first row; a
#: float: that many pages).
_SCROLL_BY_KEY: dict[bytes, float | None] = {
    b"j": 1, b"k": -1, b" ": 1.0, b"f": 1.0, b"b": -1.0, b"g": None,
}  # fmt: skip

log = logging.getLogger(__name__)

_ANSWER_S = 10.0
_PIPE_WIDTH = 100_000  # columns of output that is not a terminal: no table is that wide


def add_arguments(p: argparse.ArgumentParser) -> None:
    from palatine.cli.target import add_target_flags

    add_target_flags(p)
    p.add_argument("--world", action="extend", nargs="+", default=[], metavar="W",
                   help="only these worlds (repeatable)")  # fmt: skip
    p.add_argument("--sort", choices=SORT_KEYS, default="rank",
                   help="row order: rank, or the busiest first by cpu, rss or lag")  # fmt: skip
    p.add_argument("--interval-in-sec", type=float, default=1.0, help="refresh period")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


def _local_usage(pid: int | None, host: str, cpu: dict[int, Any]) -> dict[str, float]:
    """CPU % and RSS of ``pid`` read here, when it runs on this machine (``{}`` else)."""
    if pid is None or host != socket.gethostname():
        return {}
    import psutil

    try:
        proc = cpu.get(pid)
        out: dict[str, float] = {}
        if proc is None:
            proc = cpu[pid] = psutil.Process(pid)
            proc.cpu_percent(None)  # the first reading only starts the interval
        else:
            out["cpu_percent"] = proc.cpu_percent(None)
        out["rss_bytes"] = float(proc.memory_info().rss)
        return out
    except psutil.Error:
        cpu.pop(pid, None)
        return {}


def usage_of(entry: Any, cpu: dict[int, Any]) -> dict[str, float]:
    """What a live proc uses: from its heartbeats, else read here (`_local_usage`)."""
    if entry.health != "Alive":
        return {}
    if entry.resources:
        return dict(entry.resources)
    return _local_usage(entry.pid, entry.host, cpu)


def _start_samplers(snap: Any, cpu: dict[int, Any]) -> None:
    """Take the first CPU reading of every live proc of ``snap`` read here."""
    for world in snap.worlds.values():
        for e in world.procs.values():
            usage_of(e, cpu)


def _sort_key(order: str, proc: str, entry: Any, use: dict[str, float]) -> tuple[float, int]:
    """Rows by rank, or the largest first by CPU, RSS or lag (ties: by rank)."""
    rank = int(proc.rsplit("[", 1)[1].rstrip("]")) if "[" in proc else 0
    value = {
        "rank": 0.0,
        "cpu": use.get("cpu_percent", -1.0),
        "rss": use.get("rss_bytes", -1.0),
        "lag": -1.0 if entry.loop_lag_s is None else entry.loop_lag_s,
    }[order]
    return -value, rank


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def frame(
    snap: Any, cpu: dict[int, Any], order: str = "rank", top: int = 0, rows: int | None = None
) -> Any:
    """The rich renderable of one snapshot, rows in ``order`` (`SORT_KEYS`); scrolled:
    the procs from the ``top``-th on (counted over every world, in order), at most
    ``rows`` of them (None: all)."""
    from rich.console import Group
    from rich.table import Table

    tables = []
    index = 0  # procs counted so far, over every world
    total = sum(len(w.procs) for w in snap.worlds.values())
    for name, world in snap.worlds.items():
        alive = sum(1 for e in world.procs.values() if e.health == "Alive")
        uses = {proc: usage_of(e, cpu) for proc, e in world.procs.items()}
        gpu = any("gpu_util_percent" in u for u in uses.values())
        table = Table(
            title=f"world {name}: {world.status}, {alive}/{len(world.procs)} procs alive"
            + ("" if order == "rank" else f", by {order}"),
            title_justify="left",
        )
        cols = ["proc", "health", "host", "pid", "heartbeat", "loop lag", "cpu", "rss"]
        cols += ["gpu", "gpu mem"] if gpu else []
        for col in [*cols, "doing", "failed actors", "reason"]:
            table.add_column(col)
        ordered = sorted(
            world.procs.items(), key=lambda pe: _sort_key(order, pe[0], pe[1], uses[pe[0]])
        )
        first = index
        shown = 0
        for proc, e in ordered:
            index += 1
            if index - 1 < top or (rows is not None and index - 1 >= top + rows):
                continue
            shown += 1
            use = uses[proc]
            age = "-" if e.last_heartbeat_age_s is None else f"{e.last_heartbeat_age_s:.1f} s ago"
            lag = "-" if e.loop_lag_s is None else f"{e.loop_lag_s * 1e3:.1f} ms"
            busy = "-" if "cpu_percent" not in use else f"{use['cpu_percent']:.0f}%"
            row = [
                proc,
                e.health,
                e.host,
                str(e.pid or "-"),
                age,
                lag,
                busy,
                _mib(use.get("rss_bytes")),
            ]
            if gpu:
                util = use.get("gpu_util_percent")
                row += ["-" if util is None else f"{util:.0f}%", _mib(use.get("gpu_mem_bytes"))]
            failed = ", ".join(f.actor_id for f in e.failed_actors) or "-"
            table.add_row(*row, e.activity or "-", failed, e.reason or "")
        if shown < len(ordered):  # scrolled: say which rows these are
            if shown:
                lo = max(top, first) - first + 1
                table.caption = f"procs {lo}-{lo + shown - 1} of {len(ordered)} (of {total})"
            else:
                continue  # a world scrolled out of view entirely
        tables.append(table)
    return Group(*tables) if tables else "no worlds"


def _scrolled(top: int, move: float | None, page: int, total: int) -> int:
    """The first row shown after a scrolling key: ``move`` rows (an int), pages (a
    float) or back to the top (None), never past the last page."""
    if move is None:
        return 0
    step = int(move * page) if isinstance(move, float) else move
    return max(0, min(top + step, total - page))


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
            console.print(frame(await snapshot(), cpu, args.sort))
            return 0
        order = args.sort
        top = 0
        snap = await snapshot()
        with _keys() as key_fd, Live(frame(snap, cpu, order), console=console,
                                     auto_refresh=False) as live:  # fmt: skip
            while True:
                deadline = asyncio.get_running_loop().time() + args.interval_in_sec
                # rows that fit: the terminal less each world's title, header and frame
                page = max(1, console.height - 5 * max(1, len(snap.worlds)) - 1)
                total = sum(len(w.procs) for w in snap.worlds.values())
                while asyncio.get_running_loop().time() < deadline:
                    pressed = key_fd is not None and select.select([key_fd], [], [], 0)[0]
                    key = os.read(key_fd, 1).lower() if pressed and key_fd is not None else b""
                    if key == b"q":
                        return 0
                    if key in _SORT_BY_KEY:
                        order = _SORT_BY_KEY[key]
                        break  # (a new order shows at once)
                    if key in _SCROLL_BY_KEY:
                        top = _scrolled(top, _SCROLL_BY_KEY[key], page, total)
                        break
                    await asyncio.sleep(0.05)
                snap = await snapshot()
                live.update(frame(snap, cpu, order, top, page), refresh=True)
    finally:
        try:
            await client.close()
        except Exception as e:  # noqa: BLE001 - leaving anyway: the system drops the link
            log.debug("closing the system client: %s", e)
