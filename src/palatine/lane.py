"""Lanes: a plain thread's blocking calls without the loop thread in between.

``ref.x.call_one(...).get()`` from a plain thread normally hands the request to the
palatine loop thread, which writes it, reads the reply and wakes the caller again: two
thread switches on top of the round trip, the dearest part of a small call on a small
machine. A *lane* is a connection owned by the calling thread itself: the thread writes
the request and reads the reply with blocking socket calls. Its ``Init`` names the lane's
own reply actor (``<client proc>.lane[n]``); the serving proc sends whatever is addressed
to that actor back on the same connection (`palatine.channel.net_rx`).

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
about `SWEEP_S`. A lane that cannot be opened leaves the call to the loop path too.

While the thread waits for a reply it polls its lane for up to ``idle_spin_us`` before
it blocks, and the serving loop keeps polling as long after each lane request
(`palatine.channel.spin`): on a VM that halts idle vCPUs, each wake-up costs more than
the rest of the call.

A lane that breaks after its request left fails the call with the peer's `PeerGoneError`
once the system declares the proc dead (else a `DeliveryError`): whether the call ran is
then unknown, as when any peer dies mid-call.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

from palatine import config, runtime
from palatine.channel.addr import ChannelAddr
from palatine.channel.blocking import BlockingConn, Waiter
from palatine.channel.spin import poll_spinning, recv_spinning, spin_seconds
from palatine.channel.token import resolve_token
from palatine.errors import CallTimeout, DeliveryError
from palatine.future import _FINISHED, Future, _state_lock, on_loop_thread
from palatine.ids import ActorId, PortId, ProcId
from palatine.proc import Proc, peer_gone_error
from palatine.wire.codec import decode_payload
from palatine.wire.envelope import Envelope
from palatine.wire.frames import Ack, FrameError, FrameParser, Message, Reject, encode_message

__all__ = ["SWEEP_S", "LaneFuture", "note_call", "try_call"]

SWEEP_S: Final = 0.005  # an untouched lane future is sent through the loop after this
GONE_WAIT_S: Final = 2.0  # after a broken lane: how long to wait for the peer's verdict
_RECV_BYTES: Final = 262144
_timeval = struct.Struct("ll")
_lane_ids = itertools.count(1)
_tls = threading.local()

_UNSENT, _LANE, _POSTED = 0, 1, 2


class _ThreadState:
    """One thread's lanes and what it last sent through the loop (`runtime.post` hook)."""

    __slots__ = ("deferred", "last_procs", "last_fut", "lanes", "__weakref__")

    def __init__(self) -> None:
        self.deferred: LaneFuture | None = None  # created, not sent yet
        self.last_procs: frozenset[ProcId] = frozenset()  # the last loop-path call's procs
        self.last_fut: Future[Any] | None = None  # ... and its future (None: something else)
        self.lanes: dict[ChannelAddr, _Lane] = {}

    def on_post(self) -> None:
        """The thread is about to post work to the loop: its unsent call goes first."""
        d = self.deferred
        if d is not None:
            self.deferred = None
            d._demote()
        self.last_fut = None

    def lane_to(self, addr: ChannelAddr, client: ProcId) -> _Lane:
        """This thread's open lane to ``addr`` (connecting it if needed)."""
        lane = self.lanes.get(addr)
        if lane is None or lane.broken:
            lane = self.lanes[addr] = _Lane.open(addr, client)
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


