"""Lanes: a plain thread's blocking calls without the loop thread in between.

``ref.x.call_one(...).get()`` from a plain thread normally hands the request to the
palatine loop thread, which writes it, reads the reply and wakes the caller again: two
thread switches on top of the round trip, the dearest part of a small call on a small
machine. A *lane* is a connection owned by the calling thread itself: the thread writes
the request and reads the reply with blocking socket calls. Its ``Init`` names the lane's
own reply actor (``<client proc>.lane[n]``); the serving proc sends whatever is addressed
to that actor back on the same connection (`palatine.channel.net.rx`), requests that
bounce included (`palatine.core.proc.Proc.return_envelope`).

A call goes through lanes only when all of these hold; otherwise nothing changes:

* it is ``call_one`` to one actor, or ``call`` to a mesh small enough to be cast directly
  (one request per rank, each on the thread's lane to that rank's proc), from a thread
  that is not a loop thread, with lanes on (config ``lanes``; ``PALATINE_LANES=0`` turns
  them off);
* the router already reaches every destination proc at a ``unix:``, ``tcp:`` or ``tls:``
  address (a tls lane's socket is a `TlsLaneSocket`). A unix lane's connection ends when the peer proc
  stops or dies; a tcp lane to another machine may sit behind a partition that ends
  nothing here, so a thread waiting on one also checks every `GONE_CHECK_S` whether the
  system has declared the peer dead, and then fails the call as the loop path would;
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
their requests in a few growing chunks (`run_batch`) and reads until every one
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

import collections
import errno
import functools
import heapq
import itertools
import select
import socket
import ssl
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.channel.spin import MAX_WAIT_S, poll_ms, poll_spinning, recv_spinning, spin_seconds
from palatine.core import runtime
from palatine.core.future import _FINISHED, Future, _state_lock, on_loop_thread
from palatine.core.mailbox import Undeliverable
from palatine.core.proc import Proc, peer_gone_error
from palatine.errors import CallTimeout, DeliveryError
from palatine.fastpath.blocking import BlockingConn
from palatine.fastpath.direct_tx import drop_sent
from palatine.ids import ActorId, PortId, ProcId
from palatine.wire.codec import decode_payload
from palatine.wire.envelope import Envelope
from palatine.wire.frames import Ack, FrameError, FrameParser, Message, Reject, encode_message

if TYPE_CHECKING:
    from palatine.core.mailbox import Mailbox

__all__ = [
    "SWEEP_S",
    "BATCH_MAX",
    "Call",
    "LaneFuture",
    "note_call",
    "try_call",
    "FIRST_CHUNK",
    "MAX_CHUNK",
    "call",
    "gather",
    "run_batch",
    "LaneConn",
    "Failed",
    "Broken",
    "NotSent",
    "WriteTimeout",
    "timeout_error",
    "broken_errors",
    "GONE_WAIT_S",
]


# --------------------------------------------------------------------------- one lane's connection

GONE_WAIT_S: Final = 2.0  # after a broken lane: how long to wait for the peer's verdict
_RECV_BYTES: Final = 262144
_timeval = struct.Struct("ll")
_lane_ids = itertools.count(1)


class Failed:
    """A reply that is an error (kept apart from values)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


# Transports lanes run over: unix within a machine, tcp and tls to others.
_LANE_TRANSPORTS = frozenset({"unix", "tcp", "tls"})
# How often a thread waiting on a tcp lane checks whether its peer was declared dead.
GONE_CHECK_S: Final = 0.2


class Broken(Exception):
    """The lane's connection ended or misbehaved; ``why`` says how."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class NotSent(Exception):
    """The request never left (connect or write failed): the loop path may still send it."""


class WriteTimeout(Exception):
    """The peer read nothing more of a request before its call's deadline."""


def timeout_error(what: str, dest: ActorId, timeout_s: float) -> CallTimeout:
    """As `palatine.core.mailbox.Pending` words it."""
    return CallTimeout(f"{what} to {dest} timed out: no reply within {timeout_s:g} s")


