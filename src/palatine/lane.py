"""Lanes: a plain thread's blocking calls without the loop thread in between.

``ref.x.call_one(...).get()`` from a plain thread normally hands the request to the
palatine loop thread, which writes it, reads the reply and wakes the caller again: two
thread switches on top of the round trip, the dearest part of a small call on a small
machine. A *lane* is a connection owned by the calling thread itself: the thread writes
the request and reads the reply with blocking socket calls. Its ``Init`` names the lane's
own reply actor (``<client proc>.lane[n]``); the serving proc sends whatever is addressed
to that actor back on the same connection (`palatine.channel.server_conn`), requests that
bounce included (`palatine.proc.Proc.return_envelope`).

A call goes through lanes only when all of these hold; otherwise nothing changes:

* it is ``call_one`` to one actor, or ``call`` to a mesh small enough to be cast directly
  (one request per rank, each on the thread's lane to that rank's proc), from a thread
  that is not a loop thread, with lanes on (config ``lanes``; ``PALATINE_LANES=0`` turns
  them off);
* the router already reaches every destination proc at a ``unix:`` address. Lanes are
  local: their connection ends only when the peer proc stops or dies;
* the thread's last operation through the loop was a call to (a superset of) the same
  procs, and it has completed. Everything the thread sent there earlier has then been
  delivered, so lanes keep per-sender order.

The request leaves when the calling thread waits on the future (``get``/``result``/
``exception``). Any other use — ``await``, ``done``, callbacks, a wait from another
thread or with a shorter timeout, or the thread's next palatine operation — first sends
it the ordinary way, through the loop. A future nobody touches is sent that way within
about `SWEEP_S` (a growing batch within `BATCH_AGE_S`). A lane that cannot be opened
leaves the call to the loop path too.

``call_one`` futures that a thread creates one after another for the same actor, without
waiting in between, form a *batch* (up to `BATCH_MAX`): waiting on any of them writes
all their requests in one go and reads until every one of them has its outcome, so a
thousand calls in flight cost one write and a few reads, not a loop hop each. Any other
use of a member sends the whole batch through the loop, in order, as above.

While the thread waits for a reply it polls its lane for up to ``idle_spin_us`` before
it blocks, and the serving loop keeps polling as long after each lane request
(`palatine.channel.spin`): on a VM that halts idle vCPUs, each wake-up costs more than
the rest of the call.

A lane that breaks after its request left fails the call with the peer's `PeerGoneError`
once the system declares the proc dead (else a `DeliveryError`): whether the call ran is
then unknown, as when any peer dies mid-call.
"""

from __future__ import annotations

import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from palatine import config, runtime
from palatine.channel.addr import ChannelAddr
from palatine.channel.spin import poll_spinning, spin_seconds
from palatine.future import _FINISHED, Future, _state_lock, on_loop_thread
from palatine.ids import ActorId, PortId, ProcId
from palatine.lane_conn import Broken, Failed, LaneConn, NotSent, WriteTimeout, broken_errors, timeout_error
from palatine.wire.envelope import Envelope

if TYPE_CHECKING:
    from palatine.mailbox import Mailbox

__all__ = ["SWEEP_S", "BATCH_MAX", "Call", "LaneFuture", "note_call", "try_call"]

SWEEP_S: Final = 0.005  # an untouched lane future is sent through the loop after this
BATCH_AGE_S: Final = 0.1  # ... and a batch still growing, once it is this old
_POSTING_WAIT_S: Final = 5.0  # the owner's wait while another thread posts its batch
BATCH_MAX: Final = 65536  # call_one futures held unsent in one batch at most
_tls = threading.local()

_UNSENT, _LANE, _POSTED = 0, 1, 2

