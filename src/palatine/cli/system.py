"""``palatine system``: serve the system (registry, supervision) until stopped."""

from __future__ import annotations

import argparse
import asyncio
import sys

from palatine.cli.role import ready_line, run_role
from palatine.config import roles
from palatine.config.roles import SystemOptions

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--system-addr", required=True, help="address to serve (tcp:HOST:PORT, unix:...)"
    )
    roles.add_arguments(p, SystemOptions)  # the options, declared there


def run(args: argparse.Namespace) -> int:
    return run_role(lambda stop: serve_system(args, stop))


async def serve_system(args: argparse.Namespace, stop: asyncio.Event) -> int:
    """The role `palatine serve` runs for ``Run.System``, from the command line: exit 2
    when the metrics cannot be served, 1 when the system cannot."""
    from palatine.cli.serving import SystemCommand, check_cli_args, run_system

    cmd = roles.from_args(SystemCommand, args)
    refused = await run_system(cmd, check_cli_args(cmd), stop, ready_line)
    if refused is None:
        return 0
    print(f"palatine system: {refused.text}", file=sys.stderr)
    return refused.exit_code
