"""``palatine system``: serve the system (registry, supervision) until stopped."""

from __future__ import annotations

import argparse
import asyncio
import sys

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
        "--metrics-addr",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on GET http://HOST:PORT/metrics (port 0: any free "
        "port), to requests with the cluster token as a bearer token",
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
    metrics = None
    if args.metrics_addr is not None:
        from palatine.system.metrics import MetricsServer

        host, _, port = args.metrics_addr.rpartition(":")
        try:
            metrics = MetricsServer(
                host.strip("[]") or "127.0.0.1", int(port), handle.proc, handle.actor.reg
            )
        except (OSError, ValueError) as e:
            await handle.close()
            print(
                f"palatine system: cannot serve metrics at {args.metrics_addr!r}: {e}",
                file=sys.stderr,
            )
            return 2
    ready_line("system", handle.addr, metrics_addr=metrics.addr if metrics else None)
    try:
        done = asyncio.ensure_future(handle.wait())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([done, stopper], return_when=asyncio.FIRST_COMPLETED)
        if stopper.done() and not done.done():
            await handle.stop()
        else:
            stopper.cancel()
            await handle.close()
    finally:
        if metrics is not None:
            await asyncio.to_thread(metrics.close)
    return 0
