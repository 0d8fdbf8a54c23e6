"""``palatine system``: serve the system (registry, supervision) until stopped."""

from __future__ import annotations

import argparse
import asyncio

from palatine.cli.role import ready_line, run_role

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--system-addr", required=True, help="address to serve (tcp:HOST:PORT, unix:...)"
    )
    p.add_argument(
        "--supervision-update-timeout-in-sec",
        type=float,
        default=None,
        help="silence after which a proc is Expired (default 20)",
    )
    p.add_argument(
        "--world-eviction-timeout-in-sec",
        type=float,
        default=None,
        help="how long a world may stay unhealthy before eviction (default 10)",
    )


def run(args: argparse.Namespace) -> int:
    return run_role(lambda stop: serve_system(args, stop))


async def serve_system(args: argparse.Namespace, stop: asyncio.Event) -> int:
    from palatine.cli.serving import check_cli_args
    from palatine.system.service import System

    check_cli_args("System", args)

    handle = await System.serve(
        args.system_addr,
        supervision_update_timeout_s=args.supervision_update_timeout_in_sec,
        world_eviction_timeout_s=args.world_eviction_timeout_in_sec,
    )
    ready_line("system", handle.addr)
    done = asyncio.ensure_future(handle.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([done, stopper], return_when=asyncio.FIRST_COMPLETED)
    if stopper.done() and not done.done():
        await handle.stop()
    else:
        stopper.cancel()
        await handle.close()
    return 0