class _ThreadState:
    """One thread's lanes and what it last sent through the loop (`runtime.post` hook)."""

    __slots__ = ("deferred", "last_procs", "last_fut", "lanes", "__weakref__")

    def __init__(self) -> None:
        self.deferred: _Batch | None = None  # created, not sent yet
        self.last_procs: frozenset[ProcId] = frozenset()  # the last loop-path call's procs
        self.last_fut: Future[Any] | None = None  # ... and its future (None: something else)
        self.lanes: dict[ChannelAddr, LaneConn] = {}

    def on_post(self) -> None:
        """The thread is about to post work to the loop: its unsent calls go first."""
        d = self.deferred
        if d is not None:
            self.deferred = None
            d.demote()
        self.last_fut = None

    def lane_to(self, addr: ChannelAddr, client: ProcId) -> LaneConn:
        """This thread's open lane to ``addr`` (connecting it if needed)."""
        lane = self.lanes.get(addr)
        if lane is None or lane.broken:
            lane = self.lanes[addr] = LaneConn.open(addr, client)
        return lane

    def __del__(self) -> None:
        for lane in self.lanes.values():
            lane.close()


def _state() -> _ThreadState:
    st: _ThreadState | None = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = _ThreadState()
        runtime.set_post_hook(st.on_post)
    return st


def note_call(procs: frozenset[ProcId], fut: Future[Any]) -> None:
    """A plain thread just posted a call to ``procs`` through the loop (order tracking)."""
    st: _ThreadState | None = getattr(_tls, "state", None)
    if st is None:
        st = _state()
    st.last_procs = procs
    st.last_fut = fut


# One destination of a call: (rank or -1, actor, its proc's address).
Leg = tuple[int, ActorId, ChannelAddr]


class Call(Protocol):
    """One call, as a lane future needs it (`palatine.mesh` makes them): one object per
    call rather than closures, as calls in flight are many and each object costs the
    garbage collector."""

    what: str
    timeout_s: float
    transform: Callable[[Any], Any] | None  # of {rank: reply}, for a gather

    def envelope(self, mb: Mailbox, rank: int, reply_to: PortId) -> Envelope:
        """The request (for ``rank``; -1 for ``call_one``) from ``mb``."""

    def go(self) -> Any:
        """Send it the ordinary way (on the loop, as for `runtime.call`)."""


def try_call(mb: Mailbox, dests: tuple[tuple[int, ActorId], ...], call: Call) -> LaneFuture | None:
    """A `LaneFuture` for ``call`` from the client mailbox ``mb`` if it may take lanes
    (module doc), else None.

    ``dests`` are (rank, actor) pairs: one with rank -1 for ``call_one`` (the future's
    value is the reply), else one per rank (the value is ``call.transform({rank:
    reply})``).
    """
    st: _ThreadState | None = getattr(_tls, "state", None)
    if st is None:
        return None
    batch = st.deferred
    if batch is not None:
        if len(dests) == 1 and dests[0] == batch.key:  # the same actor again: checked already
            return batch.join(mb, call)
        return None
    last = st.last_fut
    if last is None or not last._state:
        return None
    procs = st.last_procs
    client_proc = mb.proc
    me = client_proc.proc_id
    for _, dest in dests:
        if dest.proc not in procs or dest.proc == me:
            return None
    if not config.get().lanes or on_loop_thread():
        return None
    lookup = client_proc.router.lookup
    legs: list[Leg] = []
    for rank, dest in dests:
        addr = lookup(dest)
        if addr is None or addr.transport != "unix":
            return None
        legs.append((rank, dest, addr))
    if len(legs) > 1 and len({addr for _, _, addr in legs}) < len(legs):
        return None  # one lane per leg
    batch = _Batch(st, legs, dests[0] if len(legs) == 1 and legs[0][0] < 0 else None)
    fut = LaneFuture(mb, batch, legs, call)
    batch.futs.append(fut)
    st.deferred = batch
    _sweeper.add(st)
    return fut


