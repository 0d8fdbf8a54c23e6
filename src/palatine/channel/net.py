"""Network channels: tcp, unix and tls over ``asyncio.Protocol`` (10-runtime.md §2.4–2.10).

Sender (`NetTx`): one random 64-bit session per Tx, seqs from 0, one per post. Posted
entries wait in ``outbox`` until the connection is ready, then move to ``unacked`` as
they are written; cumulative ``Ack{n}`` frames drop every entry with ``seq <= n``. A
lost connection is re-established with exponential backoff and ``unacked`` goes back to
the front of ``outbox`` with its seqs unchanged; the resend waits for the receiver's
answer to ``Init`` (an ack of all it has), so a link that keeps breaking still makes
progress, and the receiver, which drops seqs it already has, sees every message exactly
once and in order. Every entry carries its post time: when the oldest pending one is
older than ``message_delivery_timeout`` the Tx closes and returns everything still
pending, oldest first.

Receiver (`NetRx`): each connection authenticates (`palatine.wire.handshake`), sends
``Init{session_id, next_seq}``, then ``Message`` frames, each delivered if and only if
its seq is the session's next one. Acks go out on ``ack_now``, every
``message_ack_every_n`` messages, after ``message_ack_interval`` and, best effort, when
a connection closes. A full inbound queue pauses reading (back-pressure through the
socket). A malformed frame closes only its connection, with one rate-limited WARNING
naming the peer; so does a refused TLS handshake (tls connections are accepted by hand
for that reason).

Hot-path rules: posts are encoded once, coalesced per loop iteration and written with
one call; frames are parsed in place from each read; nothing is logged per message and
no Future or Task is created per post.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, cast

from palatine import config
from palatine.channel import addr as addrs
from palatine.channel.addr import ChannelAddr
from palatine.channel.base import (
    EnvelopeHandler,
    PeerLostHandler,
    ReturnCallback,
    Rx,
    Tx,
    TxStatus,
)
from palatine.channel.local import InboundQueue
from palatine.errors import ChannelClosed, SendError
from palatine.ids import ProcId
from palatine.wire.envelope import Envelope
from palatine.wire.frames import (
    PREAUTH_MAX_FRAME_BYTES,
    Ack,
    Frame,
    FrameError,
    FrameParser,
    Init,
    Message,
    Reject,
    encode_frame,
    encode_message,
)
from palatine.wire.handshake import ClientHandshake, HandshakeError, ServerHandshake

__all__ = ["WARN_INTERVAL_S", "NetRx", "NetTx", "dial_net", "serve_net"]

logger = logging.getLogger(__name__)

WARN_INTERVAL_S: Final = 60.0
"""At most one WARNING per peer per this many seconds (bad frames, failed auth)."""

_BACKLOG: Final = 1024
_JITTER: Final = 0.1

# Indexes of a pending entry, a tuple (seq, env, post_time, head, buffers, on_return, fut).
_SEQ: Final = 0
_ENV: Final = 1
_T: Final = 2
_HEAD: Final = 3
_BUFS: Final = 4
_RET: Final = 5
_FUT: Final = 6
_Entry = tuple[
    int,
    Envelope,
    float,
    bytes,
    list[memoryview],
    "ReturnCallback | None",
    "asyncio.Future[None] | None",
]


def _describe(exc: BaseException) -> str:
    """A short, human text for a connection error."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError) and not str(exc):
        return "timed out"
    text = str(exc)
    return text if text else type(exc).__name__


def _seconds(value: float) -> str:
    """Durations in return reasons: ``30.0``, ``1.0``, ``0.25``."""
    return repr(float(value))


def _set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # pragma: no cover - closed under our feet
            pass


# --------------------------------------------------------------------------------------
# Sender
# --------------------------------------------------------------------------------------


