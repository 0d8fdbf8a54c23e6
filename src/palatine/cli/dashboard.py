"""``palatine dashboard``: a job's live web page, behind a link with a token.

    palatine dashboard [--job ID|latest | --system-addr ADDR] [--addr HOST:PORT]
                       [--log-dir DIR] [--interval-in-sec 0.5]

It joins the job's system, serves the page on ``--addr`` (``127.0.0.1`` and a free
port by default) and prints its link, ``http://127.0.0.1:PORT/?token=...``, on stdout;
requests without that token get 403. It runs until Ctrl-C (or the system goes away:
the page then says the system is silent). The job's log dir, for the proc logs the page
shows, comes from the job's record (``--job``, or the record whose system is
``--system-addr``), or from ``--log-dir``. With ``--ready-line`` the link comes as a
launcher's JSON ready line (its ``addr``): ``local_mesh(dashboard=True)`` starts it so
(`palatine.system.dashboard.role_args`). See docs/dashboard.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

__all__ = ["add_arguments", "run", "parse_addr"]

log = logging.getLogger(__name__)

_ATTACH_S = 10.0


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``; ``:PORT`` is loopback) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"--addr wants HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from palatine.cli.target import add_target_flags

    add_target_flags(p)
    p.add_argument("--addr", type=parse_addr, default=("127.0.0.1", 0), metavar="HOST:PORT",
                   help="where to serve the page (default: 127.0.0.1, a free port)")  # fmt: skip
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="the job's log dir, for proc logs (default: from the job's record)")  # fmt: skip
    p.add_argument("--interval-in-sec", type=float, default=0.5,
                   help="how often the system's snapshot is read")  # fmt: skip
    p.add_argument("--ready-line", action="store_true",
                   help="print a JSON ready line with the link (for a launcher: local_mesh)")  # fmt: skip


def _record_of(addr: str) -> Any:
    """The live job record whose system is ``addr`` (None when none is)."""
    from palatine.job.records import live_jobs

    return next((r for r in live_jobs() if r.system_addr == addr), None)


def run(args: argparse.Namespace) -> int:
    from palatine.cli.role import ask_system, setup_logging
    from palatine.cli.target import resolve_target

    setup_logging()
    resolve_target(args, "dashboard")
    if not args.interval_in_sec > 0:
        print("palatine dashboard: --interval-in-sec must be > 0", file=sys.stderr)
        return 2
    return int(ask_system("dashboard", args.system_addr, lambda: _main(args)))


async def _main(args: argparse.Namespace) -> int:
    from palatine.channel.token import resolve_token
    from palatine.core import runtime
    from palatine.system.dashboard import Dashboard
    from palatine.system.service import System

    runtime.adopt_current_loop()
    rec = _record_of(str(args.system_addr))
    log_dir = args.log_dir or (rec.log_dir if rec is not None else None)
    job = {"id": rec.id if rec is not None else "", "system_addr": str(args.system_addr),
           "log_dir": log_dir or ""}  # fmt: skip
    async with asyncio.timeout(_ATTACH_S + 1):
        resolve_token(create=False)  # a client never makes one up: see token.py
        client = await System(args.system_addr).attach(timeout_s=_ATTACH_S)
    host, port = args.addr
    dash = Dashboard(client, host=host, port=port, log_dir=log_dir, job=job,
                     interval_s=args.interval_in_sec)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await dash.start()
        if args.ready_line:
            from palatine.cli.role import ready_line

            ready_line("dashboard", dash.url)
            sys.stdout.flush()
        else:  # (a launcher's role says nothing more: its stderr reaches the user's console)
            print(dash.url, flush=True)
            print(f"palatine dashboard: serving job {job['id'] or args.system_addr}; Ctrl-C stops",
                  file=sys.stderr, flush=True)  # fmt: skip
        await stop.wait()
        return 0
    finally:
        await dash.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await client.close()
