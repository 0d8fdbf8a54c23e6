"""The blocking I/O of lane calls (`palatine.fastpath.lane`): one ``call_one``, one gather, one batch.

Each runs on the calling thread over its own `LaneConn`s and returns (or raises) the
call's outcome; `palatine.fastpath.lane` decides when a call may take a lane at all.

A batch does not wait until every request is encoded before writing: it writes the first
`FIRST_CHUNK` at once and then chunks twice as large (up to `MAX_CHUNK`), so the peer
works through the first requests while this thread encodes the rest.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import select
import socket
import time
from typing import TYPE_CHECKING, Any, Final

from palatine.channel.spin import poll_ms, poll_spinning, spin_seconds
from palatine.fastpath.direct_tx import drop_sent
from palatine.fastpath.lane_conn import (
    Broken,
    Failed,
    LaneConn,
    NotSent,
    WriteTimeout,
    broken_errors,
    timeout_error,
)
from palatine.ids import ActorId, PortId

if TYPE_CHECKING:
    from palatine.fastpath.lane import LaneFuture
    from palatine.wire.envelope import Envelope

__all__ = ["FIRST_CHUNK", "MAX_CHUNK", "call", "gather", "run_batch"]

FIRST_CHUNK: Final = 16  # requests of a batch encoded before its first write ...
MAX_CHUNK: Final = 256  # ... then twice as many each time, up to this
_IOV_MAX: Final = 512  # buffers per sendmsg
_DRAIN_S: Final = 0.5  # after a failed write: how long to read what the peer sent before its end

Outcomes = dict[int, tuple[Any, BaseException | None]]  # member index -> (value, error)


def _member_envelope(futs: list[Any], base: int, i: int, reply_to: PortId) -> Envelope:
    """The request of batch member ``base + i`` (a ``call_one``: rank -1)."""
    env: Envelope = futs[base + i]._envelope(-1, reply_to)
    return env


def _dest(fut: LaneFuture, leg: int) -> ActorId:
    return fut._legs[leg][1]


def call(lane: LaneConn, fut: LaneFuture) -> Any:
    """Send ``fut``'s one request and read until its reply; the reply's value."""
    deadline = time.monotonic() + fut._timeout_s
    try:
        reply_to = lane.send(lambda rt: fut._envelope(-1, rt), deadline)
    except WriteTimeout:
        raise timeout_error(fut._what, _dest(fut, 0), fut._timeout_s) from None
    while True:
        if deadline - time.monotonic() <= 0:
            raise timeout_error(fut._what, _dest(fut, 0), fut._timeout_s)
        try:
            got, value = lane.take(reply_to, deadline)
        except Broken as b:
            raise broken_errors(fut._proc, [(fut._what, _dest(fut, 0))], b.why)[0] from None
        if got:
            if isinstance(value, Failed):
                raise value.error
            return value


def run_batch(lane: LaneConn, futs: list[LaneFuture]) -> int:
    """Write the members' requests (in order) and read until each has its reply, its
    timeout or the lane's end; then complete them (so no callback runs while the lane is
    mid-batch). Returns how many members went over the lane: a member over the frame
    limit stops the batch there, and the caller sends it and the rest the ordinary way.
    Raises `NotSent` if nothing was sent. Any other exception (an interrupt) completes
    every member still open with it."""
    outcomes: Outcomes = {}
    try:
        sent = _batch_io(lane, futs, outcomes)
    except NotSent:
        raise
    except BaseException as e:
        lane.close()  # a request may be cut short on the wire
        for i in range(len(futs)):
            outcomes.setdefault(i, (None, e))
        _finish_all(futs, outcomes)
        raise
    _finish_all(futs[:sent], outcomes)
    return sent


def _finish_all(futs: list[LaneFuture], outcomes: Outcomes) -> None:
    for i, f in enumerate(futs):
        value, exc = outcomes[i]
        f._finish(value, exc)


def _write_some(sock: socket.socket, out: collections.deque[memoryview]) -> None:
    """Write what the peer takes of ``out`` now, without blocking."""
    try:
        n = sock.sendmsg(list(itertools.islice(out, _IOV_MAX)), [], socket.MSG_DONTWAIT)
    except BlockingIOError:
        return
    drop_sent(out, n)


def _batch_io(lane: LaneConn, futs: list[LaneFuture], outcomes: Outcomes) -> int:
    """The writes and reads of `run_batch`; how many members were sent. Writes never
    block: while the peer is not reading, replies are read meanwhile, and a write left
    unfinished when no member waits any more closes the lane (nothing may follow a cut
    frame)."""
    n = len(futs)
    made = 0  # members encoded (their requests written or queued in ``out``)
    waiting: dict[int, int] = {}  # reply port -> member index
    due: list[tuple[float, int, int]] = []  # heap of (deadline, reply port, member index)
    out: collections.deque[memoryview] = collections.deque()
    sock = lane.sock
    chunk = FIRST_CHUNK
    poller: select.poll | None = None
    try:
        while made < n:  # encode a chunk, write what the peer takes, encode the next
            base, end = made, min(n, made + chunk)
            try:
                # encode calls the function before the loop goes on: `base` is this chunk's
                data, ports = lane.encode(
                    end - base, functools.partial(_member_envelope, futs, base)
                )
            except NotSent:
                if made == 0:
                    raise
                break  # over the frame limit: this member and the rest go the ordinary way
            now = time.monotonic()
            for i, p in enumerate(ports, base):
                waiting[p.port] = i
                heapq.heappush(due, (now + futs[i]._timeout_s, p.port, i))
            out.append(memoryview(data))
            made = end
            chunk = min(2 * chunk, MAX_CHUNK)
            _write_some(sock, out)
        while waiting:
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, port, i = heapq.heappop(due)
                if waiting.pop(port, None) is not None:
                    f = futs[i]
                    outcomes[i] = (None, timeout_error(f._what, _dest(f, 0), f._timeout_s))
            if not waiting:
                break
            deadline: float | None = due[0][0]
            if out:
                _write_some(sock, out)
                if out:  # the peer is not reading: wait to write or read, whichever first
                    if poller is None:
                        poller = select.poll()
                        poller.register(sock.fileno(), select.POLLIN | select.POLLOUT)
                    ms = poll_ms(due[0][0] - time.monotonic())
                    if not any(ev & select.POLLIN for _, ev in poller.poll(ms)):
                        continue
                    deadline = None  # something to read: do not wait
            _take_replies(lane.read(deadline), waiting, outcomes)
    except (Broken, OSError) as e:  # the lane ended (or a write failed: it is gone)
        if not isinstance(e, Broken):
            _read_to_end(lane, waiting, outcomes)
        lane.close()
        why = e.why if isinstance(e, Broken) else lane.ended or e.strerror or str(e)
        left = list(waiting.values())
        errors = broken_errors(
            futs[0]._proc, [(futs[i]._what, _dest(futs[i], 0)) for i in left], why
        )
        for i, err in zip(left, errors, strict=True):
            outcomes[i] = (None, err)
        return made
    if out:
        lane.close()  # part of a request may be on the wire: nothing may follow it
    return made


def _take_replies(
    replies: list[tuple[int, Any]], waiting: dict[int, int], outcomes: Outcomes
) -> None:
    for index, value in replies:
        i = waiting.pop(index, -1)
        if i < 0:
            continue  # a late reply to an earlier call that timed out
        outcomes[i] = (None, value.error) if isinstance(value, Failed) else (value, None)


def _read_to_end(lane: LaneConn, waiting: dict[int, int], outcomes: Outcomes) -> None:
    """After a failed write (the peer closed): the replies it sent before it ended are
    still to be read; take them, so those members keep their outcome."""
    deadline = time.monotonic() + _DRAIN_S
    try:
        while waiting and not lane.broken:
            replies = lane.read(deadline)
            if not replies:
                return
            _take_replies(replies, waiting, outcomes)
    except Broken:
        pass  # (ECONNRESET once what came before the end is read)


def gather(fut: LaneFuture, lanes: list[LaneConn]) -> dict[int, Any]:
    """Send one request per leg over its lane, then read every reply: {rank: value}.

    Errors follow `palatine.core.mailbox.Gather`: the lowest failed rank's error is raised,
    with a note naming every failed rank when there are several.
    """
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    waiting: dict[int, tuple[int, LaneConn, PortId, int]] = {}  # fd -> (rank, lane, port, leg)
    deadline = time.monotonic() + fut._timeout_s
    for i, ((rank, dest, _addr), lane) in enumerate(zip(fut._legs, lanes, strict=True)):
        try:
            reply_to = lane.send(functools.partial(fut._envelope, rank), deadline)
        except NotSent:
            if i == 0:
                raise  # nothing left yet: the loop path sends it all
            errors[rank] = broken_errors(
                fut._proc, [(fut._what, dest)], "the request could not be written"
            )[0]
            continue
        except WriteTimeout:
            errors[rank] = timeout_error(fut._what, _dest(fut, 0), fut._timeout_s)
            continue
        waiting[lane.sock.fileno()] = (rank, lane, reply_to, i)
    spin_s = spin_seconds()
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            for rank, _lane, _port, _i in waiting.values():
                errors[rank] = timeout_error(fut._what, _dest(fut, 0), fut._timeout_s)
            break
        for fd, _ev in poll_spinning(poller, poll_ms(left), spin_s):
            rank, lane, reply_to, i = waiting[fd]
            try:
                got, value = lane.take(reply_to, None)
            except Broken as b:
                got, value = (
                    True,
                    Failed(broken_errors(fut._proc, [(fut._what, _dest(fut, i))], b.why)[0]),
                )
            if got:
                del waiting[fd]
                poller.unregister(fd)
                if isinstance(value, Failed):
                    errors[rank] = value.error
                else:
                    results[rank] = value
    if errors:
        first = errors[min(errors)]
        if len(errors) > 1:
            ranks = ", ".join(str(r) for r in sorted(errors))
            first.add_note(f"{fut._what} failed on ranks {ranks}")
        raise first
    return results
