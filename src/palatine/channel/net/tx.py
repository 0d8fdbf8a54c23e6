"""The sending end of a network channel: `NetTx` and its client connection.

One random 64-bit session per Tx, seqs from 0, one per post.
Posted entries wait in ``outbox`` until the connection is ready, then move to
``unacked`` as they are written; cumulative ``Ack{n}`` frames drop every entry with
``seq <= n``. A lost connection is re-established with exponential backoff and
``unacked`` goes back to the front of ``outbox`` with its seqs unchanged; the resend
waits for the receiver's answer to ``Init`` (an ack of all it has), so a link that keeps
breaking still makes progress, and the receiver, which drops seqs it already has, sees
every message exactly once and in order. Every entry carries its post time: when the
oldest pending one is older than ``message_delivery_timeout`` the Tx closes and returns
everything still pending, oldest first.

The receiving end is `palatine.channel.net.rx`; what both share, and `dial_net`, live in
`palatine.channel.net`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Final, cast

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.channel.base import ReturnCallback, Tx, TxStatus
from palatine.channel.net.slices import SlicedWriter
from palatine.channel.net.sockets import resolve_security, tune_transport
from palatine.config import format_seconds
from palatine.errors import ChannelClosed, SendError, error_text
from palatine.wire.envelope import Envelope
from palatine.wire.frames import (
    PREAUTH_MAX_FRAME_BYTES,
    Ack,
    Frame,
    FrameError,
    FrameParser,
    Init,
    Reject,
    encode_frame,
    encode_message,
)
from palatine.wire.handshake import ClientHandshake, HandshakeError

__all__ = ["NetTx"]

logger = logging.getLogger(__name__)

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


#: OpenSSL reasons that mean a certificate was refused, by us or by the peer: retrying
#: cannot help, so the link fails at once with the reason.
_REFUSED_CERTIFICATE = frozenset(
    {
        "CERTIFICATE_VERIFY_FAILED",
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "TLSV1_ALERT_ACCESS_DENIED",
    }
)


class _ClosedEarly(ConnectionError):
    """The peer closed a connection before our handshake on it finished."""


#: tls connections closed by the peer during the handshake, in a row, that make a refusal.
_TLS_CLOSES_FINAL = 3


def _certificate_refused(exc: ssl.SSLError) -> bool:
    return isinstance(exc, ssl.SSLCertVerificationError) or exc.reason in _REFUSED_CERTIFICATE


def _tls_reason(exc: ssl.SSLError) -> str:
    """``certificate verify failed: unable to get local issuer certificate``, or what the
    peer said (``the peer refused our certificate: TLSV1_ALERT_UNKNOWN_CA``)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the peer's certificate was refused: {exc.verify_message or exc.reason}"
    return f"the peer refused our certificate: {exc.reason}"


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
        # tls: big writes a slice at a time (`palatine.channel.net.slices`)
        self.writer: SlicedWriter | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        tune_transport(transport)
        if self.tx._ssl is not None:
            self.writer = SlicedWriter(self.transport, self.tx._schedule_flush)

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
        if self.writer is not None:
            self.writer.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.writer is not None:
            self.writer.resume()  # (schedules a flush once its big write is handed over)
            if self.writer.busy:
                return
        self.tx._schedule_flush()

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.writer is not None:
            self.writer.clear()  # (unacked: a new connection sends it all again)
        if exc is not None:
            reason = f"connection lost: {error_text(exc)}"
        elif not self.parser.at_boundary:
            reason = "connection lost: EOF inside a frame"
        else:
            reason = "connection closed by peer"
        if not self.lost.done():
            self.lost.set_result(reason)
        if not self.ready.done():
            # A TLS alert before our handshake finished (TLS 1.3 reports the peer's
            # refusal of our certificate only now) keeps its type: the connect loop
            # gives up at once on a refused certificate.
            failure = exc if isinstance(exc, ssl.SSLError) else _ClosedEarly(reason)
            self.ready.set_exception(failure)
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
        if addr.transport not in ("tcp", "tls", "unix"):
            raise ValueError(f"not a network address: {addr}")
        self.addr = addr
        self._loop = asyncio.get_running_loop()
        self._token, self._ssl = resolve_security(addr, token, ssl_context, server=False)
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
        # tls: connections the peer closed in a row before our handshake finished
        self._tls_closed_early = 0
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

        An envelope with out-of-band buffers asks for an immediate ack: until then its
        buffers (often a large value, in pooled memory) stay pinned in ``unacked``.
        """
        self._post(env, on_return, None, bool(env.buffers))

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
                env.mark_returned_at(str(self.addr))
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
        if not self._flush_scheduled and self._conn is not None and self._outbox:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write the whole outbox in one call (seq order) and move it to ``unacked``."""
        self._flush_scheduled = False
        conn = self._conn
        outbox = self._outbox
        if conn is None or conn.write_paused or not outbox or self._init_ack_handle is not None:
            return
        out: Any = conn.writer or conn.transport
        assert out is not None
        if conn.writer is not None and conn.writer.busy:
            return  # (flushed once the big write before is handed over)
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
            out.writelines(parts)
        elif len(parts) == 1:
            out.write(parts[0])
        else:
            out.write(b"".join(parts))

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
            self._close(f"internal error: {error_text(exc)}")  # type: ignore[arg-type]

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
            except ssl.SSLError as exc:
                if _certificate_refused(exc):  # configuration, not weather: final, at once
                    self._close(f"tls: {_tls_reason(exc)}")
                    return
                self._last_error = error_text(exc)
            except _ClosedEarly as exc:
                self._last_error = error_text(exc)
                if self.addr.transport == "tls" and self._refused_in_handshake():
                    self._close(
                        f"tls: the peer closed {_TLS_CLOSES_FINAL} connections in a row during "
                        "the TLS handshake: it does not accept our certificate (signed by a CA "
                        "it does not trust, or none)"
                    )
                    return
            except (OSError, TimeoutError, ConnectionError) as exc:
                self._last_error = error_text(exc)
            else:
                backoff = self._backoff_initial
                self._tls_closed_early = 0
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

    def _refused_in_handshake(self) -> bool:
        """Count a tls connection the peer closed before our handshake; whether enough did.

        A server that refuses a client's certificate (TLS 1.3) just closes the
        connection after its side of the handshake; the client sees no alert. Several
        such closes in a row, and no connection that got through, is a refusal, not a
        passing fault: retrying until the delivery timeout would only hide it.
        """
        self._tls_closed_early += 1
        return self._tls_closed_early >= _TLS_CLOSES_FINAL

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
                f"connect timeout: no connection within {format_seconds(self._connect_timeout)} s"
            ) from None
        conn = proto
        self._attempt = conn
        try:
            async with asyncio.timeout(self._auth_timeout):
                await conn.ready
        except TimeoutError:
            if conn.transport is not None:
                conn.transport.abort()
            limit = format_seconds(self._auth_timeout)
            raise TimeoutError(f"handshake timeout: not authenticated within {limit} s") from None
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
            limit = format_seconds(self._timeout)
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
        at = str(self.addr)
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
            env.mark_returned_at(at)
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
