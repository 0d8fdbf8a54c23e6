"""``palatine stacks``: the Python stacks of a running job's procs, grouped.

    palatine stacks --system-addr ADDR [--world W ...] [--rank R ...] [--native] [--json]

Each proc of the chosen worlds (default: every world but the hosts') is asked for the
stacks of all its threads. A proc a host started is dumped by its host from outside
(faulthandler through the proc's stack file, py-spy when that fails), so a
proc whose loop is stuck still answers; any other proc dumps itself. Procs whose stacks
are the same (addresses and timings aside) are printed once, under the ranks they share
(``ranks 0-2,5 of worker``). ``--native`` adds native frames (needs py-spy: the
``palatine[debug]`` extra); without py-spy a note says so. Exit 0 when every chosen proc
answered, 1 otherwise (each error is printed under the proc it concerns).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections import defaultdict
from typing import Any

__all__ = ["add_arguments", "run", "group_stacks", "rank_ranges"]

_ANSWER_S = 15.0  # one dump (py-spy may take several seconds on a busy proc)
# What differs between procs with the same stack: addresses, thread ids and states, and
# py-spy's header line (``Process 4193: palatine worker worker[0]``).
_VOLATILE = re.compile(
    r"0x[0-9a-f]+|Thread \d+\b|\((?:idle|active)[^)]*\)|^Process \d+: .*$", re.MULTILINE
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from palatine.cli.target import add_target_flags

    add_target_flags(p)
    p.add_argument("--world", action="extend", nargs="+", default=[], metavar="W",
                   help="only these worlds (repeatable)")  # fmt: skip
    p.add_argument("--rank", action="extend", nargs="+", type=int, default=[], metavar="R",
                   help="only these ranks (repeatable)")  # fmt: skip
    p.add_argument("--native", action="store_true", help="native frames too (py-spy)")
    p.add_argument("--json", action="store_true", help="one JSON document, stacks per proc")
    p.add_argument("--timeout-in-sec", type=float, default=_ANSWER_S, help="per proc")


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def group_stacks(stacks: dict[str, str]) -> list[tuple[list[str], str]]:
    """Procs (``W[r]``) with the same stack text, addresses and timings aside; groups in
    the order of their first proc."""
    groups: dict[str, list[str]] = defaultdict(list)
    text_of: dict[str, str] = {}
    for proc, text in stacks.items():
        key = _VOLATILE.sub("", text)
        groups[key].append(proc)
        text_of.setdefault(key, text)
    return [(procs, text_of[key]) for key, procs in groups.items()]


def _label(procs: list[str]) -> str:
    by_world: dict[str, list[int]] = defaultdict(list)
    for p in procs:
        world, _, rank = p.rpartition("[")
        by_world[world].append(int(rank.rstrip("]")))
    parts = []
    for world, ranks in by_world.items():
        word = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{word} {rank_ranges(ranks)} of {world}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import ask_system, setup_logging
    from palatine.cli.target import resolve_target

    setup_logging()
    resolve_target(args, "stacks")
    results = ask_system("stacks", args.system_addr, lambda: _collect(args))
    if not results:
        print("palatine stacks: no running proc matches", file=sys.stderr)
        return 1
    if args.json:
        import msgspec

        sys.stdout.write(msgspec.json.encode({p: t for p, t in results.items()}).decode() + "\n")
        return 0 if all(t.error is None for t in results.values()) else 1
    ok = {p: t.text for p, t in results.items() if t.error is None}
    methods = {t.method for t in results.values() if t.error is None}
    if args.native and "py-spy" not in methods:
        print("note: py-spy is not installed here: Python frames only "
              "(pip install 'palatine[debug]' for native frames)")  # fmt: skip
    for procs, text in group_stacks(ok):
        print(f"=== {_label(procs)} ({len(procs)} proc{'s' if len(procs) > 1 else ''})")
        print(text.rstrip())
        print()
    failed = {p: t.error for p, t in results.items() if t.error is not None}
    for proc, error in failed.items():
        print(f"=== {proc}: no stacks: {error}")
    return 0 if not failed else 1


async def _collect(args: argparse.Namespace) -> dict[str, Any]:
    from palatine.channel.token import resolve_token
    from palatine.core import runtime
    from palatine.ids import ActorId, ProcId, is_host_world
    from palatine.protocol.agent import StackDump, StackTrace
    from palatine.system.service import System

    runtime.adopt_current_loop()
    timeout = args.timeout_in_sec
    async with asyncio.timeout(timeout + 15):
        resolve_token(create=False)  # a client never makes one up: see token.py
        client = await System(args.system_addr).attach(timeout_s=10)
        try:
            snap = await client.snapshot(args.world or None)
            chosen: list[tuple[str, Any]] = []
            for name, world in snap.worlds.items():
                if not args.world and is_host_world(name):
                    continue
                for proc, entry in world.procs.items():
                    rank = int(proc.rsplit("[", 1)[1].rstrip("]"))
                    if args.rank and rank not in args.rank:
                        continue
                    if entry.health == "Alive":
                        chosen.append((proc, entry))

            async def one(proc: str, entry: Any) -> StackTrace:
                pid = ProcId.parse(proc)
                # its host dumps it from outside (works while its loop is stuck)
                asked = ProcId.parse(entry.host_proc) if entry.host_proc else pid
                msg = StackDump(target=pid, native=args.native, timeout_s=timeout)
                try:
                    reply = await client.mailbox.ask(ActorId(asked, "proc", 0), msg, timeout + 2)
                except Exception as e:  # noqa: BLE001 - one proc's error is its line
                    return StackTrace(proc_id=pid, error=str(e))
                assert isinstance(reply, StackTrace)
                return reply

            replies = await asyncio.gather(*(one(p, e) for p, e in chosen))
            return {p: r for (p, _), r in zip(chosen, replies, strict=True)}
        finally:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - the stacks are printed either way; a system gone meanwhile has nothing to close
                pass
