"""Lost peers and palatine's own collectives: end at once, never wait for the dead.

gloo cannot abort a collective: a rank waiting in an all-gather for a peer that died,
or that a partition cut off, waits out the collective timeout (minutes), and everything
queued behind it on that stream waits too, a recovery's new group included. So
palatine's collectives (`palatine.tensor.worker.reduce`) are issued asynchronously and
waited for here (`wait_work`), where a second event ends the wait: the controller's
`PeersLost`, sent to every other rank as soon as the supervision declares a rank lost
(`LostPeers.declare`, on the worker actor's loop). A wait whose group holds a lost rank
raises `CollectivePeerLost` with the supervision's words, and the worker abandons its
groups (`abandon`): the next generation's `BackendNetworkInit` finds none and joins the
new group at once.

An abandoned group may still have an operation in flight on gloo's own threads; its
destructor would join them, that is wait out the same timeout, on whichever thread
drops the last reference. So a group left with an operation in flight is never
destroyed: its reference is kept for the life of the process (a few threads and
sockets per lost generation). A group whose operations all ended is destroyed as usual.

`is_peer_loss` says whether an error is a collective's connection to a peer failing;
the `WorkerError` it marks (``peer_lost``) is held by the controller until the
supervision names the lost peer, so that the same fault surfaces as the same
`DeviceException`, whatever error the collective library raised first.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from palatine.errors import CollectivePeerLost

__all__ = ["LostPeers", "abandon", "is_peer_loss", "run_abortable", "wait_work"]

T = TypeVar("T")

log = logging.getLogger(__name__)

# What a collective library says when a connection to a peer breaks (gloo, NCCL's
# socket transport, the TCPStore), lower-cased.
_LOST_PEER_WORDS = (
    "connection reset by peer",
    "connection closed by peer",
    "connection refused",
    "broken pipe",
    "socket closed",
    "econnreset",
    "epipe",
)


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective losing its connection to a
    peer: a `CollectivePeerLost`, torch's ``DistNetworkError``, or a backend error in the
    words of a broken connection."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CollectivePeerLost):
            return True
        names = {t.__name__ for t in type(e).__mro__}
        if "DistNetworkError" in names:
            return True
        if names & {"DistBackendError", "RuntimeError", "OSError"}:
            text = str(e).lower()
            if any(w in text for w in _LOST_PEER_WORDS):
                return True
        e = e.__cause__ or e.__context__
    return False


class LostPeers:
    """The ranks declared lost in this collective generation, and the waits to end.

    `declare` runs on the worker actor's loop; `wait_work` on stream threads.
    """

    __slots__ = ("_lock", "_lost", "_pids", "_waiters")

    def __init__(self) -> None:
        # guards `_lost`, `_pids` and `_waiters`: the loop declares, stream threads wait
        self._lock = threading.Lock()
        self._lost: dict[int, str] = {}  # rank -> the supervision's words
        self._pids: dict[int, int] = {}  # rank -> the pid of its member in this generation
        self._waiters: set[threading.Event] = set()

    def declare(self, ranks: Iterable[int], reason: str, pids: Iterable[int] = ()) -> None:
        """``ranks`` (with their ``pids``, 0 or missing: unknown) were declared lost: wake
        every collective wait to look. A rank whose member in this generation has
        another pid is not this generation's loss (a late notice): ignored."""
        known = list(pids)
        with self._lock:
            for i, r in enumerate(ranks):
                pid = known[i] if i < len(known) else 0
                member = self._pids.get(r)
                if pid and member and pid != member:
                    continue
                self._lost.setdefault(r, reason)
            waiters = list(self._waiters)
        for ev in waiters:
            ev.set()

    def among(self, members: Iterable[int]) -> dict[int, str]:
        """The lost ranks among ``members``, with their reasons."""
        with self._lock:
            return {r: self._lost[r] for r in members if r in self._lost}

    def new_generation(self, pids: dict[int, int]) -> None:
        """A new group formed, of members with these ``pids`` (by rank): none of the old
        losses is its own."""
        with self._lock:
            self._lost.clear()
            self._pids = dict(pids)

    def _add(self, ev: threading.Event) -> None:
        with self._lock:
            self._waiters.add(ev)

    def _remove(self, ev: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(ev)


def lost_error(rank: int, lost: dict[int, str], what: str) -> CollectivePeerLost:
    """The error of ``what`` on ``rank``, ended because the ``lost`` ranks are gone."""
    names = ", ".join(f"rank {r}" for r in sorted(lost))
    first = lost[min(lost)]
    return CollectivePeerLost(f"{what} on rank {rank} ended: its group lost {names} ({first})")


def wait_work(
    peers: LostPeers, work: Any, members: list[int], rank: int, what: str, timeout_s: float
) -> None:
    """Wait for the asynchronous collective ``work`` of a group of ``members``: its own
    outcome (an error raises), or `CollectivePeerLost` as soon as a member is declared
    lost, whichever comes first; at most ``timeout_s`` (`TimeoutError`). A work that has
    no future (gloo's reduce-scatter and all-to-all) is waited for as a blocking call."""
    done = threading.Event()
    try:
        # (the future, not the work: the work counts as completed a moment after its
        # future, and a wait that looked at the work could miss the only wake-up)
        fut = work.get_future()
    except RuntimeError:  # a work without a future (gloo's reduce-scatter, all-to-all)
        lost = peers.among(members)
        if lost:
            raise lost_error(rank, lost, what) from None
    else:
        fut.add_done_callback(lambda _f: done.set())  # on the library's thread
        _wait(peers, done, fut.done, members, rank, what, timeout_s)
    work.wait()  # its error, if it failed


def run_abortable(
    peers: LostPeers,
    fn: Callable[[], T],
    members: list[int],
    rank: int,
    what: str,
    timeout_s: float,
) -> T:
    """``fn()`` (a blocking rendezvous of ``members``, such as making a group, which no
    library call can interrupt) on a thread of its own, waited for as `wait_work` waits:
    a lost member ends the wait at once with `CollectivePeerLost`, and the thread is left
    to end with the rendezvous's own timeout."""
    done = threading.Event()
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            out.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name=f"palatine-{what}", daemon=True).start()
    _wait(peers, done, lambda: bool(out), members, rank, what, timeout_s)
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _wait(
    peers: LostPeers,
    done: threading.Event,
    finished: Callable[[], bool],
    members: list[int],
    rank: int,
    what: str,
    timeout_s: float,
) -> None:
    """Wait until ``finished()`` (``done`` is set when it may have become true), or raise
    `CollectivePeerLost` once a member is lost."""
    lost = peers.among(members)
    if lost:
        raise lost_error(rank, lost, what)
    peers._add(done)
    deadline = time.monotonic() + timeout_s
    try:
        while not finished():
            left = deadline - time.monotonic()
            if left <= 0 or not done.wait(left):
                raise TimeoutError(f"{what} on rank {rank}: not done within {timeout_s:g} s")
            if finished():
                break
            lost = peers.among(members)
            if lost:
                raise lost_error(rank, lost, what)
            done.clear()  # woken for another group's loss: wait on
    finally:
        peers._remove(done)


def abandon(groups: Iterable[Any], in_flight: bool) -> None:
    """Leave this process's collective groups after a lost peer.

    ``in_flight``: an operation of theirs may still run on the library's threads, so the
    groups are kept alive for good (their destructors would wait it out) and only
    unregistered; otherwise they are destroyed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if in_flight:
        for g in [dist.group.WORLD, *groups]:
            if g is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))  # never destroyed: see above
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - its peers are gone: leaving is all that matters
        log.info("leaving the collective group: %s", e)
