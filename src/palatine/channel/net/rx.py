"""The receiving end of a network channel: `NetRx`, its connections and sessions.

Each connection authenticates (`palatine.wire.handshake`),
sends ``Init{session_id, next_seq}``, then ``Message`` frames, each delivered if and
only if its seq is the session's next one. A session outlives its connection (a
reconnecting sender resumes it) until collected ``2 × message_delivery_timeout`` after
its last owner closed. Acks go out on ``ack_now``, every ``message_ack_every_n``
messages, after ``message_ack_interval`` and, best effort, when a connection closes. A
full inbound queue pauses reading (back-pressure through the socket). A malformed frame
closes only its connection, with one rate-limited WARNING naming the peer; so does a
refused TLS handshake (tls connections are accepted by hand for that reason). A
connection whose ``Init`` names a lane also carries messages back to its client
(`ServerConn.send_back`, `palatine.fastpath.lane`). Each connection is a
`palatine.channel.net.rx.ServerConn`; `NetRx` listens, accepts, owns the sessions
and hands delivered envelopes to its handler.

The sending end is `palatine.channel.net.tx`; what both share, and `serve_net`, live in
`palatine.channel.net`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from typing import Any, Final, cast

from palatine import config
from palatine.channel import addr as addrs
from palatine.channel.addr import ChannelAddr
from palatine.channel.base import EnvelopeHandler, PeerLostHandler, Rx
from palatine.channel.local import InboundQueue
from palatine.channel.net.slices import SlicedWriter
from palatine.channel.net.sockets import PeerWarnings, resolve_security, tune_transport
from palatine.channel.spin import loop_spin
from palatine.config import format_seconds
from palatine.errors import error_text
from palatine.ids import ActorId, ProcId
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
from palatine.wire.handshake import ServerHandshake

__all__ = [
    "NetRx",
    "ServerConn",
    "Session",
    "READ_BYTES",
]


logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- one accepted connection and its sessions


class Session:
    """Receiver state of one sender session: the next expected seq and its owner."""

    __slots__ = ("expected", "gc_handle", "owner", "session_id")

    def __init__(self, session_id: int, expected: int) -> None:
        self.session_id = session_id
        self.expected = expected
        self.owner: ServerConn | None = None
        self.gc_handle: asyncio.TimerHandle | None = None


_AUTH, _INIT, _OPEN, _CLOSED = range(4)
_peercred = struct.Struct("3i")


READ_BYTES: Final = 256 * 1024
# Lane replies held within one read are written every this many buffers, so the caller
# decodes the first replies while later requests of a big batch are still being handled.
BACK_FLUSH_BUFFERS: Final = 32


class ServerConn(asyncio.BufferedProtocol):
    """One inbound connection of a `NetRx`.

    Reads go into the `NetRx`'s read chunk, copied out as ``bytes`` for the parser at
    once (so every connection of the loop can share it), except while a big frame is
    being assembled: then the socket is read straight into the frame's own buffer
    (`FrameParser.big_window`), so a large value is copied once, by the kernel.
    """

    def __init__(self, rx: NetRx) -> None:
        self.rx = rx
        self.transport: asyncio.Transport | None = None
        # What frames are written through: the transport, or for tls a `SlicedWriter`
        # over it (big lane replies a slice at a time).
        self.out: Any = None
        self._writer: SlicedWriter | None = None
        self.parser = FrameParser(PREAUTH_MAX_FRAME_BYTES)
        self._into_big = False
        self.handshake = ServerHandshake(rx._token)
        self.state = _AUTH
        self.session: Session | None = None
        self.senders: set[ProcId] = set()
        self._last_sender: ProcId | None = None
        self._since_ack = 0
        self._last_ack = -1
        self._ack_handle: asyncio.TimerHandle | None = None
        self._auth_handle: asyncio.TimerHandle | None = None
        self._stall_handle: asyncio.TimerHandle | None = None  # (see `_watch_big_frame`)
        self._progress_at = 0.0
        self.paused = False
        self._write_blocked = False  # (see `pause_writing`)
        self._reading_paused = False
        self._held: list[Frame] | None = None  # a lane's requests read while writing was blocked
        self.taken_over = False
        self._lost = False
        self.peer = "unknown peer"
        self.peer_key = "?"
        self.lane: ActorId | None = None  # set by a lane's Init (`send_back`)
        self._back_seq = 0
        self._back: list[Any] | None = None  # lane replies held until the read is handled

    # -- connection events ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        rx = self.rx
        tune_transport(transport)
        self.out = self.transport
        if rx._ssl is not None:
            self.out = self._writer = SlicedWriter(self.transport)
        self.peer, self.peer_key = _peer_of(transport)
        if rx._stopping:
            self.transport.abort()
            return
        rx._conns.add(self)
        self.out.write(encode_frame(self.handshake.hello()))
        self._auth_handle = rx._loop.call_later(rx._auth_timeout, self._auth_expired)

    def get_buffer(self, sizehint: int) -> memoryview:
        window = self.parser.big_window() if self.state != _CLOSED else None
        self._into_big = window is not None
        return window if window is not None else self.rx._read_chunk

    def buffer_updated(self, nbytes: int) -> None:
        if not self._into_big:
            self.data_received(bytes(self.rx._read_chunk[:nbytes]))
            return
        if self.state == _CLOSED:
            return
        try:
            frames = self.parser.big_filled(nbytes)
        except FrameError as exc:
            self._fail(exc.reason, reject=not exc.before_body)
            return
        self._watch_big_frame()
        if frames:
            self._frames(frames)

    def data_received(self, data: bytes) -> None:
        if self.state == _CLOSED:
            return
        try:
            frames = self.parser.feed(data)
        except FrameError as exc:
            self._fail(exc.reason, reject=not exc.before_body)
            return
        if self._stall_handle is not None or self.parser.big_window() is not None:
            self._watch_big_frame()
        if self.lane is None:
            self._frames(frames)
            return
        self._lane_frames(frames)
        self.rx._spin()  # a blocking caller: its next request follows the reply

    def _lane_frames(self, frames: list[Frame]) -> None:
        """A lane's requests: the replies they make go out together (`BACK_FLUSH_BUFFERS`
        at a time)."""
        out: list[Any] = []
        self._back = out
        try:
            self._frames(frames)
        finally:
            self._back = None
            transport = self.transport
            if out and transport is not None and not transport.is_closing():
                if len(out) == 1:
                    self.out.write(out[0])
                else:
                    self.out.writelines(out)

    def _frames(self, frames: list[Frame]) -> None:
        """Deliver in-session ``Message`` frames, handle the rest; then maybe ack."""
        rx = self.rx
        deliver = rx._deliver
        ack_now = False
        for i, frame in enumerate(frames):
            if self._write_blocked and self.lane is not None:
                self._held = frames[i:]  # the caller is not reading: the rest waits
                break
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
                self.out.write(encode_frame(reply))
                self._close()
                return
            self.out.write(encode_frame(reply))
            self.parser.limit = self.rx._max_frame
            self.state = _INIT  # (the auth timer runs on until the Init: `_auth_expired`)
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
        if frame.lane is not None and frame.lane.name != "lane":
            # A lane's replies never take over the route of a real actor.
            self._fail(f"invalid lane {frame.lane}: a lane's actor is named 'lane'")
            return
        session = rx._sessions.get(frame.session_id)
        if session is None:
            session = Session(frame.session_id, frame.next_seq)
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
        if self._auth_handle is not None:
            self._auth_handle.cancel()
            self._auth_handle = None
        if frame.lane is not None:
            self.lane = frame.lane
            rx.lanes[frame.lane] = self
        # Always answer Init with what we have (-1: nothing yet), so a reconnecting
        # client resends only what is missing.
        self._last_ack = session.expected - 1
        assert self.transport is not None
        self.out.write(encode_frame(Ack(self._last_ack)))

    def _take_over(self) -> None:
        """A newer connection owns our session now: close without reporting a lost peer."""
        self.taken_over = True
        self.session = None
        self._close()

    # -- lanes ---------------------------------------------------------------------------

    def send_back(self, env: Envelope) -> str | None:
        """Write ``env`` to a lane's owner as a ``Message`` of our own; why not, if not.

        Lane replies have no acks and no resend: a lane lives as long as its connection
        (`palatine.fastpath.lane`), and its owner reads every frame until its reply arrives.
        """
        transport = self.transport
        if self.state != _OPEN or transport is None or transport.is_closing():
            return "the lane's connection is closed"
        head, bufs, size = encode_message(self._back_seq, False, env)
        if size > self.rx._max_frame:
            return f"message of {size} bytes exceeds max frame size {self.rx._max_frame}"
        self._back_seq += 1
        out = self._back
        if out is not None:  # inside `data_received`: written when it ends (or fills)
            out.append(head)
            if bufs:
                out.extend(bufs)
            if len(out) >= BACK_FLUSH_BUFFERS:
                self.out.writelines(out)
                out.clear()
        elif bufs:
            self.out.writelines([head, *bufs])
        else:
            self.out.write(head)
        return None

    def _unregister_lane(self) -> None:
        lane = self.lane
        if lane is not None and self.rx.lanes.get(lane) is self:
            del self.rx.lanes[lane]

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
        self.out.write(encode_frame(Ack(seq)))

    def _ack_timer(self) -> None:
        self._ack_handle = None
        if self.state == _OPEN and self._since_ack:
            self._send_ack()

    # -- a big frame that stops arriving ----------------------------------------------------
    # Its buffer is as big as the frame announced: a peer that stops sending mid-way must
    # not hold it for ever. After `message_delivery_timeout_s` without a byte (its sender
    # has failed the message by then) the connection is closed and the buffer freed.

    def _watch_big_frame(self) -> None:
        self._progress_at = self.rx._loop.time()
        if self._stall_handle is None and self.parser.big_window() is not None:
            self._stall_handle = self.rx._loop.call_later(self.rx._stall_timeout, self._stall_check)

    def _stall_check(self) -> None:
        self._stall_handle = None
        if self.state == _CLOSED or self.parser.big_window() is None:
            return
        timeout = self.rx._stall_timeout
        now = self.rx._loop.time()
        if self._reading_paused:  # we are not reading: not the peer's stall
            self._progress_at = now
        left = self._progress_at + timeout - now
        if left > 0:
            self._stall_handle = self.rx._loop.call_later(left, self._stall_check)
            return
        self._fail(f"a frame stopped arriving: no byte of it for {format_seconds(timeout)} s")

    # -- failure and closing -------------------------------------------------------------

    def _auth_expired(self) -> None:
        self._auth_handle = None
        if self.state in (_AUTH, _INIT):  # a session must be open within the auth timeout
            what = (
                "authenticated"
                if self.state == _AUTH
                else "initialized (no Init after authenticating)"
            )
            self.rx._warn(
                self.peer_key,
                f"closing connection from {self.peer}: not {what} within "
                f"{format_seconds(self.rx._auth_timeout)} s",
            )
            self._close(abort=True)

    def _fail(self, reason: str, reject: bool = True) -> None:
        """A malformed or invalid frame: warn (rate-limited), ``Reject``, close."""
        self.rx._warn(self.peer_key, f"closing connection from {self.peer}: {reason}")
        if reject and self.transport is not None and not self.transport.is_closing():
            self.out.write(encode_frame(Reject(reason)))
        self._close(abort=not reject)

    def _release(self) -> None:
        """Cancel the timers and drop any incomplete frame (its buffer, at once)."""
        for handle in (self._ack_handle, self._auth_handle, self._stall_handle):
            if handle is not None:
                handle.cancel()
        self._ack_handle = self._auth_handle = self._stall_handle = None
        self.parser.discard()

    def _close(self, abort: bool = False, final_ack: bool = False) -> None:
        if self.state == _CLOSED:
            return
        if final_ack and self.state == _OPEN:
            self._send_ack()
        self.state = _CLOSED
        self._unregister_lane()
        self._release()
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                if self._writer is not None:
                    self._writer.hand_over()  # (a lane reply under way, a last ack)
                self.transport.close()

    # Reading is paused while either the proc's inbound queue is full (`pause`, by the
    # Rx) or the peer does not read what we write to it (`pause_writing`, by asyncio):
    # a lane whose caller stopped reading its replies must not make us buffer them
    # without end, so its requests wait (read ones in `_held`) until it catches up.

    def pause(self) -> None:
        if not self.paused:
            self.paused = True
            self._update_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self._update_reading()

    def pause_writing(self) -> None:
        self._write_blocked = True
        if self._writer is not None:
            self._writer.pause()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_blocked = False
        if self._writer is not None:
            self._writer.resume()  # (a big write's next slices: may block writing again)
        if not self._write_blocked:
            held, self._held = self._held, None
            if held and self.state != _CLOSED:
                self._lane_frames(held)  # (may block writing again)
        self._update_reading()

    def _update_reading(self) -> None:
        want = self.paused or self._write_blocked
        if want != self._reading_paused and self.transport is not None and self.state != _CLOSED:
            self._reading_paused = want
            if want:
                self.transport.pause_reading()
            else:
                self._progress_at = self.rx._loop.time()  # (a stalled frame's clock restarts)
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
        self._release()
        if self._writer is not None:
            self._writer.clear()
        rx._conns.discard(self)
        rx._paused.discard(self)
        self._unregister_lane()
        session = self.session
        self.session = None
        if session is not None and session.owner is self:
            session.owner = None
            if not rx._stopping:
                session.gc_handle = rx._loop.call_later(
                    rx._session_gc_s, rx._collect_session, session
                )
        # A lane carries one thread's calls: its end says nothing about the sender proc.
        if self.senders and self.lane is None and not self.taken_over and not rx._stopping:
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


# --------------------------------------------------------------------------- the listener

_BACKLOG: Final = 1024


class NetRx(Rx):
    """The serving end of a tcp, unix or tls address (create with `serve_net`)."""

    def __init__(
        self,
        addr: ChannelAddr,
        *,
        token: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.addr = addr
        self._loop = asyncio.get_running_loop()
        self._spin = loop_spin(self._loop).poke
        self._token, self._ssl = resolve_security(addr, token, ssl_context, server=True)
        cfg = config.get()
        self._max_frame = cfg.max_frame_bytes
        self._auth_timeout = cfg.auth_timeout_s
        self._stall_timeout = (
            cfg.message_delivery_timeout_s
        )  # a big frame's bytes stop (`ServerConn`)
        self._ack_every_n = cfg.message_ack_every_n
        self._ack_interval = cfg.message_ack_interval_s
        self._session_gc_s = 2 * cfg.message_delivery_timeout_s
        self._queue = InboundQueue(cfg.inbound_queue_frames)
        # Shared by every connection: each read is copied out before the next one.
        self._read_chunk = memoryview(bytearray(READ_BYTES))
        self._queue.on_space = self._resume_all
        self._handler: EnvelopeHandler | None = None
        self._on_peer_lost: PeerLostHandler | None = None
        self._sessions: dict[int, Session] = {}
        # Open lanes by their reply actor; the proc routes messages for it here.
        self.lanes: dict[ActorId, ServerConn] = {}
        self._conns: set[ServerConn] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # TLS handshakes in progress
        self._listener: socket.socket | None = None  # tls only (see _accept_tls)
        self._accepting: asyncio.Task[None] | None = None
        self._paused: set[ServerConn] = set()
        self._warnings = PeerWarnings()
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
                        lambda: ServerConn(self), sock=sock, backlog=_BACKLOG
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
                        lambda: ServerConn(self),
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
                lambda: ServerConn(self),
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
            reason = f"TLS handshake failed: {error_text(exc)}"
            self._warn(host, f"refused connection from {shown}: {reason}")

    # -- delivery ------------------------------------------------------------------------

    def _deliver(self, env: Envelope, conn: ServerConn) -> None:
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

    def _collect_session(self, session: Session) -> None:
        session.gc_handle = None
        if session.owner is None and self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]

    def _warn(self, peer_key: str, text: str) -> None:
        """One WARNING per peer per `WARN_INTERVAL_S`; the rest at DEBUG."""
        self._warnings.warn(self.addr, peer_key, text)

    # -- public API ----------------------------------------------------------------------

    @property
    def session_count(self) -> int:
        """Sessions currently remembered (owned or awaiting collection)."""
        return len(self._sessions)

    async def recv(self) -> Envelope:
        """The next delivered envelope; raises `ChannelClosed` after `stop` (once drained)."""
        return await self._queue.get()

    def acknowledge_every(self, n: int) -> None:
        self._ack_every_n = max(1, n)

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