def try_call(
    client_proc: Proc,
    dests: list[tuple[int, ActorId]],
    what: str,
    timeout_s: float,
    make_env: Callable[[int, PortId], Envelope],
    go: Callable[[], Any],
    transform: Callable[[Any], Any] | None = None,
) -> LaneFuture | None:
    """A `LaneFuture` for this call if it may take lanes (module doc), else None.

    ``dests`` are (rank, actor) pairs: one with rank -1 for ``call_one`` (the future's
    value is the reply), else one per rank (the value is ``transform({rank: reply})``).
    ``make_env(rank, reply_to)`` builds a request; ``go`` and ``transform`` are the
    ordinary loop-side closure and transform (as for `runtime.call`), used if the future
    is sent through the loop after all.
    """
    st: _ThreadState | None = getattr(_tls, "state", None)
    if st is None or st.deferred is not None:
        return None
    last = st.last_fut
    if last is None or not last._state:
        return None
    procs = st.last_procs
    me = client_proc.proc_id
    for _, dest in dests:
        if dest.proc not in procs or dest.proc == me:
            return None
    if not config.get().lanes or on_loop_thread():
        return None
    legs: list[Leg] = []
    lookup = client_proc.router.lookup
    for rank, dest in dests:
        addr = lookup(dest)
        if addr is None or addr.transport != "unix":
            return None
        legs.append((rank, dest, addr))
    if len(legs) > 1 and len({addr for _, _, addr in legs}) < len(legs):
        return None  # one lane per leg
    fut = LaneFuture(client_proc, st, legs, what, timeout_s, make_env, go, transform)
    st.deferred = fut
    _sweeper.add(st)
    return fut


class LaneFuture(Future[Any]):
    """A call's future that its thread may complete over lanes (see the module doc)."""

    __slots__ = (
        "_owner", "_st", "_legs", "_proc", "_what", "_timeout_s",
        "_make_env", "_go", "_lane_transform", "_claim", "_born",
    )

    def __init__(
        self,
        proc: Proc,
        st: _ThreadState,
        legs: list[Leg],
        what: str,
        timeout_s: float,
        make_env: Callable[[int, PortId], Envelope],
        go: Callable[[], Any],
        transform: Callable[[Any], Any] | None,
    ) -> None:
        super().__init__(proc.loop)
        self._owner = threading.get_ident()
        self._st = st
        self._legs = legs
        self._proc = proc
        self._what = what
        self._timeout_s = timeout_s
        self._make_env = make_env
        self._go = go
        self._lane_transform = transform
        self._claim = _UNSENT
        self._born = time.monotonic()

    def _take(self, how: int) -> bool:
        """Claim the unsent request for the lane or the loop; False if already taken."""
        with _state_lock:
            if self._claim != _UNSENT:
                return False
            self._claim = how
        st = self._st
        if st.deferred is self:
            st.deferred = None
        return True

    def _demote(self) -> None:
        """Send it the ordinary way (through the loop), if nobody has sent it yet."""
        if not self._take(_POSTED):
            return
        st = self._st
        runtime.call_into(self, self._go, self._lane_transform)
        st.last_procs = frozenset(dest.proc for _, dest, _ in self._legs)
        st.last_fut = self

    # -- consumers -----------------------------------------------------------------------

    def _lane_wait(self, timeout: float | None) -> bool:
        """Complete this future over lanes if the caller may; False if it may not."""
        if self._claim != _UNSENT or threading.get_ident() != self._owner:
            return False
        if timeout is not None and timeout < self._timeout_s:
            return False  # the reply could outlive this wait: let the loop own it
        if not self._take(_LANE):
            return False
        st, client = self._st, self._proc.proc_id
        try:
            lanes = [st.lane_to(addr, client) for _, _, addr in self._legs]
        except Exception:  # noqa: BLE001 - no lane (LinkLost, OSError, ...): nothing left,
            self._claim = _UNSENT  # so send it the ordinary way
            self._demote()
            return False
        try:
            if self._legs[0][0] < 0:
                value = lanes[0].call(self)
            else:
                value = _gather(self, lanes)
                if self._lane_transform is not None:
                    value = self._lane_transform(value)
        except _NotSent:
            self._claim = _UNSENT
            self._demote()
            return False
        except BaseException as e:  # noqa: BLE001 - the call's outcome
            self._finish(None, e)
            return True
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
        if self._claim == _UNSENT:
            self._demote()
        return self._state == _FINISHED

    def add_done_callback(self, fn: Callable[[Future[Any]], Any]) -> None:
        if self._claim == _UNSENT:
            self._demote()
        super().add_done_callback(fn)

    def __await__(self) -> Any:
        if self._claim == _UNSENT:
            self._demote()
        return super().__await__()


class _NotSent(Exception):
    """The request never left (connect or write failed): the loop path may still send it."""