class _Batch:
    """A thread's unsent lane futures, in the order they were made (module doc).

    ``claim`` says who sends them: nobody yet, the lane (the owner waits), or the loop.
    Only ``call_one`` futures to one actor batch (``key``: its ``(-1, actor)``, checked
    once for the first member); a gather is alone (``key`` None).
    """

    __slots__ = ("st", "legs", "key", "futs", "claim", "born", "touched", "posted")

    def __init__(self, st: _ThreadState, legs: list[Leg], key: tuple[int, ActorId] | None) -> None:
        self.st = st
        self.legs = legs
        self.key = key
        self.futs: list[LaneFuture] = []
        self.claim = _UNSENT
        self.born = self.touched = time.monotonic()
        self.posted: threading.Event | None = None  # set once a demoted batch is posted

    def join(self, mb: Mailbox, call: Call) -> LaneFuture | None:
        """A new member: one more ``call_one`` to this batch's actor; None when full."""
        if len(self.futs) >= BATCH_MAX:
            return None
        fut = LaneFuture(mb, self, self.legs, call)
        with _state_lock:
            if self.claim != _UNSENT:
                return None  # the sweeper took it just now
            self.futs.append(fut)
            self.touched = time.monotonic()
        return fut

    def take(self, how: int) -> bool:
        """Claim the unsent batch for the lane or the loop; False if already taken."""
        with _state_lock:
            if self.claim != _UNSENT:
                return False
            self.claim = how
        st = self.st
        if st.deferred is self:
            st.deferred = None
        return True

    def back_to_loop(self) -> None:
        """The lane could not take the batch it claimed (nothing was sent): the loop does."""
        with _state_lock:
            self.claim = _UNSENT
        self.demote()

    def demote(self) -> None:
        """Send every member the ordinary way (through the loop), in order, as one post,
        if nobody has sent them yet. The owner's own next post waits until they are
        posted, so nothing it sends later can land before them."""
        with _state_lock:
            claim = self.claim
            if claim == _UNSENT:
                self.claim = _POSTED
                self.posted = threading.Event()
                futs, self.futs = self.futs, []  # sent: members and batch no longer hold each other
        if claim != _UNSENT:
            posted = self.posted
            if claim == _POSTED and posted is not None and not on_loop_thread():
                posted.wait(_POSTING_WAIT_S)  # another thread is posting them right now
            return
        st, last = self.st, futs[-1]
        procs = frozenset(dest.proc for _, dest, _ in last._legs)
        calls = [(f, f._call.go, f._call.transform) for f in futs]
        if threading.get_ident() == last._owner:
            if st.deferred is self:
                st.deferred = None
            runtime.call_all_into(calls)  # (this thread's post hook forgets its last call)
            st.last_procs, st.last_fut = procs, last
        else:
            # Before the batch stops being the thread's: a call the owner makes meanwhile
            # must see these as unfinished, so it goes through the loop too, after them.
            st.last_procs, st.last_fut = procs, last
            runtime.call_all_into(calls)
            if st.deferred is self:
                st.deferred = None
        self.posted.set()


