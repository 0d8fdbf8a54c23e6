"""In-process proc clusters for tests: several `Proc`s on one loop, wired by static routes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from palatine.channel.addr import any_addr
from palatine.core import runtime, sender
from palatine.core.proc import ClientInstance, Proc
from palatine.ids import WorldId

__all__ = ["proc_cluster"]


@contextlib.asynccontextmanager
async def proc_cluster(
    n: int, *, world: str = "w", transport: str = "local"
) -> AsyncIterator[tuple[list[Proc], ClientInstance]]:
    """``n`` procs ``world[0..n)`` plus a client proc, all routes bound statically.

    The running loop is adopted as the palatine loop for the duration, and the client
    instance becomes the default sender of refs and meshes.
    """
    runtime.adopt_current_loop()
    w = WorldId(world)
    procs = [Proc(w.proc(i)) for i in range(n)]
    client_proc = Proc(WorldId("user").proc(2**63 + 1))
    everyone = [*procs, client_proc]
    try:
        for p in everyone:
            await p.serve(any_addr(transport))
        for p in everyone:
            for q in everyone:
                if p is not q:
                    assert q.addr is not None
                    p.router.bind(q.proc_id, q.addr)
        client = client_proc.attach("client")
        sender.set_default_client(client)
        yield procs, client
    finally:
        sender.set_default_client(None)
        for p in everyone:
            await p.stop(1.0)
            await p.close()
        runtime.release_current_loop()
