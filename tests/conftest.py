"""Shared test plumbing: coroutine tests run on a fresh palatine-configured loop; every
script a test starts inherits what a terminal would give it; and a test that leaves the
environment or the signal handling changed fails by name, with both put back."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

#: Signals whose handling a test's subprocesses inherit (an ignored one stays ignored
#: across exec); SIGALRM is pytest-timeout's.
_INHERITED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGCHLD,
    signal.SIGPIPE,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def pytest_configure(config: pytest.Config) -> None:
    """Let SIGINT through, as at a terminal, when the run was started with it ignored.

    A shell starts a background job of a script (``make test &``, a CI step) with SIGINT
    ignored, Python keeps it so, and every script a test starts inherits it: a test that
    presses Ctrl-C on its script (`test_client_teardown`) then waits on a script that
    never hears it. Tests stand for a user at a terminal, where Ctrl-C interrupts.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


@pytest.fixture(autouse=True)
def _no_leaked_process_state() -> Iterator[None]:
    """Fail the test that leaves changed what later tests and their subprocesses inherit:
    the environment (set without ``monkeypatch``), a signal's handler, the signal mask.
    What it changed is put back first, so that no later test pays for it."""
    environ = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in _INHERITED_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    leaks = []
    for key in sorted(environ.keys() | os.environ.keys()):
        before, after = environ.get(key), os.environ.get(key)
        if before != after and key != "PYTEST_CURRENT_TEST":
            leaks.append(f"environment variable {key}: {before!r} -> {after!r}")
            if before is None:
                del os.environ[key]
            else:
                os.environ[key] = before
    for sig, handler in handlers.items():
        now = signal.getsignal(sig)
        if now != handler:
            leaks.append(f"the handler of {sig.name}: {handler!r} -> {now!r}")
            if handler is not None:  # (None: set outside Python, cannot be put back)
                signal.signal(sig, handler)
    now_mask = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if now_mask != mask:
        leaks.append(f"the signal mask: {sorted(mask)} -> {sorted(now_mask)}")
    if leaks:
        pytest.fail("the test left behind (now put back):\n  " + "\n  ".join(leaks))


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


@pytest.fixture
def bed() -> Iterator[Any]:
    """A two-node network-namespace test bed (`palatine.testing.netns.TestBed`), made
    and removed by the test; skipped where namespaces cannot be made. Nothing may be left
    of it afterwards."""
    from palatine.testing.netns import TestBed

    b = TestBed(2)
    try:
        b.start()
    except RuntimeError as e:  # a container without the right to make namespaces
        pytest.skip(f"cannot make a namespace test bed here: {e}")
    try:
        yield b
    finally:
        b.close()
    assert b.leftovers() == []


def bed_tls(bed: Any, where: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, str]]:
    """Certificates for the bed's machines (under ``where``), this process given the
    root namespace's: the ``tls`` a bed's roles take."""
    pytest.importorskip("cryptography")
    from palatine.testing.certs import make_node_pki

    pki = make_node_pki(where, [bed.root_ip, bed.node_ip(0), bed.node_ip(1)])
    for k, v in pki[bed.root_ip].items():
        monkeypatch.setenv(k, v)
    return pki
