"""Stack dumps: in-process dumps, faulthandler files, py-spy selection.

These run inside the test process: the faulthandler path signals the test process itself
(after registering a handler), and py-spy is replaced by small fake scripts, so no real
py-spy or ptrace permission is needed. Child-process dumps are in
``tests/integration/test_children.py``.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from palatine.hosting import stacks as debug
from palatine.hosting.stacks import (
    StackDumpError,
    dump_external,
    dump_threads,
    find_pyspy,
    register_faulthandler,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sigusr1() -> Iterator[None]:
    """Restore SIGUSR1 handling after a test registers faulthandler for it."""
    monkey = pytest.MonkeyPatch()
    monkey.delenv("PALATINE_STACK_FILE", raising=False)
    try:
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        if debug._registered_file is not None:
            debug._registered_file.close()
            debug._registered_file = None
        monkey.undo()


def wait_for_text(path: Path, needle: str, timeout_s: float = 5.0) -> str:
    """The file's text once it contains ``needle`` (polled against a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"{needle!r} never appeared in {path}: {text!r}")
        time.sleep(0.01)


def fake_pyspy(tmp_path: Path, body: str) -> Path:
    """An executable stand-in for py-spy running ``body`` (sh)."""
    exe = tmp_path / "fake-py-spy"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return exe


# --------------------------------------------------------------------------- dump_threads


def wait_in_helper_thread(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(20)


def test_dump_threads_names_every_thread_innermost_last() -> None:
    started, release = threading.Event(), threading.Event()
    helper = threading.Thread(
        target=wait_in_helper_thread, args=(started, release), name="helper-under-test"
    )
    helper.start()
    try:
        assert started.wait(5)
        text = dump_threads()
    finally:
        release.set()
        helper.join(5)
    blocks = text.split("\n\n")
    assert blocks[0].startswith("Thread ") and '"MainThread"' in blocks[0]
    mine = [b for b in blocks if '"helper-under-test"' in b]
    assert len(mine) == 1
    block = mine[0]
    assert "(most recent call last):" in block.splitlines()[0]
    # Outermost (threading's bootstrap) first, the blocked function after, the wait last.
    assert block.index("in _bootstrap") < block.index("in wait_in_helper_thread")
    assert block.index("in wait_in_helper_thread") < block.rindex("in wait")
    # The calling thread's stack ends in the dump itself.
    assert blocks[0].rstrip().splitlines()[-2].endswith("in dump_threads")


# --------------------------------------------------------------------------- faulthandler


def test_sigusr1_writes_stacks_to_the_stack_file(tmp_path: Path, sigusr1: None) -> None:
    stack = tmp_path / "deep" / "w_0.stack"
    stack.parent.mkdir()
    stack.write_text("earlier dump\n")
    assert register_faulthandler(stack) == stack
    os.kill(os.getpid(), signal.SIGUSR1)
    text = wait_for_text(stack, "test_sigusr1_writes_stacks_to_the_stack_file")
    # Appended, never truncated: readers take what follows a known offset.
    assert text.startswith("earlier dump\n")


def test_stack_file_comes_from_the_environment(
    tmp_path: Path, sigusr1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = tmp_path / "from-env.stack"
    monkeypatch.setenv("PALATINE_STACK_FILE", str(stack))
    assert register_faulthandler() == stack
    os.kill(os.getpid(), signal.SIGUSR1)
    wait_for_text(stack, "test_stack_file_comes_from_the_environment")


def test_unopenable_stack_file_falls_back_to_stderr(tmp_path: Path, sigusr1: None) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert register_faulthandler(blocker / "cannot" / "be.stack") is None
    assert register_faulthandler() is None  # no variable either: stderr


# --------------------------------------------------------------------------- dump_external


def set_pyspy(monkeypatch: pytest.MonkeyPatch, path: str | None) -> None:
    """``PALATINE_PYSPY`` as a role would have read it, for this test only."""
    import msgspec

    from palatine import config

    monkeypatch.setattr(config, "_current", msgspec.structs.replace(config.get(), pyspy=path))


async def test_external_dump_by_faulthandler(tmp_path: Path, sigusr1: None) -> None:
    stack = tmp_path / "self.stack"
    register_faulthandler(stack)
    method, text = await dump_external(os.getpid(), stack, timeout_s=5, use_pyspy=False)
    assert method == "faulthandler"
    assert "(most recent call first):" in text
    assert "File " in text


async def test_fake_pyspy_is_used_with_its_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = fake_pyspy(tmp_path, 'echo "dumped: $*"')
    set_pyspy(monkeypatch, str(exe))
    assert find_pyspy() == str(exe)
    method, text = await dump_external(4242, None, native=True, timeout_s=5)
    assert method == "py-spy"
    assert text.strip() == "dumped: dump --pid 4242 --native"
    method, text = await dump_external(4242, None, timeout_s=5)
    assert text.strip() == "dumped: dump --pid 4242"


async def test_failing_pyspy_falls_back_to_faulthandler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigusr1: None
) -> None:
    exe = fake_pyspy(tmp_path, 'echo "Error: Permission denied (os error 1)" >&2; exit 1')
    set_pyspy(monkeypatch, str(exe))
    stack = tmp_path / "self.stack"
    register_faulthandler(stack)
    method, text = await dump_external(os.getpid(), stack, native=True, timeout_s=5)
    assert method == "faulthandler"
    assert "(most recent call first):" in text


async def test_python_stacks_come_in_pythons_format_even_with_pyspy_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigusr1: None
) -> None:
    # One format for `palatine stacks` whether or not py-spy is there (grouping, tests
    # and people read Python's); py-spy is for native frames.
    set_pyspy(monkeypatch, str(fake_pyspy(tmp_path, 'echo "dumped: $*"')))
    stack = tmp_path / "self.stack"
    register_faulthandler(stack)
    method, text = await dump_external(os.getpid(), stack, timeout_s=5)
    assert method == "faulthandler" and "(most recent call first):" in text
    method, text = await dump_external(os.getpid(), stack, native=True, timeout_s=5)
    assert (method, text.strip()) == ("py-spy", f"dumped: dump --pid {os.getpid()} --native")


async def test_failing_pyspy_without_stack_file_reports_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = fake_pyspy(tmp_path, 'echo "Error: Permission denied" >&2; exit 1')
    set_pyspy(monkeypatch, str(exe))
    with pytest.raises(StackDumpError) as info:
        await dump_external(os.getpid(), None, timeout_s=5)
    message = str(info.value)
    assert "py-spy exited with code 1: Error: Permission denied" in message
    assert "no stack file" in message


async def test_hanging_pyspy_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = fake_pyspy(tmp_path, "exec sleep 30")
    set_pyspy(monkeypatch, str(exe))
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(StackDumpError, match="did not finish within"):
        await dump_external(os.getpid(), None, timeout_s=0.5)
    assert loop.time() - started < 3.0


def test_find_pyspy_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_pyspy(monkeypatch, str(tmp_path / "missing"))
    assert find_pyspy() is None
    set_pyspy(monkeypatch, None)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "py-spy"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    assert find_pyspy() == str(exe)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_pyspy() is None


async def test_external_dump_needs_a_handler(tmp_path: Path) -> None:
    # This process does not catch SIGUSR1 here, so it must not be signalled.
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)
    with pytest.raises(StackDumpError, match="does not handle SIGUSR1"):
        await dump_external(os.getpid(), tmp_path / "none.stack", timeout_s=1, use_pyspy=False)
