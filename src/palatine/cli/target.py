"""Which job a client command talks to: ``--system-addr``, ``--job``, or the default.

``top``, ``stacks``, ``snapshot`` and ``stop`` take ``--job ID|latest`` (a job of
``palatine ps``: its record gives the system's address and its token file) or
``--system-addr ADDR`` (the token then comes from the environment, as for any client).
With neither, ``PALATINE_SYSTEM_ADDR`` names the system (a program ``palatine launch``
runs has it), else the only live job of this user on this machine is the one; with
several, or none, the command says so and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_target_flags", "resolve_target"]


def add_target_flags(p: argparse.ArgumentParser) -> None:
    """``--system-addr`` and ``--job`` (at most one of them)."""
    from palatine.cli.role import channel_addr_arg

    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--system-addr",
        type=channel_addr_arg,
        default=None,
        metavar="ADDR",
        help="address of the system (tcp:HOST:PORT, unix:PATH, ...); default: "
        "PALATINE_SYSTEM_ADDR, else the only live job (palatine ps)",
    )
    group.add_argument(
        "--job",
        default=None,
        metavar="ID|latest",
        help="a live job of 'palatine ps' (its id, Slurm job id or a unique prefix), or "
        "'latest' for the newest",
    )


def resolve_target(args: argparse.Namespace, command: str) -> None:
    """Set ``args.system_addr`` (a `ChannelAddr`) from ``--job`` or the defaults, and
    point the token at the chosen job's; a usage error (exit 2) naming what is wrong."""
    from palatine.cli.role import channel_addr_arg
    from palatine.job.records import JobSelectionError, live_jobs, select

    if args.system_addr is not None:
        return
    env_addr = os.environ.get("PALATINE_SYSTEM_ADDR", "")
    if args.job is None and env_addr:
        try:
            args.system_addr = channel_addr_arg(env_addr)
        except argparse.ArgumentTypeError as e:
            print(f"palatine {command}: PALATINE_SYSTEM_ADDR: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    try:
        rec = select(live_jobs(), args.job)
        args.system_addr = channel_addr_arg(rec.system_addr)
    except (JobSelectionError, argparse.ArgumentTypeError) as e:
        print(f"palatine {command}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from palatine.channel.token import TOKEN_ENV, reset_token_cache

    # The job's own token, whatever another job left in the environment.
    os.environ.pop(TOKEN_ENV, None)
    os.environ.update(rec.env())
    reset_token_cache()