class LaneFuture(Future[Any]):
    """A call's future that its thread may complete over lanes (see the module doc)."""

    __slots__ = ("_owner", "_batch", "_legs", "_mb", "_proc", "_call")

    def __init__(self, mb: Mailbox, batch: _Batch, legs: list[Leg], call: Call) -> None:
        proc = mb.proc
        super().__init__(proc.loop)
        self._owner = threading.get_ident()
        self._batch = batch
        self._legs = legs
        self._mb = mb
        self._proc = proc
        self._call = call

    @property
    def _what(self) -> str:
        return self._call.what

    @property
    def _timeout_s(self) -> float:
        return self._call.timeout_s

    def _envelope(self, rank: int, reply_to: PortId) -> Envelope:
        return self._call.envelope(self._mb, rank, reply_to)

    def _demote(self) -> None:
        """Send it (with its whole batch) the ordinary way, if nobody has sent it yet."""
        self._batch.demote()

    # -- consumers -----------------------------------------------------------------------

    def _lane_wait(self, timeout: float | None) -> bool:
        """Complete this future over lanes if the caller may; False if it may not."""
        batch = self._batch
        if batch.claim != _UNSENT or threading.get_ident() != self._owner:
            return False
        if timeout is not None and any(timeout < f._timeout_s for f in batch.futs):
            return False  # a reply could outlive this wait: let the loop own them
        if not batch.take(_LANE):
            return False
        client = self._proc.proc_id
        try:
            lanes = [batch.st.lane_to(addr, client) for _, _, addr in self._legs]
        except BaseException as e:  # no lane (LinkLost, OSError, an interrupt): nothing left,
            batch.back_to_loop()  # so send it the ordinary way
            if not isinstance(e, Exception):
                raise
            return False
        try:
            if len(batch.futs) > 1:
                _run_batch(lanes[0], batch.futs)
                return True
            if self._legs[0][0] < 0:
                value = _call(lanes[0], self)
            else:
                value = _gather(self, lanes)
                transform = self._call.transform
                if transform is not None:
                    value = transform(value)
        except NotSent:
            batch.back_to_loop()
            return False
        except BaseException as e:  # noqa: BLE001 - the call's outcome
            self._finish(None, e)
            return True
        finally:
            batch.futs = []  # done with: members and batch no longer hold each other
        self._finish(value, None)
        return True

    def get(self, timeout: float | None = None) -> Any:
        if not self._state and not self._lane_wait(timeout):
            self._demote()
        return super().get(timeout)

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._state and not self._lane_wait(timeout):
            self._demote()
        return super().exception(timeout)

    def done(self) -> bool:
        if self._batch.claim == _UNSENT:
            self._demote()
        return self._state == _FINISHED

    def add_done_callback(self, fn: Callable[[Future[Any]], Any]) -> None:
        if self._batch.claim == _UNSENT:
            self._demote()
        super().add_done_callback(fn)

    def __await__(self) -> Any:
        if self._batch.claim == _UNSENT:
            self._demote()
        return super().__await__()


def _dest(fut: LaneFuture, leg: int) -> ActorId:
    return fut._legs[leg][1]


def _call(lane: LaneConn, fut: LaneFuture) -> Any:
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


def _run_batch(lane: LaneConn, futs: list[LaneFuture]) -> None:
    """Write every member's request (one buffer, in order) and read until each member
    has its reply, its timeout or the lane's end; then complete them all (so no
    callback runs while the lane is mid-batch). Raises `NotSent` if nothing was sent.
    Any other exception (an interrupt) completes every member still open with it."""
    outcomes: dict[int, tuple[Any, BaseException | None]] = {}  # member index -> outcome
    try:
        _batch_io(lane, futs, outcomes)
    except NotSent:
        raise
    except BaseException as e:
        lane.close()  # a request may be cut short on the wire
        for i in range(len(futs)):
            outcomes.setdefault(i, (None, e))
        _finish_all(futs, outcomes)
        raise
    _finish_all(futs, outcomes)


def _finish_all(futs: list[LaneFuture], outcomes: dict[int, tuple[Any, BaseException | None]]) -> None:
    for i, f in enumerate(futs):
        value, exc = outcomes[i]
        f._finish(value, exc)


def _batch_io(lane: LaneConn, futs: list[LaneFuture], outcomes: dict[int, tuple[Any, BaseException | None]]) -> None:
    """The writes and reads of `_run_batch`. Writes never block: while the peer is not
    reading, replies are read meanwhile, and a write left unfinished when no member
    waits any more closes the lane (nothing may follow a cut frame)."""
    data, ports = lane.encode(len(futs), lambda i, rt: futs[i]._envelope(-1, rt))
    waiting = {p.port: i for i, p in enumerate(ports)}
    now = time.monotonic()
    due = sorted((now + f._timeout_s, p.port, i) for i, (p, f) in enumerate(zip(ports, futs, strict=True)))
    k = 0
    out = memoryview(data)
    sock = lane.sock
    poller: select.poll | None = None
    try:
        while waiting:
            now = time.monotonic()
            while k < len(due) and due[k][0] <= now:
                _, port, i = due[k]
                if waiting.pop(port, None) is not None:
                    f = futs[i]
                    outcomes[i] = (None, timeout_error(f._what, _dest(f, 0), f._timeout_s))
                k += 1
            if not waiting:
                break
            deadline: float | None = due[k][0]
            if out:
                try:
                    out = out[sock.send(out, socket.MSG_DONTWAIT):]
                except BlockingIOError:
                    pass
                if out:  # the peer is not reading: wait to write or read, whichever first
                    if poller is None:
                        poller = select.poll()
                        poller.register(sock.fileno(), select.POLLIN | select.POLLOUT)
                    ms = max(1, int((due[k][0] - time.monotonic()) * 1000))
                    if not any(ev & select.POLLIN for _, ev in poller.poll(ms)):
                        continue
                    deadline = None  # something to read: do not wait
            for index, value in lane.read(deadline):
                i = waiting.pop(index, -1)
                if i < 0:
                    continue  # a late reply to an earlier call that timed out
                outcomes[i] = (None, value.error) if isinstance(value, Failed) else (value, None)
    except (Broken, OSError) as e:  # the lane ended (or a write failed: it is gone)
        lane.close()
        why = e.why if isinstance(e, Broken) else lane.ended or e.strerror or str(e)
        left = list(waiting.values())
        errors = broken_errors(futs[0]._proc, [(futs[i]._what, _dest(futs[i], 0)) for i in left], why)
        for i, err in zip(left, errors, strict=True):
            outcomes[i] = (None, err)
        return
    if out:
        lane.close()  # part of a request may be on the wire: nothing may follow it


