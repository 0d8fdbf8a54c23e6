"""Where a job's log files go, and how long they stay.

Every job a program starts on its own machine (`local_mesh`, the procs of `this_host()`)
writes its logs into one directory of its own: the roles' stderr (``system.log``,
``host-0.log``, ``controller.log``) and each worker's output
(``<execution>/<host>/<proc>.log``). Without a ``log_dir`` of the user's, that directory
is a `LogSession` under `default_log_dir`:

* it is made under a hidden name, locked (``flock`` on ``.session.lock``) and only then
  renamed into view, so no other process ever sees it unlocked while it is in use;
* it is removed when its job ends cleanly, and kept when the job failed, so the logs of
  a failure are there to read;
* its lock file records who made it (``<pid> <host>``) until the job ends;
* before making one, this user's sessions that no live job holds are pruned to the newest
  ``keep_logs`` (``PALATINE_KEEP_LOGS``, 10): failed jobs' logs do not pile up either.
  The log dir is shared (the temp dir by default, a shared file system on a cluster), so
  a prune never touches another user's directories, nor one whose lock is held, nor one
  younger than a day whose record names a live process (or a process on another host,
  which cannot be asked: a file system's locks may not reach across hosts).

A directory the user names is theirs: it is used as it is and never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

from palatine import config

__all__ = ["LogSession", "default_log_dir", "owner_alive", "prune_sessions"]

log = logging.getLogger(__name__)

#: The file whose ``flock`` marks a session directory as in use.
LOCK_NAME = ".session.lock"
#: How long a directory whose record names a live process is safe from pruning.
LIVE_RECORD_S = 24 * 3600.0
#: How much later than its record a process may have started and still be its writer
#: (``create_time`` is rounded to the clock tick; a file's mtime is not).
_START_SLACK_S = 1.0


def default_log_dir() -> Path:
    """``PALATINE_LOG_DIR`` (the ``log_dir`` config key), else ``palatine-logs`` in the temp dir."""
    configured = config.get().log_dir
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / "palatine-logs"


def _try_lock(path: Path) -> int | None:
    """An fd holding ``path``'s exclusive lock, or None when another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def owner_alive(pid: int, since: float) -> bool:
    """Whether process ``pid`` is alive and was already running at ``since`` (epoch
    seconds): the process that left something at that time, not a later one that was
    given its pid again."""
    import psutil  # (here: every process imports this module, few ask)

    try:
        proc = psutil.Process(pid)
        started: float = proc.create_time()
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False  # it has ended; only its parent has not reaped it yet
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # there, but not ours to inspect: assume it is the owner
    return started <= since + _START_SLACK_S


def _record_is_live(lock: Path, now: float) -> bool:
    """Whether the session's record (``<pid> <host>`` in its lock file) names a job that
    may still run: a live process here, or any process on another host, within a day."""
    try:
        written = lock.stat().st_mtime
        pid_text, _, host = lock.read_text().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # no record (a session of an older palatine): the lock decides
    if now - written >= LIVE_RECORD_S:
        return False
    if host != socket.gethostname():
        return True  # cannot be asked from here
    return owner_alive(pid, written)


def prune_sessions(base: Path, keep: int) -> list[Path]:
    """Remove this user's session directories under ``base`` that no live job holds, but
    the newest ``keep``.

    Directories without a lock file (a user's own, a CLI cluster's) and other users'
    directories are never touched; nor is one whose lock is held, or one younger than a
    day whose record names a live process (module doc). Returns what was removed.
    """
    idle: list[tuple[float, Path, int]] = []
    me = os.geteuid()
    now = time.time()
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    try:
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            lock = Path(entry.path) / LOCK_NAME
            if st.st_uid != me or not lock.exists():
                continue
            fd = _try_lock(lock)
            if fd is None:
                continue  # a running job's
            if _record_is_live(lock, now):
                os.close(fd)
                continue
            idle.append((st.st_mtime, Path(entry.path), fd))
        idle.sort(reverse=True)
        removed = []
        for _, path, _fd in idle[max(0, keep) :]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed
    finally:
        for _, _, fd in idle:
            os.close(fd)


class LogSession:
    """One job's log directory (see the module docstring); `close` ends it."""

    def __init__(self, path: Path, *, owned: bool, lock_fd: int | None) -> None:
        self.path = path
        #: Whether this session made the directory (and may remove it).
        self.owned = owned
        self._lock_fd = lock_fd

    @classmethod
    def create(cls, kind: str, log_dir: str | os.PathLike[str] | None = None) -> LogSession:
        """The directory for a new job: the user's ``log_dir``, else a fresh locked one."""
        if log_dir is not None:
            path = Path(log_dir)
            path.mkdir(parents=True, exist_ok=True)
            return cls(path, owned=False, lock_fd=None)
        base = default_log_dir()
        base.mkdir(parents=True, exist_ok=True)
        prune_sessions(base, config.get().keep_logs - 1)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{kind}-{stamp}-{os.getpid()}-{secrets.token_hex(3)}"
        hidden = base / f".new-{name}"
        hidden.mkdir()
        fd = os.open(hidden / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        path = base / name
        os.rename(hidden, path)
        return cls(path, owned=True, lock_fd=fd)

    def file(self, name: str) -> str:
        """The path of log file ``name`` in this session."""
        return str(self.path / name)

    def close(self, *, clean: bool) -> None:
        """End the session: remove the directory after a clean job (if ours), else keep it."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        if self.owned and clean:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # the job is over: its record no longer holds the logs
        with contextlib.suppress(OSError):
            os.close(fd)
