"""A lane's connection: one thread's blocking unix connection to one proc (`palatine.fastpath.lane`).

`LaneConn` reads replies with plain blocking socket calls, bounded by ``SO_RCVTIMEO`` or
``poll`` and started with the idle spin (`palatine.channel.spin`); it writes requests
without ever blocking past the call's deadline (`WriteTimeout`). It knows nothing of futures: callers hand it envelopes and get
back replies by reply port, each a value or a `Failed` (an error reply). A broken
connection raises `Broken` with what happened; `broken_errors` turns that into what a
call reports (the peer's `PeerGoneError` once the system has ruled).
"""

from __future__ import annotations

import collections
import functools
import itertools
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, Final

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.channel.spin import MAX_WAIT_S, poll_ms, recv_spinning, spin_seconds
from palatine.core import runtime
from palatine.core.mailbox import Undeliverable
from palatine.core.proc import Proc, peer_gone_error
from palatine.errors import CallTimeout, DeliveryError
from palatine.fastpath.blocking import BlockingConn
from palatine.fastpath.direct_tx import drop_sent
from palatine.ids import ActorId, PortId, ProcId
from palatine.wire.codec import decode_payload
from palatine.wire.envelope import Envelope
from palatine.wire.frames import Ack, FrameError, FrameParser, Message, Reject, encode_message

__all__ = [
    "LaneConn",
    "Failed",
    "Broken",
    "NotSent",
    "WriteTimeout",
    "timeout_error",
    "broken_errors",
    "GONE_WAIT_S",
]

GONE_WAIT_S: Final = 2.0  # after a broken lane: how long to wait for the peer's verdict
_RECV_BYTES: Final = 262144
_timeval = struct.Struct("ll")
_lane_ids = itertools.count(1)


class Failed:
    """A reply that is an error (kept apart from values)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


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


class LaneConn:
    """One thread's connection to one proc's unix address; replies come back on it,
    addressed to the lane's own actor (``<client proc>.lane[n]``)."""

    __slots__ = (
        "addr",
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
        self, addr: ChannelAddr, actor: ActorId, sock: socket.socket, parser: FrameParser
    ) -> None:
        self.addr = addr
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
    def open(cls, addr: ChannelAddr, client: ProcId) -> LaneConn:
        actor = ActorId(client, "lane", next(_lane_ids))
        conn = BlockingConn.connect_configured(addr, lane=actor)
        sock = conn.sock
        sock.setblocking(True)  # waits are bounded by SO_RCVTIMEO (`read`) or poll
        return cls(addr, actor, sock, conn.parser)

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