def _gather(fut: LaneFuture, lanes: list[LaneConn]) -> dict[int, Any]:
    """Send one request per leg over its lane, then read every reply: {rank: value}.

    Errors follow `palatine.mailbox.Gather`: the lowest failed rank's error is raised,
    with a note naming every failed rank when there are several.
    """
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    waiting: dict[int, tuple[int, LaneConn, PortId, int]] = {}  # fd -> (rank, lane, port, leg)
    deadline = time.monotonic() + fut._timeout_s
    for i, ((rank, dest, _addr), lane) in enumerate(zip(fut._legs, lanes, strict=True)):
        try:
            reply_to = lane.send(lambda rt, r=rank: fut._envelope(r, rt), deadline)
        except NotSent:
            if i == 0:
                raise  # nothing left yet: the loop path sends it all
            errors[rank] = broken_errors(fut._proc, [(fut._what, dest)], "the request could not be written")[0]
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
        for fd, _ev in poll_spinning(poller, max(1, int(left * 1000)), spin_s):
            rank, lane, reply_to, i = waiting[fd]
            try:
                got, value = lane.take(reply_to, None)
            except Broken as b:
                got, value = True, Failed(broken_errors(fut._proc, [(fut._what, _dest(fut, i))], b.why)[0])
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


class _Sweeper:
    """Sends untouched lane futures through the loop after `SWEEP_S` (a loop timer).

    It looks at the threads that ever held a lane future, so holding one costs the
    caller nothing but a flag check; the timer runs only while some thread holds one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: weakref.WeakSet[_ThreadState] = weakref.WeakSet()
        self.armed = False
        self._held = 0  # lane futures held so far (a racy count is fine: it only keeps us armed)
        self._held_at_sweep = 0

    def add(self, st: _ThreadState) -> None:
        self._held += 1
        if st not in self._states:
            with self._lock:
                self._states.add(st)
        if self.armed:
            return
        with self._lock:
            if self.armed:
                return
            self.armed = True
        loop = runtime.get_loop()
        loop.call_soon_threadsafe(loop.call_later, SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            states = list(self._states)
        held = False
        for st in states:
            batch = st.deferred
            if batch is None:
                continue
            if now - batch.touched >= SWEEP_S or now - batch.born >= BATCH_AGE_S:
                batch.demote()
            else:
                held = True
        # Stay armed while lanes are in use (one timer per sweep, no wake-up per call).
        busy = self._held != self._held_at_sweep
        self._held_at_sweep = self._held
        if held or busy:
            runtime.get_loop().call_later(SWEEP_S, self._sweep)
            return
        with self._lock:
            self.armed = False
        # A future held between the scan and the disarm armed nothing: look once more,
        # at every thread (one may have held its first future meanwhile).
        with self._lock:
            states = list(self._states)
        for st in states:
            if st.deferred is not None:
                self.add(st)
                break


_sweeper = _Sweeper()