class _ClientConn(asyncio.Protocol):
    """One connection of a `NetTx`: handshake, then ``Ack`` frames in, messages out."""

    def __init__(self, tx: NetTx) -> None:
        self.tx = tx
        self.transport: asyncio.Transport | None = None
        self.parser = FrameParser(PREAUTH_MAX_FRAME_BYTES)
        self.handshake = ClientHandshake(tx._token)
        loop = tx._loop
        self.ready: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[str] = loop.create_future()
        self.open = False
        self.write_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        _set_nodelay(transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.parser.feed(data)
        except FrameError as exc:
            self._drop(f"protocol error: {exc.reason}")
            return
        tx = self.tx
        for frame in frames:
            if self.open and type(frame) is Ack:
                tx._on_ack(self, frame.seq)
            elif type(frame) is Reject:
                tx._on_reject(self, frame.reason)
            elif not self.open:
                self._handshake(frame)
            else:
                self._drop(f"protocol error: unexpected {type(frame).__name__} frame")
            if self.lost.done() or self.transport is None or self.transport.is_closing():
                return

    def _handshake(self, frame: Frame) -> None:
        try:
            reply = self.handshake.receive(frame)
        except HandshakeError as exc:
            if exc.fatal:
                self.tx._fatal(self, exc.reason)
            else:
                self._drop(exc.reason)
            return
        if reply is not None:
            assert self.transport is not None
            self.transport.write(encode_frame(reply))
            return
        self.parser.limit = self.tx._max_frame
        self.open = True
        self.tx._on_ready(self)
        if not self.ready.done():
            self.ready.set_result(None)

    def _drop(self, reason: str) -> None:
        """Give up on this connection (the Tx reconnects if it has work)."""
        if not self.lost.done():
            logger.warning("channel to %s: %s; reconnecting", self.tx.addr, reason)
            self.lost.set_result(reason)
        self.tx._on_lost(self)
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.tx._schedule_flush()

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            reason = f"connection lost: {_describe(exc)}"
        elif not self.parser.at_boundary:
            reason = "connection lost: EOF inside a frame"
        else:
            reason = "connection closed by peer"
        if not self.lost.done():
            self.lost.set_result(reason)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(reason))
            self.ready.exception()  # the connect loop may have stopped waiting
        self.tx._on_lost(self)