def broken_errors(client: Proc, calls: list[tuple[str, ActorId]], why: str) -> list[BaseException]:
    """The error for each ``(what, dest)`` call whose lane broke after its request left:
    the peer's `PeerGoneError` once the system declares the proc dead (waiting up to
    `GONE_WAIT_S` once per proc), else a `DeliveryError` (whether it ran is unknown)."""
    notices: dict[ProcId, Any] = {}
    out: list[BaseException] = []
    for what, dest in calls:
        proc = dest.proc
        if proc not in notices:
            try:
                notices[proc] = runtime.call(functools.partial(client.watch, proc)).get(
                    timeout=GONE_WAIT_S
                )
            except Exception:  # noqa: BLE001 - no verdict in time: say what we know
                notices[proc] = None
        notice = notices[proc]
        if notice is not None:
            out.append(peer_gone_error(proc, notice))
        else:
            out.append(DeliveryError(f"broken link: {why} before the reply to {what} from {dest}"))
    return out


def _reply_value(reply: Envelope) -> Any:
    try:
        value = decode_payload(reply)
    except Exception as e:  # noqa: BLE001 - as the loop path says it
        return Failed(DeliveryError(f"mailbox error: cannot decode reply for {reply.dest}: {e}"))
    if type(value) is Undeliverable:  # the request came back (`Proc.return_envelope`)
        returned = value.envelope
        return Failed(DeliveryError("; ".join(returned.errors or ()) or "returned", returned))
    to_exc = getattr(type(value), "to_error", None)
    if to_exc is not None:
        return Failed(to_exc(value))
    return value


