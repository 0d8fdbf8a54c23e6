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
`palatine.channel.net.server_conn.ServerConn`; `NetRx` listens, accepts, owns the sessions
and hands delivered envelopes to its handler.

The sending end is `palatine.channel.net.tx`; what both share, and `serve_net`, live in
`palatine.channel.net`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any, Final

from palatine import config
from palatine.channel import addr as addrs
from palatine.channel.addr import ChannelAddr
from palatine.channel.base import EnvelopeHandler, PeerLostHandler, Rx
from palatine.channel.local import InboundQueue
from palatine.channel.net.server_conn import READ_BYTES, ServerConn, Session
from palatine.channel.net.sockets import PeerWarnings, resolve_security
from palatine.channel.spin import loop_spin
from palatine.errors import error_text
from palatine.ids import ActorId, ProcId
from palatine.wire.envelope import Envelope

__all__ = ["NetRx"]

logger = logging.getLogger(__name__)

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
