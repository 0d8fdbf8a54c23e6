"""Lanes: a plain thread's blocking calls without the loop thread in between.

``ref.x.call_one(...).get()`` from a plain thread normally hands the request to the
palatine loop thread, which writes it, reads the reply and wakes the caller again: two
thread switches on top of the round trip, the dearest part of a small call on a small
machine. A *lane* is a connection owned by the calling thread itself: the thread writes
the request and reads the reply with blocking socket calls. Its ``Init`` names the lane's
own reply actor (``<client proc>.lane[n]``); the serving proc sends whatever is addressed
to that actor back on the same connection (`palatine.channel.net.server_conn`), requests that
bounce included (`palatine.core.proc.Proc.return_envelope`).

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
their requests in a few growing chunks (`palatine.fastpath.lane_calls`) and reads until every one
of them has its outcome, so a thousand calls in flight cost a few writes and reads, not
a loop hop each, and the peer starts on the first requests while the rest are encoded.
Any other use of a member sends the whole batch through the loop, in order, as above.

While the thread waits for a reply it polls its lane for up to ``idle_spin_us`` before
it blocks, and the serving loop keeps polling as long after each lane request
(`palatine.channel.spin`): on a VM that halts idle vCPUs, each wake-up costs more than
the rest of the call.

A lane that breaks after its request left fails the call with the peer's `PeerGoneError`
once the system declares the proc dead (else a `DeliveryError`): whether the call ran is
then unknown, as when any peer dies mid-call.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.core import runtime
from palatine.core.future import _FINISHED, Future, _state_lock, on_loop_thread
from palatine.fastpath import lane_calls
from palatine.fastpath.lane_conn import LaneConn, NotSent
from palatine.ids import ActorId, PortId, ProcId
from palatine.wire.envelope import Envelope

if TYPE_CHECKING:
    from palatine.core.mailbox import Mailbox

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
    """One call, as a lane future needs it (`palatine.mesh.actor_mesh` makes them): one object per
    call rather than closures, as calls in flight are many and each object costs the
    garbage collector."""

    what: str
    timeout_s: float

    @property
    def transform(self) -> Callable[[Any], Any] | None:
        """What makes the reply out of {rank: reply}, for a gather (None: the reply itself)."""

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
                self.posted = posting = threading.Event()
                futs, self.futs = self.futs, []  # sent: members and batch no longer hold each other
        if claim != _UNSENT:
            posted = self.posted
            if claim == _POSTED and posted is not None and not on_loop_thread():
                posted.wait(_POSTING_WAIT_S)  # another thread is posting them right now
            return
        st = self.st
        if threading.get_ident() == futs[-1]._owner:
            if st.deferred is self:
                st.deferred = None
            _post_in_order(st, futs)
        else:
            # Before the batch stops being the thread's: a call the owner makes meanwhile
            # must see these as unfinished, so it goes through the loop too, after them.
            last = futs[-1]
            st.last_procs, st.last_fut = frozenset(dest.proc for _, dest, _ in last._legs), last
            runtime.call_all_into([(f, f._call.go, f._call.transform) for f in futs])
            if st.deferred is self:
                st.deferred = None
        posting.set()


def _post_in_order(st: _ThreadState, futs: list[LaneFuture]) -> None:
    """Send ``futs`` the ordinary way, in order, as one post from their owner thread."""
    runtime.call_all_into([(f, f._call.go, f._call.transform) for f in futs])
    last = futs[-1]  # (the post hook made the thread forget its last call: this is it now)
    st.last_procs, st.last_fut = frozenset(dest.proc for _, dest, _ in last._legs), last


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
            futs = batch.futs
            if len(futs) > 1:
                sent = lane_calls.run_batch(lanes[0], futs)
                if sent < len(futs):
                    _post_in_order(batch.st, futs[sent:])
                return True
            if self._legs[0][0] < 0:
                value = lane_calls.call(lanes[0], self)
            else:
                value = lane_calls.gather(self, lanes)
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