class NetTx(Tx):
    """The sending end of a tcp, unix or tls channel (connects lazily, on first post)."""

    def __init__(
        self,
        addr: ChannelAddr,
        *,
        token: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        from palatine.channel import tls
        from palatine.channel.token import resolve_token

        if addr.transport not in ("tcp", "tls", "unix"):
            raise ValueError(f"not a network address: {addr}")
        self.addr = addr
        self._loop = asyncio.get_running_loop()
        self._token = token if token is not None else resolve_token()
        if addr.transport == "tls" and ssl_context is None:
            ssl_context = tls.client_context()
        self._ssl = ssl_context
        cfg = config.get()
        self._timeout = cfg.message_delivery_timeout_s
        self._check_every = min(1.0, self._timeout / 10)
        self._max_frame = cfg.max_frame_bytes
        self._connect_timeout = cfg.connect_timeout_s
        self._auth_timeout = cfg.auth_timeout_s
        self._backoff_initial = cfg.reconnect_backoff_initial_s
        self._backoff_max = cfg.reconnect_backoff_max_s

        self.session_id = secrets.randbits(64)
        self._next_seq = 0
        self._acked = -1
        self._outbox: deque[_Entry] = deque()
        self._unacked: deque[_Entry] = deque()
        self._conn: _ClientConn | None = None
        self._attempt: _ClientConn | None = None
        self._task: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        self._check_handle: asyncio.TimerHandle | None = None
        # Set while a reconnected link waits for the server's answer to Init.
        self._init_ack_handle: asyncio.TimerHandle | None = None
        self._last_error = "not connected yet"
        self._status = TxStatus()
        self._closing = False
        self._callbacks: list[Callable[[str], None]] = []
        self._drained: asyncio.Future[None] | None = None
        self.connects = 0  # successful handshakes, for tests and diagnostics
        logger.debug("dialing channel %s", addr)

    # -- public API ----------------------------------------------------------------------

    @property
    def status(self) -> TxStatus:
        """``Active`` or ``Closed(reason)``."""
        return self._status

    @property
    def pending(self) -> int:
        """Messages posted and not yet acknowledged (outbox plus unacked)."""
        return len(self._outbox) + len(self._unacked)

    def post(self, env: Envelope, on_return: ReturnCallback | None = None) -> None:
        """Queue ``env``; never blocks. `ChannelClosed` only if this Tx is closed.

        An envelope whose frame exceeds ``max_frame_bytes`` is handed to ``on_return``
        (soon, not from inside this call) without using a seq; the Tx stays open. An
        envelope that cannot be encoded raises here.
        """
        self._post(env, on_return, None, False)

    async def send(self, env: Envelope) -> None:
        """Post with ``ack_now``; complete on the ack, or raise `SendError` if returned."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._post(env, None, fut, True)
        await fut

    def on_closed(self, cb: Callable[[str], None]) -> None:
        """Call ``cb(reason)`` when this Tx closes (at once if it already has)."""
        if self._status.closed:
            cb(self._status.reason or "channel closed")
        else:
            self._callbacks.append(cb)

    async def close(self, flush_timeout_s: float = 1.0) -> list[Envelope]:
        """Stop posts, wait up to ``flush_timeout_s`` for acks, then close.

        Returns the envelopes still unacknowledged, oldest first; they are not passed
        to ``on_return`` (a pending `send` raises `SendError`).
        """
        if self._status.closed:
            return []
        self._closing = True
        if self.pending and flush_timeout_s > 0:
            self._drained = self._loop.create_future()
            try:
                async with asyncio.timeout(flush_timeout_s):
                    await self._drained
            except TimeoutError:
                pass
            finally:
                self._drained = None
        if self._status.closed:  # closed meanwhile (delivery timeout, reject)
            return []
        left = list(self._unacked) + list(self._outbox)
        self._unacked.clear()
        self._outbox.clear()
        for entry in left:
            fut = entry[_FUT]
            if fut is not None and not fut.done():
                fut.set_exception(SendError("channel closed", entry[_ENV]))
        self._close("channel closed")
        return [entry[_ENV] for entry in left]

    # -- posting and writing -------------------------------------------------------------

    def _post(
        self,
        env: Envelope,
        on_return: ReturnCallback | None,
        fut: asyncio.Future[None] | None,
        ack_now: bool,
    ) -> None:
        if self._status.closed or self._closing:
            raise ChannelClosed(
                f"channel to {self.addr} is closed: {self._status.reason or 'closing'}",
                envelope=env,
            )
        seq = self._next_seq
        head, bufs, size = encode_message(seq, ack_now, env)
        if size > self._max_frame:
            reason = f"message of {size} bytes exceeds max frame size {self._max_frame}"
            if fut is not None:
                fut.set_exception(SendError(reason, env))
            elif on_return is not None:
                self._loop.call_soon(on_return, env, reason)
            return
        self._next_seq = seq + 1
        self._outbox.append((seq, env, self._loop.time(), head, bufs, on_return, fut))
        if self._conn is not None:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
        elif self._task is None:
            self._start()
        if self._check_handle is None:
            self._check_handle = self._loop.call_later(self._check_every, self._check)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._conn is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write the whole outbox in one call (seq order) and move it to ``unacked``."""
        self._flush_scheduled = False
        conn = self._conn
        outbox = self._outbox
        if conn is None or conn.write_paused or not outbox or self._init_ack_handle is not None:
            return
        transport = conn.transport
        assert transport is not None
        unacked = self._unacked
        parts: list[Any] = []
        vectored = False
        while outbox:
            entry = outbox.popleft()
            unacked.append(entry)
            parts.append(entry[_HEAD])
            if entry[_BUFS]:
                parts.extend(entry[_BUFS])
                vectored = True
        if vectored:
            transport.writelines(parts)
        elif len(parts) == 1:
            transport.write(parts[0])
        else:
            transport.write(b"".join(parts))

    # -- acks, rejects, connection events ------------------------------------------------

    def _on_ack(self, conn: _ClientConn, n: int) -> None:
        if n >= self._next_seq:
            conn._drop(f"protocol error: ack {n} beyond the last posted seq {self._next_seq - 1}")
            return
        if n <= self._acked:
            if self._init_ack_handle is not None:
                self._init_ack_done()
            return
        self._acked = n
        for queue in (self._unacked, self._outbox):
            while queue and queue[0][_SEQ] <= n:
                fut = queue.popleft()[_FUT]
                if fut is not None and not fut.done():
                    fut.set_result(None)
            if queue:
                break
        if self._drained is not None and not self.pending and not self._drained.done():
            self._drained.set_result(None)
        if self._init_ack_handle is not None:
            self._init_ack_done()

    def _on_reject(self, conn: _ClientConn, reason: str) -> None:
        from palatine.wire.handshake import rejected_reason

        self._fatal(conn, rejected_reason(reason))

    def _fatal(self, conn: _ClientConn, reason: str) -> None:
        """A reject or a wrong server proof: retrying cannot help, so close the Tx."""
        if not conn.lost.done():
            conn.lost.set_result(reason)
        self._close(reason)

    def _on_ready(self, conn: _ClientConn) -> None:
        """Handshake done: send ``Init``, then the outbox in seq order.

        After a reconnect the unacked entries go back to the front of the outbox, and
        writing waits for the server's answer to ``Init`` (an ``Ack`` of everything it
        already has), so a flaky link does not resend what already arrived.
        """
        self._conn = conn
        self.connects += 1
        resend = bool(self._unacked)
        if resend:
            self._unacked.extend(self._outbox)
            self._outbox, self._unacked = self._unacked, deque()
        first = self._outbox[0][_SEQ] if self._outbox else self._next_seq
        assert conn.transport is not None
        conn.transport.write(encode_frame(Init(self.session_id, first)))
        if resend:
            self._init_ack_handle = self._loop.call_later(self._auth_timeout, self._init_ack_done)
        else:
            self._flush()

    def _init_ack_done(self) -> None:
        """The server answered ``Init`` (or took too long to): start writing."""
        if self._init_ack_handle is not None:
            self._init_ack_handle.cancel()
            self._init_ack_handle = None
            self._flush()

    def _on_lost(self, conn: _ClientConn) -> None:
        if self._conn is conn:
            self._conn = None
            if self._init_ack_handle is not None:
                self._init_ack_handle.cancel()
                self._init_ack_handle = None
            self._last_error = conn.lost.result() if conn.lost.done() else "connection lost"

    # -- connecting ----------------------------------------------------------------------

    def _start(self) -> None:
        self._task = self._loop.create_task(self._run(), name=f"palatine-tx {self.addr}")
        self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if self._task is task:
            self._task = None
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            logger.error("channel to %s failed", self.addr, exc_info=exc)
            self._close(f"internal error: {_describe(exc)}")  # type: ignore[arg-type]

    async def _run(self) -> None:
        """Connect, serve the connection until it is lost, back off, repeat while pending."""
        me = asyncio.current_task()
        try:
            await self._connect_loop()
        finally:
            # Cleared here, not in a done callback, so a post right after sees no task.
            if self._task is me:
                self._task = None

    async def _connect_loop(self) -> None:
        backoff = self._backoff_initial
        while not self._status.closed:
            try:
                conn = await self._connect()
            except HandshakeError as exc:  # non-fatal ones only reach here
                self._last_error = exc.reason
            except (OSError, TimeoutError, ssl.SSLError, ConnectionError) as exc:
                self._last_error = _describe(exc)
            else:
                backoff = self._backoff_initial
                reason = await conn.lost
                self._on_lost(conn)
                self._last_error = reason
                if self._status.closed or not self.pending:
                    return
            if self._status.closed or not self.pending:
                return
            delay = backoff * random.uniform(1 - _JITTER, 1 + _JITTER)
            backoff = min(backoff * 2, self._backoff_max)
            await asyncio.sleep(delay)

    async def _connect(self) -> _ClientConn:
        loop = self._loop
        addr = self.addr
        try:
            async with asyncio.timeout(self._connect_timeout):
                if addr.transport == "unix":
                    # Connect the socket ourselves: uvloop refuses abstract names as paths.
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        sock.setblocking(False)
                        await loop.sock_connect(sock, addr.sockaddr())
                        _, proto = await loop.create_unix_connection(
                            lambda: _ClientConn(self), sock=sock
                        )
                    except BaseException:
                        sock.close()
                        raise
                else:
                    _, proto = await loop.create_connection(
                        lambda: _ClientConn(self),
                        addr.host,
                        addr.port,
                        ssl=self._ssl,
                        server_hostname=addr.host if self._ssl is not None else None,
                    )
        except TimeoutError:
            raise TimeoutError(
                f"connect timeout: no connection within {_seconds(self._connect_timeout)} s"
            ) from None
        conn = proto
        self._attempt = conn
        try:
            async with asyncio.timeout(self._auth_timeout):
                await conn.ready
        except TimeoutError:
            if conn.transport is not None:
                conn.transport.abort()
            raise TimeoutError(
                f"handshake timeout: not authenticated within {_seconds(self._auth_timeout)} s"
            ) from None
        except asyncio.CancelledError:
            if conn.transport is not None:
                conn.transport.abort()
            raise
        finally:
            self._attempt = None
        return conn

    # -- delivery timeout and closing ----------------------------------------------------

    def _check(self) -> None:
        """Periodic: close when the oldest pending message is past the delivery timeout."""
        self._check_handle = None
        if self._status.closed:
            return
        if self._unacked:
            oldest = self._unacked[0][_T]
        elif self._outbox:
            oldest = self._outbox[0][_T]
        else:
            return
        if self._loop.time() - oldest > self._timeout:
            limit = _seconds(self._timeout)
            if self._conn is not None:
                reason = (
                    f"delivery timeout: not acknowledged within {limit} s of posting "
                    "(link connected)"
                )
            else:
                reason = (
                    f"delivery timeout: not delivered within {limit} s of posting "
                    f"(link broken: {self._last_error})"
                )
            self._close(reason)
            return
        self._check_handle = self._loop.call_later(self._check_every, self._check)

    def _close(self, reason: str) -> None:
        """Close now: return every pending message (oldest first), fire ``on_closed``."""
        if self._status.closed:
            return
        self._status = TxStatus(True, reason)
        for handle in (self._check_handle, self._init_ack_handle):
            if handle is not None:
                handle.cancel()
        self._check_handle = self._init_ack_handle = None
        for conn in (self._conn, self._attempt):
            if conn is not None and conn.transport is not None:
                conn.transport.abort()
        self._conn = None
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        pending = list(self._unacked) + list(self._outbox)
        self._unacked.clear()
        self._outbox.clear()
        if pending:
            logger.info(
                "channel to %s closed (%s); returning %d message(s)",
                self.addr,
                reason,
                len(pending),
            )
        for entry in pending:
            env = entry[_ENV]
            fut = entry[_FUT]
            if fut is not None:
                if not fut.done():
                    fut.set_exception(SendError(reason, env))
                continue
            on_return = entry[_RET]
            if on_return is None:
                logger.debug("dropping returned message to %s: %s", self.addr, reason)
                continue
            try:
                on_return(env, reason)
            except Exception:
                logger.exception("on_return callback of the channel to %s failed", self.addr)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(reason)
            except Exception:
                logger.exception("on_closed callback of the channel to %s failed", self.addr)


# --------------------------------------------------------------------------------------
# Receiver
# --------------------------------------------------------------------------------------


class _Session:
    """Receiver state of one sender session: the next expected seq and its owner."""

    __slots__ = ("expected", "gc_handle", "owner", "session_id")

    def __init__(self, session_id: int, expected: int) -> None:
        self.session_id = session_id
        self.expected = expected
        self.owner: _ServerConn | None = None
        self.gc_handle: asyncio.TimerHandle | None = None


_AUTH, _INIT, _OPEN, _CLOSED = range(4)
_peercred = struct.Struct("3i")


class _ServerConn(asyncio.Protocol):
    """One inbound connection of a `NetRx`."""

    def __init__(self, rx: NetRx) -> None:
        self.rx = rx
        self.transport: asyncio.Transport | None = None
        self.parser = FrameParser(PREAUTH_MAX_FRAME_BYTES)
        self.handshake = ServerHandshake(rx._token)
        self.state = _AUTH
        self.session: _Session | None = None
        self.senders: set[ProcId] = set()
        self._last_sender: ProcId | None = None
        self._since_ack = 0
        self._last_ack = -1
        self._ack_handle: asyncio.TimerHandle | None = None
        self._auth_handle: asyncio.TimerHandle | None = None
        self.paused = False
        self.taken_over = False
        self._lost = False
        self.peer = "unknown peer"
        self.peer_key = "?"

    # -- connection events ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        rx = self.rx
        _set_nodelay(transport)
        self.peer, self.peer_key = _peer_of(transport)
        if rx._stopping:
            self.transport.abort()
            return
        rx._conns.add(self)
        self.transport.write(encode_frame(self.handshake.hello()))
        self._auth_handle = rx._loop.call_later(rx._auth_timeout, self._auth_expired)

    def data_received(self, data: bytes) -> None:
        if self.state == _CLOSED:
            return
        try:
            frames = self.parser.feed(data)
        except FrameError as exc:
            self._fail(exc.reason, reject=not exc.before_body)
            return
        rx = self.rx
        deliver = rx._deliver
        ack_now = False
        for frame in frames:
            if type(frame) is Message and self.state == _OPEN:
                session = self.session
                assert session is not None
                seq = frame.seq
                if seq == session.expected:
                    session.expected = seq + 1
                    env = frame.envelope
                    proc = env.sender.proc
                    if proc != self._last_sender:
                        self._last_sender = proc
                        self.senders.add(proc)
                    deliver(env, self)
                elif seq > session.expected:
                    self._fail(f"sequence gap: expected {session.expected}, got {seq}")
                    return
                self._since_ack += 1
                if frame.ack_now:
                    ack_now = True
            else:
                self._control(frame)
            if self.state == _CLOSED:
                return
        if self._since_ack:
            if ack_now or self._since_ack >= rx._ack_every_n:
                self._send_ack(force=ack_now)
            elif self._ack_handle is None:
                self._ack_handle = rx._loop.call_later(rx._ack_interval, self._ack_timer)

    def _control(self, frame: Frame) -> None:
        """Every frame except an in-session ``Message``: handshake, ``Init``, errors."""
        kind = type(frame).__name__
        if self.state == _AUTH:
            reply = self.handshake.receive(frame)
            assert self.transport is not None
            if type(reply) is Reject:
                reason = reply.reason
                self.rx._warn(self.peer_key, f"refused connection from {self.peer}: {reason}")
                self.transport.write(encode_frame(reply))
                self._close()
                return
            self.transport.write(encode_frame(reply))
            self.parser.limit = self.rx._max_frame
            self.state = _INIT
            if self._auth_handle is not None:
                self._auth_handle.cancel()
                self._auth_handle = None
        elif type(frame) is Init:
            if self.state != _INIT:
                self._fail("unexpected Init: the session is already initialized")
                return
            self._init(frame)
        elif type(frame) is Message:
            self._fail("Message before Init")
        elif type(frame) is Reject:
            logger.debug("peer %s rejected the connection: %s", self.peer, frame.reason)
            self._close()
        else:
            self._fail(f"unexpected {kind} frame")

    def _init(self, frame: Init) -> None:
        rx = self.rx
        session = rx._sessions.get(frame.session_id)
        if session is None:
            session = _Session(frame.session_id, frame.next_seq)
            rx._sessions[frame.session_id] = session
        else:
            if frame.next_seq > session.expected:
                self._fail(f"sequence gap: expected {session.expected}, got {frame.next_seq}")
                return
            if session.gc_handle is not None:
                session.gc_handle.cancel()
                session.gc_handle = None
            old = session.owner
            if old is not None and old is not self:
                old._take_over()
        session.owner = self
        self.session = session
        self.state = _OPEN
        # Always answer Init with what we have (-1: nothing yet), so a reconnecting
        # client resends only what is missing.
        self._last_ack = session.expected - 1
        assert self.transport is not None
        self.transport.write(encode_frame(Ack(self._last_ack)))

    def _take_over(self) -> None:
        """A newer connection owns our session now: close without reporting a lost peer."""
        self.taken_over = True
        self.session = None
        self._close()

    # -- acks ----------------------------------------------------------------------------

    def _send_ack(self, force: bool = False) -> None:
        self._since_ack = 0
        if self._ack_handle is not None:
            self._ack_handle.cancel()
            self._ack_handle = None
        session = self.session
        if session is None or self.transport is None:
            return
        seq = session.expected - 1
        if seq < 0 or (seq == self._last_ack and not force):
            return
        self._last_ack = seq
        self.transport.write(encode_frame(Ack(seq)))

    def _ack_timer(self) -> None:
        self._ack_handle = None
        if self.state == _OPEN and self._since_ack:
            self._send_ack()

    # -- failure and closing -------------------------------------------------------------

    def _auth_expired(self) -> None:
        self._auth_handle = None
        if self.state == _AUTH:
            self.rx._warn(
                self.peer_key,
                f"closing connection from {self.peer}: not authenticated within "
                f"{_seconds(self.rx._auth_timeout)} s",
            )
            self._close(abort=True)

    def _fail(self, reason: str, reject: bool = True) -> None:
        """A malformed or invalid frame: warn (rate-limited), ``Reject``, close."""
        self.rx._warn(self.peer_key, f"closing connection from {self.peer}: {reason}")
        if reject and self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(Reject(reason)))
        self._close(abort=not reject)

    def _close(self, abort: bool = False, final_ack: bool = False) -> None:
        if self.state == _CLOSED:
            return
        if final_ack and self.state == _OPEN:
            self._send_ack()
        self.state = _CLOSED
        for handle in (self._ack_handle, self._auth_handle):
            if handle is not None:
                handle.cancel()
        self._ack_handle = self._auth_handle = None
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and self.state != _CLOSED:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and self.state != _CLOSED:
            self.paused = False
            self.transport.resume_reading()

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        rx = self.rx
        if self.state != _CLOSED and not self.parser.at_boundary:
            logger.debug("connection from %s lost inside a frame", self.peer)
        self.state = _CLOSED
        for handle in (self._ack_handle, self._auth_handle):
            if handle is not None:
                handle.cancel()
        self._ack_handle = self._auth_handle = None
        rx._conns.discard(self)
        rx._paused.discard(self)
        session = self.session
        self.session = None
        if session is not None and session.owner is self:
            session.owner = None
            if not rx._stopping:
                session.gc_handle = rx._loop.call_later(
                    rx._session_gc_s, rx._collect_session, session
                )
        if self.senders and not self.taken_over and not rx._stopping:
            rx._peer_lost(set(self.senders))
        if not rx._conns and rx._all_closed is not None and not rx._all_closed.done():
            rx._all_closed.set_result(None)


