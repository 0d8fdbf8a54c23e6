"""``palatine stop``: stop some worlds, or everything, of a running system."""

from __future__ import annotations

import argparse
import asyncio
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from palatine.cli.target import add_target_flags

    add_target_flags(p)
    p.add_argument(
        "--world",
        action="extend",
        nargs="+",
        default=[],
        metavar="W",
        help="only these worlds (repeatable)",
    )
    p.add_argument("--timeout-in-sec", type=float, default=5.0, help="per-proc stop timeout")


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import setup_logging
    from palatine.cli.target import resolve_target
    from palatine.core.runtime import new_event_loop

    setup_logging()
    resolve_target(args, "stop")
    loop = new_event_loop()
    try:
        ack = loop.run_until_complete(_stop(args))
    except Exception as e:  # noqa: BLE001 - any failure is the command's error message
        print(f"palatine stop: {e}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    print(
        f"stopping: {[str(w) for w in ack.stopping]}; already stopping: "
        f"{[str(w) for w in ack.already_stopping]}; unknown: {[str(w) for w in ack.unknown]}"
    )
    return 0


async def _stop(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from palatine.channel.token import resolve_token
    from palatine.core import runtime
    from palatine.system.service import System

    runtime.adopt_current_loop()
    async with asyncio.timeout(args.timeout_in_sec + 10):
        resolve_token(create=False)  # a client never makes one up: see token.py
        client = await System(args.system_addr).attach(timeout_s=10)
        try:
            return await client.stop(args.world or None, args.timeout_in_sec)
        finally:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - the system may be gone already
                pass
