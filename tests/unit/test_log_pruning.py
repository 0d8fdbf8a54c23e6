"""Pruning a shared log dir: only this user's kept directories go, and never one that a
live job still holds, by its lock or, within a day, by its record."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from palatine import config
from palatine.output.logs import LIVE_RECORD_S, LOCK_NAME, LogSession, prune_sessions

pytestmark = pytest.mark.timeout(60)

OTHER_UID = 4242  # a user that is not us (the tests run as root to give files away)


def kept_session(base: Path, age_s: float) -> Path:
    """The directory of a failed job's session, ``age_s`` old."""
    with config.override(log_dir=str(base), keep_logs=1000):
        s = LogSession.create("mesh")
    s.close(clean=False)
    when = time.time() - age_s
    os.utime(s.path, (when, when))
    return s.path


def give_away(path: Path, uid: int) -> None:
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid)
    os.chown(path, uid, uid)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A live process that made a session under ``tmp_path`` and then lost its lock, as on
    a file system whose locks do not reach this host: only its record says it runs."""
    code = textwrap.dedent(
        f"""
        import fcntl, sys, time
        from palatine import config
        from palatine.output.logs import LogSession
        with config.override(log_dir={str(tmp_path)!r}):
            s = LogSession.create("mesh")
        fcntl.flock(s._lock_fd, fcntl.LOCK_UN)
        print(s.path, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, Path(proc.stdout.readline().strip())
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_pruning_leaves_another_users_kept_logs_alone(tmp_path: Path) -> None:
    mine = [kept_session(tmp_path, 3600 + i) for i in range(3)]
    theirs = [kept_session(tmp_path, 7200 + i) for i in range(3)]
    for path in theirs:
        give_away(path, OTHER_UID)
    removed = prune_sessions(tmp_path, 1)
    assert sorted(removed) == sorted(mine[1:])  # the newest of ours is kept; theirs all stay
    assert all(p.is_dir() for p in theirs)
    assert mine[0].is_dir()


def test_a_session_whose_job_lives_is_kept_though_its_lock_is_not_held(
    tmp_path: Path, holder: tuple[subprocess.Popen[str], Path]
) -> None:
    proc, path = holder
    assert (path / LOCK_NAME).read_text() == f"{proc.pid} {socket.gethostname()}\n"
    old = kept_session(tmp_path, 3600)
    assert prune_sessions(tmp_path, 0) == [old]
    assert path.is_dir()
    proc.kill()
    proc.wait(10)
    assert prune_sessions(tmp_path, 0) == [path]  # its process is gone: the job is over


def test_a_live_record_older_than_a_day_holds_nothing(
    tmp_path: Path, holder: tuple[subprocess.Popen[str], Path]
) -> None:
    _, path = holder
    stale = time.time() - LIVE_RECORD_S - 60
    os.utime(path / LOCK_NAME, (stale, stale))  # a job does not run a day unnoticed
    assert prune_sessions(tmp_path, 0) == [path]


def test_a_record_naming_a_pid_given_to_a_later_process_holds_nothing(tmp_path: Path) -> None:
    path = kept_session(tmp_path, 60)
    lock = path / LOCK_NAME
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # the pid is alive, but its process started after the record was written
        lock.write_text(f"{later.pid} {socket.gethostname()}\n")
        written = time.time() - 600
        os.utime(lock, (written, written))
        assert prune_sessions(tmp_path, 0) == [path]
    finally:
        later.kill()
        later.wait(10)


def test_a_record_from_another_host_holds_its_directory_for_a_day(tmp_path: Path) -> None:
    young, old = kept_session(tmp_path, 60), kept_session(tmp_path, 120)
    for path, age in ((young, 60.0), (old, LIVE_RECORD_S + 60)):
        lock = path / LOCK_NAME
        lock.write_text(f"1 node-that-is-not-{socket.gethostname()}\n")
        when = time.time() - age
        os.utime(lock, (when, when))
    assert prune_sessions(tmp_path, 0) == [old]
    assert young.is_dir()


def test_a_session_that_ended_leaves_no_record(tmp_path: Path) -> None:
    with config.override(log_dir=str(tmp_path)):
        s = LogSession.create("mesh")
    assert (s.path / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    s.close(clean=False)
    assert (s.path / LOCK_NAME).read_text() == ""
    assert prune_sessions(tmp_path, 0) == [s.path]  # our own process lives on: no matter
