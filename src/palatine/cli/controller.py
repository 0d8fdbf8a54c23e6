"""``palatine controller``: bootstrap the worker world and serve one client.

Flags and defaults are those of Monarch's controller command. Input errors exit 2 before anything
starts; a failed bootstrap prints its reason as the last stderr line and exits 1; a normal
stop (``palatine stop --world controller``, SIGTERM, the client's Detach) exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, Any

from palatine.cli.role import ready_line, run_role
from palatine.config import roles
from palatine.config.roles import ControllerOptions

if TYPE_CHECKING:
    from palatine.channel.addr import ChannelAddr

__all__ = ["add_arguments", "parse_label", "run"]


def parse_label(text: str) -> tuple[str, str]:
    """argparse type of ``--extra-proc-labels``: ``KEY=VALUE`` split at the first ``=``."""
    from palatine.tensor.controller.startup import parse_key_val

    try:
        return parse_key_val(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-world", required=True, help="name of the worker world W")
    p.add_argument("--system-addr", required=True, help="address of the system")
    p.add_argument(
        "--controller-actor-id",
        default="controller[0].root",
        help="id of the controller actor (default controller[0].root)",
    )
    p.add_argument("--world-size", type=int, required=True, help="number of worker procs")
    p.add_argument("--num-procs-per-host", type=int, default=8, help="placement unit (default 8)")
    p.add_argument("--worker-name", default="worker", help="worker actor name (default worker)")
    p.add_argument(
        "--program",
        default=None,
        help="command hosts run per worker proc (default: workers join by themselves)",
    )
    roles.add_arguments(p, ControllerOptions)  # the options, declared there
    p.add_argument("--is-cpu-worker", action="store_true", help="workers use the CPU")
    p.add_argument(
        "--adopt-world",
        action="store_true",
        help="the worker world exists (an actor proc mesh): spawn the worker actors in its "
        "procs, and leave it running when the controller stops",
    )
    p.add_argument(
        "--extra-proc-labels",
        type=parse_label,
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY=VALUE",
        help="extra labels of the controller proc",
    )


def command_from_args(args: argparse.Namespace) -> Any:
    """The `ControllerCommand` of parsed flags (not yet validated)."""
    from palatine.tensor.controller.startup import ControllerCommand

    return roles.from_args(ControllerCommand, args)


def run(args: argparse.Namespace) -> int:
    from palatine.errors import ConfigError, TooManyOpenFiles
    from palatine.hosting.limits import check_open_files, controller_open_files
    from palatine.tensor.controller.startup import ControllerTimeouts, validate_command

    cmd = command_from_args(args)
    try:
        addr = validate_command(cmd)  # (the system's address, parsed once)
        ControllerTimeouts.from_env()
    except ConfigError as e:
        print(f"palatine controller: error: {e}", file=sys.stderr)
        return 2
    try:  # every worker connects to the controller: refuse a world it cannot hold open
        check_open_files(
            controller_open_files(cmd.world_size), f"a controller of {cmd.world_size} workers"
        )
    except TooManyOpenFiles as e:
        print(f"palatine controller: error: {e}", file=sys.stderr)
        return 1
    return run_role(lambda stop: serve_controller(cmd, addr, stop))


async def serve_controller(cmd: Any, addr: ChannelAddr, stop: asyncio.Event) -> int:
    from palatine.tensor.controller.bootstrap import BootstrapError, run_controller

    try:
        code, why = await run_controller(
            cmd, addr, stop, lambda served: ready_line("controller", served), main_proc=True
        )
    except BootstrapError as e:
        print(f"palatine controller: {e}", file=sys.stderr)
        return 1
    if code != 0 and why:
        print(f"palatine controller: {why}", file=sys.stderr)
    return code
