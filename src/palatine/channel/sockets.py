"""Unix socket files: where they go, what they are called, and removing those of dead owners.

A proc that serves a unix path socket binds ``<pid>-<hex>.sock`` (`socket_file_name`) in
this user's private socket directory (`socket_dir_candidates`; made and checked by
`palatine.channel.addr`), so the name says which process owns the file. An `Rx` that
stops removes its file; a process that dies without stopping its `Rx` (killed, or ended
before its procs stopped) would leave it behind, and a day of jobs leaves hundreds. So
nothing a job makes outlives it:

* a process removes the files named for it when its interpreter exits (registered when
  this module is first imported, so it runs after the palatine loop has stopped);
* whoever sees a process die removes its files, `sweep` with its pid: a host when it
  reaps a child, a launcher when it reaps a role;
* a job's launcher sweeps all files whose owners are gone when it starts and when it
  ends, for processes that died where nobody alive saw them.

A file's owner is gone when its pid names no process, or a process that started after
the file was made (the pid was given again), and no socket in this network namespace
listens on its path (``/proc/net/unix``): a file is never removed from under a live
listener. Only this user's directories are swept.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Collection
from pathlib import Path

from palatine.output.logs import owner_alive

__all__ = ["socket_dir_candidates", "socket_file_name", "sweep"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"(\d+)-[0-9a-f]+\.sock")
#: ``Flags`` of a listening socket in ``/proc/net/unix`` (``__SO_ACCEPTCON``).
_ACCEPTING = 0x10000


def socket_dir_candidates() -> list[Path]:
    """Where this user's unix path sockets go, in order of preference:
    ``$XDG_RUNTIME_DIR/palatine``, then ``palatine-<uid>`` in the temp dir."""
    candidates = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        candidates.append(Path(runtime) / "palatine")
    candidates.append(Path(tempfile.gettempdir()) / f"palatine-{os.getuid()}")
    return candidates


def socket_file_name() -> str:
    """A fresh socket file name for this process: ``<pid>-<hex>.sock``."""
    return f"{os.getpid()}-{secrets.token_hex(6)}.sock"


def _own_dirs() -> list[Path]:
    """The candidate directories that exist, are directories and are this user's."""
    out = []
    for directory in socket_dir_candidates():
        try:
            st = os.lstat(directory)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            out.append(directory)
    return out


def _listening() -> set[str]:
    """The paths unix sockets listen on in this network namespace."""
    paths = set()
    try:
        with open("/proc/net/unix") as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split(None, 7)
                if len(fields) == 8 and int(fields[3], 16) & _ACCEPTING:
                    paths.add(fields[7].rstrip("\n"))
    except (OSError, ValueError):
        pass
    return paths


def sweep(pids: Collection[int] | None = None) -> list[Path]:
    """Remove the socket files whose owners are gone (module doc); only those of ``pids``
    when given (a process the caller saw die). Returns what was removed."""
    stale: list[Path] = []
    for directory in _own_dirs():
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            named = _NAME.fullmatch(entry.name)
            if named is None:
                continue
            pid = int(named[1])
            if pids is not None and pid not in pids:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode) and not owner_alive(pid, st.st_mtime):
                stale.append(Path(entry.path))
    if not stale:
        return []
    listening = _listening()
    removed = []
    for path in stale:
        if str(path) in listening:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            log.debug("could not remove the stale socket file %s: %s", path, e)
            continue
        removed.append(path)
    if removed:
        log.debug("removed %d socket files of processes that are gone", len(removed))
    return removed


def _remove_own() -> None:
    """At exit: remove the socket files named for this process (module doc)."""
    mine = f"{os.getpid()}-"
    for directory in _own_dirs():
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                if entry.name.startswith(mine) and _NAME.fullmatch(entry.name):
                    with contextlib.suppress(OSError):
                        if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                            os.unlink(entry.path)


atexit.register(_remove_own)
