"""The open-files budget of a job: raise the soft limit, or refuse early and say why.

Every process of a job holds a base of descriptors whatever the job's size (the
interpreter, its event loop and listener, log files, torch's threads), and some more for
each proc it deals with: the controller a session with each worker, rank 0 of the
workers a connection from each rank to its collective store, a host the pipes, pidfd and
log file of each child, the system a connection from each proc it registers. When the
limit (``ulimit -n``) is too low for one of them, ``accept`` or ``pipe`` fails with
``EMFILE`` inside that process, and the job stalls until some start-up timeout, with the
cause in no message. So before starting, a launcher calls `check_open_files` with what
the busiest process of its job needs (`mesh_open_files`, `controller_open_files`,
`this_host_open_files`): it raises the soft limit as far as the hard limit allows (as
Ray and most servers do), and when that is still too low, fails at once naming the limit
and the need. The limit is inherited: every role and worker a launcher starts has it.

The figures are measured: the peak of ``/proc/<pid>/fd`` in each process of local meshes
of 1x4, 2x4 and 1x8 workers (calls, fetches and reductions) and of ``this_host()`` meshes
of 4, 8 and 16 procs, as a base and a slope per proc, plus a small margin. A 1x4 mesh
needs about 62 and runs under ``ulimit -n 64``; a 2x8 mesh needs about 106.
"""

from __future__ import annotations

import resource
from typing import NamedTuple

from palatine.errors import TooManyOpenFiles

__all__ = [
    "check_open_files",
    "controller_open_files",
    "mesh_open_files",
    "raise_open_files_limit",
    "this_host_open_files",
]


class _Use(NamedTuple):
    """What one kind of process holds open: ``base`` plus ``per_proc`` for each proc."""

    base: int
    per_proc: int

    def of(self, procs: int) -> int:
        return self.base + self.per_proc * max(0, procs)


# Measured peaks (base + slope), per kind of process and what its procs are:
_CONTROLLER = _Use(36, 4)  # per worker (51 with 4, 67 with 8)
_WORKER = _Use(44, 3)  # per worker of the world: rank 0's store (55 with 4, 67 with 8)
_HOST = _Use(22, 5)  # per child on its machine (42 with 4, 62 with 8)
_SYSTEM = _Use(18, 3)  # per proc registered: workers, hosts, controller, client (39 with 7)
_CLIENT = _Use(35, 7)  # a local mesh's launcher, per host it started (42 with 1, 49 with 2)
_THIS_HOST = _Use(41, 8)  # a this_host() script: embedded system and host, per proc (73 with 4)
#: Added to every estimate: peaks between two samples, a user's own files.
MARGIN_FDS = 6
#: How far the soft limit is raised at most.
_WANTED = 65536


def mesh_open_files(hosts: int, procs_per_host: int) -> int:
    """What the busiest process of a mesh of ``hosts`` × ``procs_per_host`` workers (its
    system, hosts, controller, workers and launcher) needs open."""
    workers = hosts * procs_per_host
    return MARGIN_FDS + max(
        _CONTROLLER.of(workers),
        _WORKER.of(workers),
        _HOST.of(procs_per_host),
        _SYSTEM.of(workers + hosts + 2),
        _CLIENT.of(hosts),
    )


def controller_open_files(workers: int) -> int:
    """What a controller of ``workers`` workers needs open."""
    return MARGIN_FDS + _CONTROLLER.of(workers)


def this_host_open_files(procs: int) -> int:
    """What a script whose ``this_host()`` meshes hold ``procs`` procs in all needs open."""
    return MARGIN_FDS + _THIS_HOST.of(procs)


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


def check_open_files(needed: int, what: str) -> None:
    """Make sure this process (and the ones it starts) may open ``needed`` files.

    Raises `TooManyOpenFiles` naming the limit and the need, e.g. ``too many open files:
    the limit is 64 (ulimit -n) and a mesh of 16 procs needs about 106``.
    """
    limit = raise_open_files_limit(max(needed, _WANTED))
    if limit < needed:
        raise TooManyOpenFiles(
            f"too many open files: the limit is {limit} (ulimit -n) and {what} needs about "
            f"{needed}; raise it (ulimit -n {needed}) or start fewer procs"
        )