def _peer_of(transport: asyncio.BaseTransport) -> tuple[str, str]:
    """(description, rate-limit key) of a connection's peer."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        shown = f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
        return shown, host
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            pid, uid, _ = _peercred.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _peercred.size)
            )
            return f"unix peer pid {pid} uid {uid}", f"pid {pid}"
        except (OSError, AttributeError):
            pass
    return "unix peer", "unix"


class NetRx(Rx):
    """The serving end of a tcp, unix or tls address (create with `serve_net`)."""

    def __init__(
        self,
        addr: ChannelAddr,
        *,
        token: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        from palatine.channel import tls
        from palatine.channel.token import resolve_token

        self.addr = addr
        self._loop = asyncio.get_running_loop()
        self._token = token if token is not None else resolve_token()
        if addr.transport == "tls" and ssl_context is None:
            ssl_context = tls.server_context()
        self._ssl = ssl_context
        cfg = config.get()
        self._max_frame = cfg.max_frame_bytes
        self._auth_timeout = cfg.auth_timeout_s
        self._ack_every_n = cfg.message_ack_every_n
        self._ack_interval = cfg.message_ack_interval_s
        self._session_gc_s = 2 * cfg.message_delivery_timeout_s
        self._queue = InboundQueue(cfg.inbound_queue_frames)
        self._queue.on_space = self._resume_all
        self._handler: EnvelopeHandler | None = None
        self._on_peer_lost: PeerLostHandler | None = None
        self._sessions: dict[int, _Session] = {}
        self._conns: set[_ServerConn] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # TLS handshakes in progress
        self._listener: socket.socket | None = None  # tls only (see _accept_tls)
        self._accepting: asyncio.Task[None] | None = None
        self._paused: set[_ServerConn] = set()
        self._warned: dict[str, float] = {}
        self._server: asyncio.AbstractServer | None = None
        self._stopping = False
        self._all_closed: asyncio.Future[None] | None = None

    async def _start(self) -> ChannelAddr:
        """Bind and listen; returns the real address (bound port or name)."""
        loop = self._loop
        addr = self.addr
        try:
            if addr.transport == "unix":
                if addr.is_any:
                    addr = addr.with_name(addrs.random_abstract_name())
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sockaddr = addr.sockaddr()
                    if addr.path is not None:
                        addrs.remove_socket_file(addr)  # a stale socket from a dead process
                    sock.bind(sockaddr)
                    addrs.secure_socket_file(addr)
                    sock.setblocking(False)
                    self._server = await loop.create_unix_server(
                        lambda: _ServerConn(self), sock=sock, backlog=_BACKLOG
                    )
                except BaseException:
                    sock.close()
                    raise
                bound = addr
            else:
                host = addr.host
                infos = await loop.getaddrinfo(
                    host, addr.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
                )
                family, ip = infos[0][0], str(infos[0][4][0])
                if self._ssl is None:
                    self._server = await loop.create_server(
                        lambda: _ServerConn(self),
                        ip,
                        addr.port,
                        backlog=_BACKLOG,
                        reuse_address=True,
                    )
                    sock = self._server.sockets[0]
                else:
                    # TLS connections are accepted by hand so that a refused handshake
                    # (no or untrusted client certificate) is ours to log, naming the peer.
                    sock = socket.create_server((ip, addr.port), family=family, backlog=_BACKLOG)
                    sock.setblocking(False)
                    self._listener = sock
                    self._accepting = loop.create_task(
                        self._accept_tls(sock, self._ssl), name=f"palatine-rx {addr}"
                    )
                bound = ChannelAddr.from_bound(addr.transport, sock, host=host)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve {self.addr}: {exc.strerror or exc}") from exc
        self.addr = bound
        logger.debug("serving channel %s", bound)
        return bound

    async def _accept_tls(self, listener: socket.socket, context: ssl.SSLContext) -> None:
        """Accept loop of a tls listener: one handshake task per connection."""
        loop = self._loop
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving
                logger.warning("channel %s: accept failed: %s", self.addr, exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._tls_handshake(sock, peer, context))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _tls_handshake(self, sock: socket.socket, peer: Any, context: ssl.SSLContext) -> None:
        try:
            await self._loop.connect_accepted_socket(
                lambda: _ServerConn(self),
                sock,
                ssl=context,
                ssl_handshake_timeout=self._auth_timeout,
            )
        except asyncio.CancelledError:
            sock.close()
            raise
        except (OSError, TimeoutError, ValueError) as exc:  # ssl.SSLError is an OSError
            sock.close()
            host = str(peer[0]) if isinstance(peer, tuple) else "?"
            shown = f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
            self._warn(
                host, f"refused connection from {shown}: TLS handshake failed: {_describe(exc)}"
            )

    # -- delivery ------------------------------------------------------------------------

    def _deliver(self, env: Envelope, conn: _ServerConn) -> None:
        handler = self._handler
        if handler is not None:
            try:
                handler(env)
            except Exception:
                logger.exception("envelope handler of %s failed", self.addr)
            return
        if self._queue.put(env) and not conn.paused:
            conn.pause()
            self._paused.add(conn)

    def _resume_all(self) -> None:
        paused, self._paused = self._paused, set()
        for conn in paused:
            conn.resume()

    def _peer_lost(self, procs: set[ProcId]) -> None:
        cb = self._on_peer_lost
        if cb is None:
            return
        try:
            cb(procs)
        except Exception:
            logger.exception("peer-lost handler of %s failed", self.addr)

    def _collect_session(self, session: _Session) -> None:
        session.gc_handle = None
        if session.owner is None and self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]

    def _warn(self, peer_key: str, text: str) -> None:
        """One WARNING per peer per `WARN_INTERVAL_S`; the rest at DEBUG."""
        now = time.monotonic()
        last = self._warned.get(peer_key)
        if last is not None and now - last < WARN_INTERVAL_S:
            logger.debug("channel %s: %s", self.addr, text)
            return
        if len(self._warned) > 4096:
            self._warned.clear()
        self._warned[peer_key] = now
        logger.warning("channel %s: %s", self.addr, text)

    # -- public API ----------------------------------------------------------------------

    @property
    def session_count(self) -> int:
        """Sessions currently remembered (owned or awaiting collection)."""
        return len(self._sessions)

    async def recv(self) -> Envelope:
        """The next delivered envelope; raises `ChannelClosed` after `stop` (once drained)."""
        return await self._queue.get()

    def set_handler(
        self, on_envelope: EnvelopeHandler, on_peer_lost: PeerLostHandler | None = None
    ) -> None:
        """Dispatch envelopes synchronously from the connection's read callback.

        Anything already queued is handed over first, in order. ``on_peer_lost`` gets
        the sender procs of each inbound connection that closes (not on `stop`, and not
        when a newer connection of the same session took over).
        """
        self._handler = on_envelope
        self._on_peer_lost = on_peer_lost
        for env in self._queue.take_all():
            try:
                on_envelope(env)
            except Exception:
                logger.exception("envelope handler of %s failed", self.addr)
        self._resume_all()

    async def stop(self) -> None:
        """Stop listening, send final acks, close every connection, remove a socket file."""
        if self._stopping:
            return
        self._stopping = True
        if self._server is not None:
            self._server.close()
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait([self._accepting], timeout=1.0)
        if self._listener is not None:
            self._listener.close()
        conns = list(self._conns)
        if conns:
            self._all_closed = self._loop.create_future()
        for conn in conns:
            conn._close(final_ack=True)
        for task in list(self._tasks):
            task.cancel()
        for session in self._sessions.values():
            if session.gc_handle is not None:
                session.gc_handle.cancel()
        self._sessions.clear()
        addrs.remove_socket_file(self.addr)
        self._queue.close()
        if self._all_closed is not None and self._conns:
            try:
                async with asyncio.timeout(1.0):
                    await self._all_closed
            except TimeoutError:
                for conn in list(self._conns):
                    if conn.transport is not None:
                        conn.transport.abort()


async def serve_net(
    addr: ChannelAddr,
    *,
    token: bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[ChannelAddr, NetRx]:
    """Serve a tcp, unix or tls address; returns the bound address and the Rx.

    Bind errors raise `OSError` naming the address with the OS message. ``token`` and
    ``ssl_context`` override the cluster token and the TLS files (tests).
    """
    rx = NetRx(addr, token=token, ssl_context=ssl_context)
    bound = await rx._start()
    return bound, rx


def dial_net(
    addr: ChannelAddr,
    *,
    token: bytes | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> NetTx:
    """A lazily connecting Tx to a tcp, unix or tls address (needs a running loop)."""
    return NetTx(addr, token=token, ssl_context=ssl_context)