class TlsLaneSocket:
    """A lane's TLS socket with the calls the lane makes of a plain one.

    The lane writes with ``MSG_DONTWAIT`` and gathers, reads with ``SO_RCVTIMEO`` and
    spins with non-blocking reads; an `ssl.SSLSocket` takes none of that. Here the TLS
    socket stays non-blocking and: a write completes whole or fails (TLS must repeat an
    unfinished record with the same bytes, so it is never left half done; a peer that
    reads nothing for `config.Config.message_delivery_timeout_s` fails it with
    ``ETIMEDOUT``), a read waits at most the timeout last set (`BlockingIOError` after
    it, as ``SO_RCVTIMEO`` gives), ``MSG_DONTWAIT`` reads do not wait, and `pending`
    says when decrypted bytes wait that a poll of the descriptor would not report.
    """

    __slots__ = ("_sock", "_timeout_s", "_readable")

    def __init__(self, sock: ssl.SSLSocket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._timeout_s = 1.0
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def pending(self) -> int:
        return self._sock.pending()

    def setblocking(self, flag: bool) -> None:
        """Kept non-blocking: waits are this class's."""

    def setsockopt(self, level: int, name: int, value: bytes) -> None:
        if level == socket.SOL_SOCKET and name == socket.SO_RCVTIMEO:
            whole, micros = _timeval.unpack(value)
            self._timeout_s = whole + micros / 1e6

    def _wait(self, events: int, timeout_s: float) -> bool:
        if events == select.POLLIN:
            return bool(self._readable.poll(poll_ms(timeout_s)))
        poller = select.poll()
        poller.register(self._sock.fileno(), events)
        return bool(poller.poll(poll_ms(timeout_s)))

    def recv(self, nbytes: int, flags: int = 0) -> bytes:
        return self._read(self._sock.recv, (nbytes,), flags, b"")  # type: ignore[no-any-return]

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        return self._read(self._sock.recv_into, (buffer, nbytes), flags, 0)  # type: ignore[no-any-return]

    def _read(self, op: Callable[..., Any], args: tuple[Any, ...], flags: int, at_end: Any) -> Any:
        until = 0.0
        while True:
            try:
                return op(*args)
            except ssl.SSLWantReadError:
                events = select.POLLIN
            except ssl.SSLWantWriteError:
                events = select.POLLOUT
            except ssl.SSLZeroReturnError:  # the peer closed the TLS session
                return at_end
            until = until or time.monotonic() + self._timeout_s
            left = until - time.monotonic()
            if flags & socket.MSG_DONTWAIT or left <= 0 or not self._wait(events, left):
                raise BlockingIOError(errno.EAGAIN, "no data within the read timeout")

    def send(self, data: Any, flags: int = 0) -> int:
        until = 0.0
        while True:
            try:
                return self._sock.send(data)
            except ssl.SSLWantWriteError:
                events = select.POLLOUT
            except ssl.SSLWantReadError:
                events = select.POLLIN
            until = until or time.monotonic() + config.get().message_delivery_timeout_s
            left = until - time.monotonic()
            if left <= 0 or not self._wait(events, left):
                raise OSError(errno.ETIMEDOUT, "the peer read nothing of a lane write")

    def sendmsg(self, buffers: Any, ancdata: Any = (), flags: int = 0) -> int:
        return self.send(b"".join(buffers), flags)


class LaneConn:
    """One thread's connection to one proc's address; replies come back on it,
    addressed to the lane's own actor (``<client proc>.lane[n]``)."""

    __slots__ = (
        "addr",
        "peer_gone",
        "actor",
        "sock",
        "parser",
        "seq",
        "ports",
        "broken",
        "spin_s",
        "_rcvtimeo",
        "ended",
    )

    def __init__(
        self,
        addr: ChannelAddr,
        actor: ActorId,
        sock: socket.socket,
        parser: FrameParser,
        peer_gone: Callable[[], bool] | None = None,
    ) -> None:
        self.addr = addr
        # For a lane to another machine: whether the system has declared its proc dead.
        # Its connection may then never end (a partition), so waits check it every
        # `GONE_CHECK_S`.
        self.peer_gone = peer_gone
        self.actor = actor
        self.sock = sock
        self.parser = parser
        self.seq = 0
        self.ports = itertools.count()
        self.broken = False
        self.spin_s = spin_seconds()
        self._rcvtimeo = -1.0
        self.ended: str | None = None  # why it broke, once replies read before that are out

    @classmethod
    def open(
        cls, addr: ChannelAddr, client: ProcId, peer_gone: Callable[[], bool] | None = None
    ) -> LaneConn:
        actor = ActorId(client, "lane", next(_lane_ids))
        conn = BlockingConn.connect_configured(addr, lane=actor)
        sock: Any = conn.sock
        if isinstance(sock, ssl.SSLSocket):
            sock = TlsLaneSocket(sock)
        else:
            sock.setblocking(True)  # waits are bounded by SO_RCVTIMEO (`read`) or poll
        return cls(addr, actor, sock, conn.parser, peer_gone)

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass

    # -- writing -------------------------------------------------------------------------

    def send(self, make_env: Callable[[PortId], Envelope], deadline: float) -> PortId:
        """Write one request ``make_env(reply_to)``; its reply port. Raises `NotSent` when
        it may not be counted as sent (over the frame limit, or a failed write: the lane
        is closed then), and `WriteTimeout` when the peer reads nothing more before
        ``deadline`` (a request cut short closes the lane)."""
        reply_to = PortId(self.actor, next(self.ports))
        head, bufs, size = encode_message(self.seq, False, make_env(reply_to))
        if size > config.get().max_frame_bytes:
            raise NotSent  # the loop path reports the size error as usual
        sock = self.sock
        try:
            if not bufs:
                try:
                    n = sock.send(head, socket.MSG_DONTWAIT)  # the usual case: all at once
                except BlockingIOError:
                    n = 0
                if n < len(head):
                    self._write_rest(collections.deque([memoryview(head)[n:]]), n > 0, deadline)
            else:
                views = collections.deque(
                    v for v in (memoryview(head), *bufs) if v
                )  # (no empty one)
                self._write_rest(views, False, deadline)
        except (NotSent, WriteTimeout):
            raise
        except OSError:
            self.close()
            raise NotSent from None
        except BaseException:  # an interrupt mid-write: a frame may be cut short
            self.close()
            raise
        self.seq += 1
        return reply_to

    def _write_rest(
        self, views: collections.deque[memoryview], started: bool, deadline: float
    ) -> None:
        """Write ``views`` without blocking past ``deadline`` (``started``: part of the
        frame is out already). Replies that come meanwhile are read and dropped: they can
        only be late ones to calls that timed out (this request's own reply cannot come
        before it is whole), and a peer whose replies back up stops reading the lane."""
        sock = self.sock
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT | select.POLLIN)
        while views:
            try:
                n = sock.sendmsg(list(itertools.islice(views, 512)), [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = 0
            except OSError:
                self.close()
                raise NotSent from None
            started = started or n > 0
            drop_sent(views, n)
            while views:
                left = deadline - time.monotonic()
                events = poller.poll(poll_ms(left)) if left > 0 else []
                if not events:
                    if started:
                        self.close()  # nothing may follow a cut frame
                    raise WriteTimeout
                if not any(ev & select.POLLIN for _, ev in events):
                    break  # writable
                try:
                    self.read(None)  # late replies: drop them
                except Broken:
                    raise NotSent from None  # the lane is closed; the request did not arrive whole
                if any(ev & select.POLLOUT for _, ev in events):
                    break

    def encode(
        self, count: int, make_env: Callable[[int, PortId], Envelope]
    ) -> tuple[bytes, list[PortId]]:
        """Requests ``make_env(i, reply_to)`` for a batch as one buffer (buffers copied
        in) and their reply ports; the caller writes it (the sequence numbers are taken).
        Raises `NotSent` for a request over the frame limit (nothing taken then)."""
        limit = config.get().max_frame_bytes
        parts: list[Any] = []
        ports: list[PortId] = []
        seq = self.seq
        for i in range(count):
            reply_to = PortId(self.actor, next(self.ports))
            head, bufs, size = encode_message(seq, False, make_env(i, reply_to))
            if size > limit:
                raise NotSent
            seq += 1
            ports.append(reply_to)
            parts.append(head)
            parts.extend(bufs)
        self.seq = seq
        return b"".join(parts), ports

    # -- reading -------------------------------------------------------------------------

    def read(self, deadline: float | None) -> list[tuple[int, Any]]:
        """The replies one read brings, as ``(reply port index, value or Failed)``; [] when
        ``deadline`` passes first (no deadline: data is known to be there). Raises `Broken`
        once the connection has ended, after the replies that came before the end."""
        out: list[tuple[int, Any]] = []
        for frame in self._recv(deadline):
            if type(frame) is Message:
                reply = frame.envelope
                out.append((reply.dest.port, _reply_value(reply)))
            elif type(frame) is not Ack:
                why = (
                    f"the peer rejected the lane: {frame.reason}"
                    if type(frame) is Reject
                    else f"unexpected {type(frame).__name__} frame on the lane"
                )
                self._end(why)
                if not out:
                    raise Broken(why)
                break
        return out

    def take(self, reply_to: PortId, deadline: float | None) -> tuple[bool, Any]:
        """Read once; ``(True, value or Failed)`` once the reply to ``reply_to`` is in,
        else ``(False, None)``. Other replies are late ones to calls that timed out."""
        port = reply_to.port
        for index, value in self.read(deadline):
            if index == port:
                return True, value
        return False, None

    def _end(self, why: str) -> None:
        self.close()
        self.ended = why

    def _recv(self, deadline: float | None) -> list[Any]:
        """The frames one read brings ([] on a timeout); raises `Broken` when it ends."""
        if self.ended is not None:
            raise Broken(self.ended)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            if self.peer_gone is not None:
                left = min(left, GONE_CHECK_S)
            # Keep the kernel's timeout unless it would overshoot the deadline by > 5 %.
            if self._rcvtimeo < 0 or self._rcvtimeo - left > 0.05 * left:
                self._set_rcvtimeo(left)
        parser = self.parser
        # Mid-way through a big frame: receive straight into its buffer (no copy, no
        # allocation per read); the rest of a frame follows at once, so no spin either.
        window = parser.big_window()
        try:
            if window is not None:
                n = self.sock.recv_into(window)
                data = None
            else:
                data = recv_spinning(self.sock, _RECV_BYTES, self.spin_s) if self.spin_s else None
                if data is None:
                    data = self.sock.recv(_RECV_BYTES)
                n = len(data)
        except BlockingIOError:  # SO_RCVTIMEO expired: the caller checks its deadline
            self._rcvtimeo = -1.0
            if self.peer_gone is not None and self.peer_gone():
                self.close()
                raise Broken("its proc was declared dead while the call waited") from None
            return []
        except OSError as e:
            self.close()
            raise Broken(e.strerror or str(e)) from None
        if not n:
            self.close()
            raise Broken("the lane's connection was closed by the peer")
        try:
            return parser.feed(data) if data is not None else parser.big_filled(n)
        except FrameError as e:
            self.close()
            raise Broken(f"protocol error: {e.reason}") from None

    def _set_rcvtimeo(self, seconds: float) -> None:
        seconds = min(seconds, MAX_WAIT_S)  # (the caller reads again until its deadline)
        whole = int(seconds)
        micros = int((seconds - whole) * 1e6)
        if whole == 0 and micros == 0:
            micros = 1  # zero would mean "no timeout"
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval.pack(whole, micros))
        self._rcvtimeo = seconds


# --------------------------------------------------------------------------- calls over lanes (the calling thread's I/O)

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
    # (a TLS lane's socket is a TlsLaneSocket where the lane's type says socket)
    tls = [
        (fd, cast(TlsLaneSocket, w[1].sock))
        for fd, w in waiting.items()
        if isinstance(w[1].sock, TlsLaneSocket)
    ]
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            for rank, _lane, _port, _i in waiting.values():
                errors[rank] = timeout_error(fut._what, _dest(fut, 0), fut._timeout_s)
            break
        # decrypted bytes a TLS lane holds already are not on the descriptor any more
        held = [fd for fd, sock in tls if fd in waiting and sock.pending()] if tls else []
        ready = [(fd, select.POLLIN) for fd in held] or poll_spinning(poller, poll_ms(left), spin_s)
        for fd, _ev in ready:
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


# --------------------------------------------------------------------------- futures, batches and the sweep

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

    def lane_to(self, addr: ChannelAddr, client: Proc, peer: ProcId) -> LaneConn:
        """This thread's open lane to ``addr``, proc ``peer`` (connecting it if needed).

        A unix lane's connection ends when its peer does. A tcp lane may cross a
        partition that nothing on this machine sees end, so it also watches whether the
        system has declared ``peer`` dead (``client.gone``, filled on the loop thread)."""
        lane = self.lanes.get(addr)
        if lane is None or lane.broken:
            gone = client.gone
            watch = None if addr.transport == "unix" else (lambda: peer in gone)
            lane = self.lanes[addr] = LaneConn.open(addr, client.proc_id, watch)
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
    client_proc = cast(Proc, mb.proc)  # a client's mailbox lives in a Proc
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
        if addr is None or addr.transport not in _LANE_TRANSPORTS:
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
        proc = cast(Proc, mb.proc)  # a client's mailbox lives in a Proc
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
        client = self._proc
        try:
            lanes = [batch.st.lane_to(addr, client, dest.proc) for _, dest, addr in self._legs]
        except BaseException as e:  # no lane (LinkLost, OSError, an interrupt): nothing left,
            batch.back_to_loop()  # so send it the ordinary way
            if not isinstance(e, Exception):
                raise
            return False
        try:
            futs = batch.futs
            if len(futs) > 1:
                sent = run_batch(lanes[0], futs)
                if sent < len(futs):
                    _post_in_order(batch.st, futs[sent:])
                return True
            if self._legs[0][0] < 0:
                value = call(lanes[0], self)
            else:
                value = gather(self, lanes)
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

    result = get  # concurrent.futures' name, as on every palatine Future

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
