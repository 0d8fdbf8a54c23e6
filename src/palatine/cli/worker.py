"""``palatine worker``: a plain proc that joins its world and waits for spawns."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import MutableMapping

from palatine import config
from palatine.cli.role import ready_line, run_role
from palatine.errors import ConfigError
from palatine.hosting.child_env import Handoff
from palatine.hosting.proctitle import name_process  # (before a fork server forks: see there)

__all__ = ["add_arguments", "narrow_visible_devices", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-id", help="world (default: PALATINE_WORLD_ID)")
    p.add_argument("--proc-id", help="proc id W[r] (default: PALATINE_PROC_ID)")
    p.add_argument("--bootstrap-addr", help="system address (default: PALATINE_BOOTSTRAP_ADDR)")


def run(args: argparse.Namespace) -> int:
    from palatine.hosting.child_env import arm_parent_death_signal
    from palatine.hosting.stacks import register_faulthandler

    arm_parent_death_signal()
    register_faulthandler()
    problem = narrow_visible_devices(os.environ)
    if problem:
        print(f"palatine worker: {problem}", file=sys.stderr)
        return 2
    try:  # this process's own variables (a forked worker inherits its server's memory)
        cfg = config.reload()
    except ConfigError as e:
        print(f"palatine worker: {e}", file=sys.stderr)
        return 2
    _preload(cfg.preload or "")
    handed = Handoff.from_env()
    proc_text = args.proc_id or handed.proc_id
    addr = args.bootstrap_addr or handed.bootstrap_addr
    if not proc_text or not addr:
        print(
            "palatine worker: need --proc-id and --bootstrap-addr (or PALATINE_PROC_ID and "
            "PALATINE_BOOTSTRAP_ADDR)",
            file=sys.stderr,
        )
        return 2
    world = args.world_id or handed.world_id
    if world and not proc_text.startswith(world + "["):
        print(
            f"palatine worker: --proc-id {proc_text!r} is not in --world-id {world!r}",
            file=sys.stderr,
        )
        return 2
    name_process(f"palatine worker {proc_text}")
    return run_role(lambda stop: serve_worker(proc_text, addr, stop))


def narrow_visible_devices(environ: MutableMapping[str, str]) -> str | None:
    """With ``PALATINE_DEVICES_PER_HOST=n``, keep only entry ``LOCAL_RANK % n`` of the
    visible GPUs in ``CUDA_VISIBLE_DEVICES`` (all of ``0..n-1`` when it is unset), so each
    worker proc of a host sees one GPU as ``cuda:0``. The
    local rank is ``LOCAL_RANK`` (else ``PALATINE_LOCAL_RANK``, else 0); afterwards
    ``PALATINE_DEVICES_PER_HOST`` is 1, so a worker started from this one keeps its GPU.

    Must run before torch is imported. Returns what is wrong with the settings, or None.
    """
    var = Handoff.variable("devices_per_host")
    text = environ.get(var, "").strip()
    if not text:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        return f"{var} must be a positive integer, not {text!r}"
    name = "LOCAL_RANK" if environ.get("LOCAL_RANK") else Handoff.variable("local_rank")
    local = environ.get(name) or "0"
    try:
        local_rank = int(local)
    except ValueError:
        local_rank = -1
    if local_rank < 0:
        return f"{name} must be a non-negative integer, not {local!r}"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        entries = [str(i) for i in range(n)]
    else:
        entries = [d.strip() for d in visible.split(",") if d.strip()]
    if len(entries) < n:
        return f"{var}={n} but CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)} device(s)"
    environ["CUDA_VISIBLE_DEVICES"] = entries[local_rank % n]
    # What this proc sees now; a worker started from it keeps that one device.
    environ[var] = "1"
    return None


def _preload(modules: str) -> None:
    """Import heavy modules (``PALATINE_PRELOAD=torch``) before joining.

    A long import holds the GIL for seconds; done after the join it would starve the
    heartbeat thread and the system could declare a healthy proc lost.
    """
    import importlib

    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"palatine worker: cannot preload {name}: {e}", file=sys.stderr)


async def serve_worker(proc_text: str, addr: str, stop: asyncio.Event) -> int:
    from palatine import config
    from palatine.channel.addr import ChannelAddr
    from palatine.core.runtime import unless_stopped
    from palatine.errors import ConfigError, JoinError
    from palatine.hosting.agent import bootstrap_proc
    from palatine.ids import ProcId

    try:
        proc_id = ProcId.parse(proc_text)
    except ValueError as e:
        raise ConfigError(f"--proc-id {proc_text!r}: {e}") from None
    try:
        system_addr = ChannelAddr.parse(addr)
    except ValueError as e:
        raise ConfigError(f"--bootstrap-addr {addr!r}: {e}") from None
    host = Handoff.from_env().host_proc_id
    try:
        handle = await unless_stopped(
            bootstrap_proc(
                proc_id,
                system_addr,
                host_proc=ProcId.parse(host) if host else None,
                main_proc=True,
                join_timeout_s=config.get().join_timeout_s,
            ),
            stop,
        )
    except JoinError as e:
        print(f"cannot join system at {addr}: {e}", file=sys.stderr)
        return 1
    if handle is None:
        return 0  # stopped while joining
    ready_line("worker", handle.addr)
    waiter = asyncio.ensure_future(handle.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if waiter.done():
        reason = waiter.result()
        stopper.cancel()
        await handle.shutdown(reason, leave=False)
        return 1 if reason == "system lost" else 0
    waiter.cancel()
    await handle.shutdown("stopped by signal")
    return 0
