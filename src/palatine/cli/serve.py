"""``palatine serve READ_FD WRITE_FD``: roles on JSON-lines requests.

The file descriptors are inherited from the launcher. The server prints no ready line
itself; each role it runs prints its own on stdout. ``Exit``, EOF, SIGTERM and SIGINT end
it with status 0; unusable descriptors are a usage error (2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from palatine.cli.role import ready_line, run_role

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("read_fd", type=int, metavar="READ_FD", help="fd to read requests from")
    p.add_argument("write_fd", type=int, metavar="WRITE_FD", help="fd to write responses to")


def run(args: argparse.Namespace) -> int:
    for name, fd in (("READ_FD", args.read_fd), ("WRITE_FD", args.write_fd)):
        try:
            os.fstat(fd)
        except (OSError, OverflowError, ValueError) as e:  # (a number no fd can be)
            print(
                f"palatine serve: error: {name} {fd} is not an open file descriptor: {e}",
                file=sys.stderr,
            )
            return 2
    return run_role(lambda stop: _serve(args, stop))


async def _serve(args: argparse.Namespace, stop: asyncio.Event) -> int:
    from palatine.cli.serving import serve

    return await serve(args.read_fd, args.write_fd, stop, ready_line)
