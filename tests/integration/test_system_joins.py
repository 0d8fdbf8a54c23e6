"""Joins the system refuses, sent by a real client over a real socket: the refusal is the
answer, at once, and the system keeps serving (`palatine.system.actor`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from palatine.channel.addr import any_addr
from palatine.errors import SystemRequestError
from palatine.ids import ProcId
from palatine.protocol.system import Join
from palatine.system.service import System

pytestmark = pytest.mark.timeout(60)


async def _refused_joins() -> list[tuple[str, float]]:
    handle = await System.serve(any_addr("unix"))
    client = await System(handle.addr).attach(timeout_s=10)
    out: list[tuple[str, float]] = []
    try:
        # An "any" address cannot be dialed: the refusal goes back on the request's own route.
        for proc, addr in [("unknown[0]", "unix:"), ("W[0]", "unix:"), ("W[0]", "tcp:127.0.0.1:0")]:
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(client.ask(Join(proc_id=ProcId.parse(proc), addr=addr)), 10)
            except SystemRequestError as e:
                out.append((str(e), time.monotonic() - t0))
        snap = await asyncio.wait_for(client.snapshot(), 10)
        out.append((f"worlds {sorted(snap.worlds)}", 0.0))
    finally:
        await client.close()
        await handle.stop()
    return out


def test_a_join_from_an_any_address_is_refused_at_once_and_the_system_keeps_serving() -> None:
    got = asyncio.run(_refused_joins())
    assert len(got) == 4, got
    assert (
        got[0][0] == "invalid_argument: cannot join as unknown[0]: world name 'unknown' is reserved"
    )
    assert got[1][0].startswith("invalid_argument: join of W[0]: address 'unix:' cannot be dialed")
    assert got[2][0].startswith(
        "invalid_argument: join of W[0]: address 'tcp:127.0.0.1:0' cannot be dialed"
    )
    assert all(took < 5 for _, took in got)
    assert got[3][0] == "worlds []"
