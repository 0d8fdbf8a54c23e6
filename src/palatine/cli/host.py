"""``palatine host``: join as ``hostW[r]`` and start the procs of world W."""

from __future__ import annotations

import argparse
import asyncio
import sys

from palatine.cli.role import ready_line, run_role
from palatine.config import roles
from palatine.config.roles import HostOptions

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system-addr", required=True, help="address of the system to join")
    p.add_argument("--host-world", required=True, help="host world, e.g. hostworker")
    p.add_argument(
        "--host-rank", type=int, required=True, help="this host's rank in its host world"
    )
    roles.add_arguments(p, HostOptions)  # the options, declared there


def run(args: argparse.Namespace) -> int:
    from palatine.hosting.proctitle import name_process

    name_process(f"palatine host {args.host_rank}")
    return run_role(lambda stop: serve_host(args, stop))


async def serve_host(args: argparse.Namespace, stop: asyncio.Event) -> int:
    from palatine.cli.serving import HostCommand, check_cli_args
    from palatine.errors import JoinError
    from palatine.hosting.host import HostAgent, join_host

    cmd = roles.from_args(HostCommand, args)
    addr = check_cli_args(cmd)
    try:
        handle = await join_host(
            cmd.host_world,
            cmd.host_rank,
            addr,
            cmd.supervision_update_interval_s,
            stop,
            main_proc=True,
        )
    except JoinError as e:
        print(f"cannot join system at {cmd.system_addr}: {e}", file=sys.stderr)
        return 1
    if handle is None:
        return 0  # stopped while joining
    ready_line("host", handle.addr)
    waiter = asyncio.ensure_future(handle.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    agent = handle.agent
    assert isinstance(agent, HostAgent)
    if waiter.done():
        stopper.cancel()
        reason = waiter.result()
        await agent.kill_children()
        await handle.shutdown(reason, leave=False)
        return 1 if reason == "system lost" else 0
    waiter.cancel()
    await agent.kill_children()
    await handle.shutdown("stopped by signal")
    return 0
