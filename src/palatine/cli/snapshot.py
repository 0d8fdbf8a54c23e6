"""``palatine snapshot``: print worlds and procs of a running system (table or --json),
or with ``--stimuli`` the system's log of recent stimuli (what it heard, what it did)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from palatine.protocol.system import StimulusLog

__all__ = ["add_arguments", "run", "parse_kv"]


def parse_kv(items: list[str] | None) -> dict[str, str]:
    """``KEY=VALUE`` items (split at the first ``=``) into a dict; usage error otherwise."""
    out: dict[str, str] = {}
    for s in items or []:
        if "=" not in s:
            print(f"palatine: invalid KEY=value: no '=' found in '{s}'", file=sys.stderr)
            raise SystemExit(2)
        k, v = s.split("=", 1)
        out[k] = v
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from palatine.cli.target import add_target_flags

    add_target_flags(p)
    for flag, meta, what in (
        ("--world", "W", "only these worlds"),
        ("--world-label", "K=V", "only worlds with these labels"),
        ("--proc-label", "K=V", "only procs with these labels"),
    ):
        p.add_argument(flag, action="extend", nargs="+", default=[], metavar=meta,
                       help=f"{what} (repeatable)")  # fmt: skip
    p.add_argument(
        "--stimuli",
        action="store_true",
        help="print the system's recent stimuli (requests, heartbeats, timers, probe "
        "results...) and what each decided, newest last, instead of worlds and procs",
    )
    p.add_argument(
        "--last",
        type=int,
        default=None,
        metavar="N",
        help="with --stimuli: only the newest N",
    )
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument(
        "--timeout-in-sec",
        type=float,
        default=10.0,
        help="how long to wait for the system's answer",
    )


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import ask_system, setup_logging
    from palatine.cli.target import resolve_target

    setup_logging()
    resolve_target(args, "snapshot")
    wl, pl = parse_kv(args.world_label), parse_kv(args.proc_label)
    t = args.timeout_in_sec
    if not (t > 0 and math.isfinite(t)):
        print(
            f"palatine snapshot: --timeout-in-sec must be a finite number > 0, got {t:g}",
            file=sys.stderr,
        )
        return 2
    if args.last is not None and (not args.stimuli or args.last < 1):
        why = "needs --stimuli" if not args.stimuli else f"must be >= 1, got {args.last}"
        print(f"palatine snapshot: --last {why}", file=sys.stderr)
        return 2
    if args.stimuli and (args.world or wl or pl):
        print(
            "palatine snapshot: --stimuli lists the system's recent stimuli, not worlds: "
            "it takes no --world, --world-label or --proc-label",
            file=sys.stderr,
        )
        return 2
    if args.stimuli:
        return _print_stimuli(args)
    snap = ask_system("snapshot", args.system_addr, lambda: _snapshot(args, wl, pl), t)
    import msgspec

    if args.json:
        sys.stdout.write(msgspec.json.encode(snap).decode() + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"execution {snap.execution_id}")
    for col in ("world", "status", "proc", "health", "host", "pid", "addr", "reason"):
        table.add_column(col)
    for row in snap.rows():
        table.add_row(*row)
    Console().print(table)
    return 0


def _print_stimuli(args: argparse.Namespace) -> int:
    from palatine.cli.role import ask_system

    got = ask_system("snapshot", args.system_addr, lambda: _stimuli(args), args.timeout_in_sec)
    import msgspec

    if args.json:
        sys.stdout.write(msgspec.json.encode(got).decode() + "\n")
        return 0
    sys.stdout.write(
        f"execution {got.execution_id}: {len(got.entries)} recent stimuli, newest last "
        f"(kept: up to {got.size}; handled since the system started: {got.handled})\n"
    )
    for line in got.lines():
        sys.stdout.write(line + "\n")
    return 0


async def _stimuli(args: argparse.Namespace) -> StimulusLog:
    from palatine.channel.token import resolve_token
    from palatine.core import runtime
    from palatine.protocol.system import Stimuli, StimulusLog
    from palatine.system.service import System

    runtime.adopt_current_loop()
    async with asyncio.timeout(args.timeout_in_sec + 1):
        resolve_token(create=False)  # a client never makes one up: see token.py
        client = await System(args.system_addr).attach(timeout_s=args.timeout_in_sec)
        try:
            reply = await client.ask(Stimuli(limit=args.last), timeout_s=args.timeout_in_sec)
        finally:
            await client.close()
    if not isinstance(reply, StimulusLog):
        raise TypeError(f"unexpected reply {type(reply).__name__} to Stimuli")
    return reply


async def _snapshot(args: argparse.Namespace, wl: dict[str, str], pl: dict[str, str]):  # type: ignore[no-untyped-def]
    from palatine.channel.token import resolve_token
    from palatine.core import runtime
    from palatine.system.service import System

    runtime.adopt_current_loop()
    # The outer bound leaves the attach room to fail with its own words first.
    async with asyncio.timeout(args.timeout_in_sec + 1):
        resolve_token(create=False)  # a client never makes one up: see token.py
        client = await System(args.system_addr).attach(timeout_s=args.timeout_in_sec)
        try:
            return await client.snapshot(args.world, wl, pl)
        finally:
            await client.close()
