"""Job log directories: fresh and locked while in use, removed after a clean end, pruned."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from palatine import config
from palatine.output.logs import LOCK_NAME, LogSession, default_log_dir, prune_sessions

pytestmark = pytest.mark.timeout(30)


def test_sessions_live_under_the_configured_log_dir_and_go_after_a_clean_end(
    tmp_path: Path,
) -> None:
    with config.override(log_dir=str(tmp_path)):
        assert default_log_dir() == tmp_path
        s = LogSession.create("mesh")
    assert s.owned and s.path.parent == tmp_path and s.path.name.startswith("mesh-")
    assert (s.path / LOCK_NAME).exists()
    Path(s.file("system.log")).write_text("x\n")
    s.close(clean=True)
    assert not s.path.exists()


def test_a_failed_jobs_logs_are_kept(tmp_path: Path) -> None:
    with config.override(log_dir=str(tmp_path)):
        s = LogSession.create("mesh")
    Path(s.file("host-0.log")).write_text("it broke\n")
    s.close(clean=False)
    assert (s.path / "host-0.log").read_text() == "it broke\n"


def test_a_users_log_dir_is_used_as_it_is_and_never_removed(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    s = LogSession.create("mesh", mine)
    assert s.path == mine and not s.owned
    s.close(clean=True)
    assert mine.is_dir()


def test_only_the_newest_idle_sessions_are_kept_and_running_ones_never_touched(
    tmp_path: Path,
) -> None:
    with config.override(log_dir=str(tmp_path), keep_logs=100):
        ended = []
        for _ in range(6):
            s = LogSession.create("mesh")
            s.close(clean=False)  # failed: kept until pruned
            ended.append(s.path)
    for i, path in enumerate(ended):  # make the age order unambiguous
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    with config.override(log_dir=str(tmp_path), keep_logs=3):
        running = LogSession.create("mesh")  # prunes to keep_logs - 1, then adds itself
        os.utime(running.path, (1, 1))  # oldest of all, but held
        foreign = tmp_path / "a-cli-cluster"  # no lock file: not a session
        foreign.mkdir()
        os.utime(foreign, (1, 1))
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {ended[4].name, ended[5].name, running.path.name, foreign.name}
        # Pruning again, from another "process" (another lock holder): the running one stays.
        removed = prune_sessions(tmp_path, 0)
        assert sorted(removed) == sorted([ended[4], ended[5]])
        assert running.path.exists() and foreign.exists()
        running.close(clean=True)
        assert not running.path.exists()


def test_a_session_in_use_cannot_be_locked_by_another_holder(tmp_path: Path) -> None:
    with config.override(log_dir=str(tmp_path)):
        s = LogSession.create("procs")
    fd = os.open(s.path / LOCK_NAME, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        s.close(clean=True)