def _gather(fut: LaneFuture, lanes: list[_Lane]) -> dict[int, Any]:
    """Send one request per leg over its lane, then read every reply: {rank: value}.

    Errors follow `palatine.mailbox.Gather`: the lowest failed rank's error is raised,
    with a note naming every failed rank when there are several.
    """
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    waiting: dict[int, tuple[int, _Lane, PortId, int]] = {}  # fd -> (rank, lane, port, leg)
    for i, ((rank, _dest, _addr), lane) in enumerate(zip(fut._legs, lanes, strict=True)):
        try:
            reply_to = lane.send(fut, rank)
        except _NotSent:
            if i == 0:
                raise  # nothing left yet: the loop path sends it all
            errors[rank] = _broken(fut, i, "the request could not be written")
            continue
        waiting[lane.sock.fileno()] = (rank, lane, reply_to, i)
    deadline = time.monotonic() + fut._timeout_s
    spin_s = spin_seconds()
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            for rank, _lane, _port, i in waiting.values():
                errors[rank] = _timeout(fut, i)
            break
        for fd, _ev in poll_spinning(poller, max(1, int(left * 1000)), spin_s):
            rank, lane, reply_to, i = waiting[fd]
            try:
                got, value = lane.take(reply_to, fut, i)
            except _Broken as b:
                got, value = True, b.error
            if got:
                del waiting[fd]
                poller.unregister(fd)
                if isinstance(value, _Failed):
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


