"""Sweeping unix socket files: a file goes when the process its name names is gone (or
its pid was given to a later process), never while its process lives or something
listens on it, and only in this user's own directory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from palatine.channel import sockets

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh temp dir (short: socket paths are limited) whose ``palatine-<uid>`` is ours."""
    base = Path(tempfile.mkdtemp(prefix="pls", dir="/tmp"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    directory = base / f"palatine-{os.getuid()}"
    directory.mkdir(mode=0o700)
    try:
        yield directory
    finally:
        shutil.rmtree(base, ignore_errors=True)


def left_by_a_dead_process(directory: Path) -> Path:
    """The socket file a process bound under its own name before it was killed."""
    code = textwrap.dedent(
        f"""
        import os, signal, socket
        s = socket.socket(socket.AF_UNIX)
        s.bind(f"{directory}/{{os.getpid()}}-0123456789ab.sock")
        s.listen()
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    path = directory / f"{done.stdout.strip()}-0123456789ab.sock"
    assert path.exists(), done.stderr
    return path


def bound(path: Path, *, listen: bool) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    if listen:
        s.listen()
    return s


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_the_file_of_a_dead_process_goes_and_other_files_stay(socket_dir: Path) -> None:
    stale = left_by_a_dead_process(socket_dir)
    other = socket_dir / "not-a-palatine-name.sock"
    bound(other, listen=False).close()
    assert sockets.sweep() == [stale]
    assert not stale.exists() and other.exists()


def test_only_the_files_of_the_pids_named_go(socket_dir: Path) -> None:
    a, b = left_by_a_dead_process(socket_dir), left_by_a_dead_process(socket_dir)
    pid_a = int(a.name.split("-")[0])
    assert sockets.sweep({pid_a}) == [a]
    assert b.exists()


def test_the_file_of_a_live_process_stays_unless_its_pid_was_given_again(
    socket_dir: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    path = socket_dir / f"{sleeper.pid}-0123456789ab.sock"
    bound(path, listen=False).close()  # made after the sleeper started: its file
    assert sockets.sweep() == []
    before = time.time() - 3600  # made before it started: a dead process's, same pid
    os.utime(path, (before, before))
    assert sockets.sweep() == [path]


def test_a_file_something_listens_on_stays_whatever_its_name_says(socket_dir: Path) -> None:
    stale = left_by_a_dead_process(socket_dir)
    stale.unlink()
    listener = bound(stale, listen=True)  # (a system started again at a dead one's path)
    try:
        assert sockets.sweep() == []
        assert stale.exists()
    finally:
        listener.close()
    assert sockets.sweep() == [stale]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_another_users_directory_is_never_swept(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = socket_dir.parent / "run"
    theirs = runtime / "palatine"
    theirs.mkdir(parents=True)
    stale = left_by_a_dead_process(theirs)
    os.chown(theirs, 4242, 4242)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert sockets.sweep() == []
    assert stale.exists()
