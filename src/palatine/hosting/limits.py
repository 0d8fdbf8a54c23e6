"""The open-files budget of a job: raise the soft limit, or refuse early and say why.

The processes that every proc of a job connects to (the system, a controller, a client
that holds the embedded system) hold about three descriptors per proc: a connection in
each direction and its bookkeeping. When the limit (``ulimit -n``) is too low, ``accept``
fails with ``EMFILE`` inside that process's event loop, and the job stalls until some
start-up timeout, with the cause in no message. So before starting, a launcher calls
`check_open_files`: it raises the soft limit as far as the hard limit allows (as Ray and
most servers do), and when that is still too low, fails at once naming the limit and
what the job needs.
"""

from __future__ import annotations

import resource

from palatine.errors import TooManyOpenFiles

__all__ = ["check_open_files", "open_files_needed", "raise_open_files_limit"]

#: Descriptors a role holds whatever the job's size (interpreter, loop, listeners, logs).
BASE_FDS = 64
#: Descriptors per proc in a role every proc connects to (measured: three, plus margin).
FDS_PER_PROC = 4
#: How far the soft limit is raised at most.
_WANTED = 65536


def open_files_needed(procs: int) -> int:
    """About how many descriptors a process that every one of ``procs`` procs reaches needs."""
    return BASE_FDS + FDS_PER_PROC * max(0, procs)


def raise_open_files_limit(wanted: int = _WANTED) -> int:
    """Raise the soft open-files limit towards ``wanted`` (within the hard limit); the new soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else _WANTED * 16


def check_open_files(procs: int, what: str) -> None:
    """Make sure this process (and the ones it starts) may open enough files for ``procs``.

    Raises `TooManyOpenFiles` naming the limit and the need, e.g. ``too many open files:
    the limit is 64 (ulimit -n) and a mesh of 16 procs needs about 136``.
    """
    needed = open_files_needed(procs)
    limit = raise_open_files_limit(max(needed, _WANTED))
    if limit < needed:
        raise TooManyOpenFiles(
            f"too many open files: the limit is {limit} (ulimit -n) and {what} needs about "
            f"{needed}; raise it (ulimit -n {needed}) or start fewer procs"
        )