class _Failed:
    """A reply that is an error (kept apart from values in a gather)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Broken(Exception):
    """A lane broke while waiting; ``error`` is what the call reports for its leg."""

    def __init__(self, error: _Failed) -> None:
        super().__init__(str(error.error))
        self.error = error


class _Lane:
    """One thread's connection to one proc's unix address."""

    __slots__ = ("addr", "actor", "sock", "parser", "seq", "ports", "broken", "spin_s", "_rcvtimeo")

    def __init__(self, addr: ChannelAddr, actor: ActorId, sock: socket.socket, parser: FrameParser) -> None:
        self.addr = addr
        self.actor = actor
        self.sock = sock
        self.parser = parser
        self.seq = 0
        self.ports = itertools.count()
        self.broken = False
        self.spin_s = spin_seconds()
        self._rcvtimeo = -1.0

    @classmethod
    def open(cls, addr: ChannelAddr, client: ProcId) -> _Lane:
        cfg = config.get()
        actor = ActorId(client, "lane", next(_lane_ids))
        stop = threading.Event()
        wake_r, wake_w = socket.socketpair()
        waiter = Waiter(stop, wake_r)
        try:
            conn = BlockingConn.connect(
                addr,
                waiter,
                token=resolve_token(),
                ssl_context=None,
                max_frame_bytes=cfg.max_frame_bytes,
                connect_timeout_s=cfg.connect_timeout_s,
                auth_timeout_s=cfg.auth_timeout_s,
                limit=time.monotonic() + cfg.connect_timeout_s + cfg.auth_timeout_s,
                lane=actor,
            )
        finally:
            waiter.close()
            wake_r.close()
            wake_w.close()
        sock = conn.sock
        sock.setblocking(True)  # waits are bounded by SO_RCVTIMEO (`_recv`) or poll
        return cls(addr, actor, sock, conn.parser)

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, fut: LaneFuture, rank: int) -> PortId:
        """Write one request of ``fut`` (its leg for ``rank``); the reply port it names."""
        reply_to = PortId(self.actor, next(self.ports))
        env = fut._make_env(rank, reply_to)
        head, bufs, size = encode_message(self.seq, False, env)
        if size > config.get().max_frame_bytes:
            raise _NotSent  # the loop path reports the size error as usual
        try:
            if bufs:
                self._send_all([head, *bufs])
            else:
                self.sock.sendall(head)
        except OSError:
            self.close()
            raise _NotSent from None
        self.seq += 1
        return reply_to

    def call(self, fut: LaneFuture) -> Any:
        """Send ``fut``'s one request and read until its reply; the reply's value."""
        reply_to = self.send(fut, -1)
        deadline = time.monotonic() + fut._timeout_s
        while True:
            if deadline - time.monotonic() <= 0:
                raise _timeout(fut, 0)
            try:
                got, value = self.take(reply_to, fut, 0, deadline)
            except _Broken as b:
                raise b.error.error from None
            if got:
                if isinstance(value, _Failed):
                    raise value.error
                return value

    def take(self, reply_to: PortId, fut: LaneFuture, leg: int, deadline: float | None = None) -> tuple[bool, Any]:
        """Read once (blocking until ``deadline``, if given); ``(True, value)`` once the
        reply to ``reply_to`` is in (an error reply as `_Failed`), else ``(False, None)``."""
        for frame in self._recv(deadline, fut, leg):
            if type(frame) is Message:
                reply = frame.envelope
                if reply.dest != reply_to:
                    continue  # a late reply to an earlier call that timed out
                try:
                    value = decode_payload(reply)
                except Exception as e:  # noqa: BLE001 - as the loop path says it
                    return True, _Failed(
                        DeliveryError(f"mailbox error: cannot decode reply for {reply_to}: {e}")
                    )
                to_exc = getattr(type(value), "to_error", None)
                if to_exc is not None:
                    return True, _Failed(to_exc(value))
                return True, value
            if type(frame) is Reject:
                self.close()
                raise _Broken(_Failed(_broken(fut, leg, f"the peer rejected the lane: {frame.reason}")))
            if type(frame) is not Ack:
                self.close()
                raise _Broken(_Failed(_broken(fut, leg, f"unexpected {type(frame).__name__} frame on the lane")))
        return False, None

    def _send_all(self, parts: list[Any]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            n = self.sock.sendmsg(views)
            while n:
                first = views[0]
                if n >= len(first):
                    n -= len(first)
                    views.pop(0)
                else:
                    views[0] = first[n:]
                    n = 0

    def _recv(self, deadline: float | None, fut: LaneFuture, leg: int) -> list[Any]:
        """The frames one read brings ([] on a timeout); raises `_Broken` when it ends."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            # Keep the kernel's timeout unless it would overshoot the deadline by > 5 %.
            if self._rcvtimeo < 0 or self._rcvtimeo - left > 0.05 * left:
                self._set_rcvtimeo(left)
        try:
            data = recv_spinning(self.sock, _RECV_BYTES, self.spin_s) if self.spin_s else None
            if data is None:
                data = self.sock.recv(_RECV_BYTES)
        except BlockingIOError:  # SO_RCVTIMEO expired: the caller checks its deadline
            self._rcvtimeo = -1.0
            return []
        except OSError as e:
            self.close()
            why = os.strerror(e.errno) if e.errno else str(e)
            raise _Broken(_Failed(_broken(fut, leg, why))) from None
        if not data:
            self.close()
            raise _Broken(_Failed(_broken(fut, leg, "the lane's connection was closed by the peer")))
        try:
            return self.parser.feed(data)
        except FrameError as e:
            self.close()
            raise _Broken(_Failed(_broken(fut, leg, f"protocol error: {e.reason}"))) from None

    def _set_rcvtimeo(self, seconds: float) -> None:
        whole = int(seconds)
        micros = int((seconds - whole) * 1e6)
        if whole == 0 and micros == 0:
            micros = 1  # zero would mean "no timeout"
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval.pack(whole, micros))
        self._rcvtimeo = seconds


def _timeout(fut: LaneFuture, leg: int) -> CallTimeout:
    """As `palatine.mailbox.Pending` words it (a gather names its first rank's actor)."""
    dest = fut._legs[0][1]
    return CallTimeout(f"{fut._what} to {dest} timed out: no reply within {fut._timeout_s:g} s")


def _broken(fut: LaneFuture, leg: int, why: str) -> BaseException:
    """The error for a leg whose lane broke after the request left (module doc)."""
    dest = fut._legs[leg][1]
    proc = dest.proc
    client = fut._proc
    try:
        notice = runtime.call(lambda: client.watch(proc)).get(timeout=GONE_WAIT_S)
    except Exception:  # noqa: BLE001 - no verdict in time: say what we know
        notice = None
    if notice is not None:
        return peer_gone_error(proc, notice)
    return DeliveryError(f"broken link: {why} before the reply to {fut._what} from {dest}")


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
            fut = st.deferred
            if fut is None:
                continue
            if now - fut._born >= SWEEP_S:
                fut._demote()
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
        # A future held between the scan and the disarm armed nothing: look once more.
        if any(st.deferred is not None for st in states):
            self.add(states[0])


_sweeper = _Sweeper()
