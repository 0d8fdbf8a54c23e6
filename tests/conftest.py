"""Shared test plumbing: coroutine tests run on a fresh palatine-configured loop."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests to completion on a new loop (uvloop when configured)."""
    fn = pyfuncitem.obj
    if not inspect.iscoroutinefunction(fn):
        return None
    from palatine.core.runtime import new_event_loop

    kwargs: dict[str, Any] = {
        name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames
    }
    marker = pyfuncitem.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else 60.0
    loop = new_event_loop()

    async def run() -> None:
        task = asyncio.ensure_future(fn(**kwargs))
        done, _ = await asyncio.wait([task], timeout=max(limit - 2.0, 1.0))
        if task in done:
            return task.result()
        stacks = []
        for t in asyncio.all_tasks():
            if t is not asyncio.current_task():
                frames = t.get_stack(limit=8)
                where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in frames)
                stacks.append(f"  {t.get_name()}: {where}")
        task.cancel()
        await asyncio.wait([task], timeout=2.0)
        raise TimeoutError(f"async test exceeded {limit:g} s; tasks:\n" + "\n".join(stacks))

    try:
        loop.run_until_complete(run())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio.set_event_loop(None)
    return True


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="palatine")


@pytest.fixture
def module_token(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test module's ``TOKEN`` as the cluster token, with the token cache reset."""
    from palatine.channel import token as token_mod

    token: str = request.module.TOKEN
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", token)
    token_mod.reset_token_cache()
    yield token
    token_mod.reset_token_cache()


@pytest.fixture
def unix_send_buffer() -> int:
    """What SO_SNDBUF reads on a unix socket after `tune_socket`: the kernel caps the
    request at ``net.core.wmem_max``, then doubles it for its bookkeeping."""
    from pathlib import Path

    from palatine.channel.net.sockets import UNIX_SEND_BUFFER_BYTES

    cap = Path("/proc/sys/net/core/wmem_max")
    limit = int(cap.read_text()) if cap.exists() else UNIX_SEND_BUFFER_BYTES
    return 2 * min(UNIX_SEND_BUFFER_BYTES, limit)
