"""The heartbeat thread of a managed proc (20-system.md §2.3).

Every managed proc proves it is alive with a `SupervisionUpdate` to the system actor
every ``interval × U[0.5, 1.0]`` seconds. The beats come from a daemon thread,
``palatine-heartbeat``, with its **own connection** to the system address, never from
the event loop: a long handler or a busy loop must not look like a dead proc. Only a C
call that holds the GIL (or SIGSTOP) silences it.

The connection speaks the channel protocol of 10-runtime.md §2.4–2.6 through the sans-IO
halves in `palatine.wire.frames` and `palatine.wire.handshake`: token handshake, then
``Init{session_id, next_seq=0}`` with a fresh random session per connection, then one
``Message{seq, ack_now=True, envelope}`` per beat. Beats are idempotent, so nothing is
ever retransmitted: a beat lost with its connection is simply superseded by the next.
Acks are cumulative, so a late ``Ack`` still proves the system is alive now. A beat is
also sent right after each (re)connection, so a restarted system hears from the proc at
once instead of up to one period later.

Between beats the thread watches the socket, so a closed connection (the system died
or restarted) is noticed at once and re-dialed with backoff. The system, in turn, sees
this persistent connection close when the proc dies (its "connection lost" signal,
§1.8).

When no beat has been acknowledged for ``system_loss_timeout`` the thread logs
``lost contact with system at ADDR: no heartbeat acknowledged for 10.4 s (limit 10 s);
stopping``, calls ``on_system_lost()`` (the owner stops the proc), and waits
``proc_stop_timeout + 2`` s for the owner to call `HeartbeatThread.stop`; if it does
not and ``exit_process`` is set (the process's main proc), it ends the process with
status 1, since the owner's loop is evidently blocked.

The sockets are non-blocking and every wait goes through one selector that also
watches a wake-up socket, so each wait is bounded by a deadline and `stop` interrupts
any of them (connect, TLS handshake, token handshake, waiting for an ack). From the
event loop's point of view the connection is still "blocking": the thread owns it and
no loop is involved.

On local transport (``local:N``) there is nothing to dial: the owner supplies
``post_via_loop``, which the thread calls once per beat (it typically schedules the
beat on the loop with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from palatine import config
from palatine.channel.addr import ChannelAddr, parse
from palatine.ids import SYSTEM_ACTOR, ActorId
from palatine.wire import codec, frames
from palatine.wire.envelope import ENC_MSGPACK, Envelope
from palatine.wire.handshake import ClientHandshake, HandshakeError, rejected_reason

__all__ = [
    "ACK_TIMEOUT_ENV",
    "THREAD_NAME",
    "HeartbeatSettings",
    "HeartbeatThread",
    "lost_contact_message",
]

logger = logging.getLogger(__name__)

THREAD_NAME: Final = "palatine-heartbeat"
"""The name of the heartbeat thread (visible in stack dumps)."""

ACK_TIMEOUT_ENV: Final = "PALATINE_HEARTBEAT_ACK_TIMEOUT"
"""Variable for ``heartbeat_ack_timeout`` (20-system.md §5), read when `config.Config`
has no ``heartbeat_ack_timeout_s`` key."""

_STOP_GRACE_S: Final = 2.0  # the "+ 2" of "proc_stop_timeout + 2"
_JITTER: Final = 0.1
_RECV_BYTES: Final = 65536
_WARN_INTERVAL_S: Final = 60.0


def _fmt(value: float) -> str:
    """A configured duration as humans write it: ``10``, ``0.5``."""
    return f"{value:g}"


def lost_contact_message(addr: ChannelAddr | str, silent_s: float, limit_s: float) -> str:
    """``lost contact with system at ADDR: no heartbeat acknowledged for 10.4 s (limit 10 s); stopping``."""
    return (
        f"lost contact with system at {addr}: no heartbeat acknowledged for "
        f"{silent_s:.1f} s (limit {_fmt(limit_s)} s); stopping"
    )


@dataclass(frozen=True, slots=True)
class HeartbeatSettings:
    """The timing of one heartbeat thread, resolved once from arguments and config.

    ``interval_s`` is the mean-defining period (beats every ``interval × U[0.5, 1.0]``);
    ``ack_timeout_s`` bounds the wait for one beat's ``Ack``; ``system_loss_timeout_s``
    is how long without any acknowledged beat before the proc stops itself;
    ``proc_stop_timeout_s + 2`` is how long the owner gets to stop before the process
    exits. The rest bound the connection attempts.
    """

    interval_s: float
    ack_timeout_s: float
    system_loss_timeout_s: float
    proc_stop_timeout_s: float
    connect_timeout_s: float
    auth_timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float

    @classmethod
    def from_config(
        cls,
        *,
        interval_s: float | None = None,
        ack_timeout_s: float | None = None,
        system_loss_timeout_s: float | None = None,
        proc_stop_timeout_s: float | None = None,
        cfg: config.Config | None = None,
    ) -> HeartbeatSettings:
        """Explicit arguments, else configuration, else the defaults of 20-system.md §5.

        * ``interval``: ``supervision_update_interval`` (2 s).
        * ``ack timeout``: ``PALATINE_HEARTBEAT_ACK_TIMEOUT``, else ``min(10, interval)``.
        * ``system loss timeout``: the configured value when ``PALATINE_SYSTEM_LOSS_TIMEOUT``
          is set or the config was changed from its default, else ``5 × interval``.
        * ``proc stop timeout``: ``proc_stop_timeout`` (5 s).

        Raises `ValueError` for a duration that is not > 0 (an interval of 0 means "no
        heartbeat thread": the owner does not create one).
        """
        c = config.get() if cfg is None else cfg
        interval = c.supervision_update_interval_s if interval_s is None else interval_s
        if ack_timeout_s is None:
            configured = c.heartbeat_ack_timeout_s
            ack_timeout_s = min(10.0, interval) if configured is None else float(configured)
        if system_loss_timeout_s is None:
            system_loss_timeout_s = config.system_loss_timeout_s(c, interval)
        if proc_stop_timeout_s is None:
            proc_stop_timeout_s = c.proc_stop_timeout_s
        settings = cls(
            interval_s=float(interval),
            ack_timeout_s=float(ack_timeout_s),
            system_loss_timeout_s=float(system_loss_timeout_s),
            proc_stop_timeout_s=float(proc_stop_timeout_s),
            connect_timeout_s=c.connect_timeout_s,
            auth_timeout_s=c.auth_timeout_s,
            backoff_initial_s=c.reconnect_backoff_initial_s,
            backoff_max_s=c.reconnect_backoff_max_s,
        )
        for name in ("interval_s", "ack_timeout_s", "system_loss_timeout_s"):
            value = getattr(settings, name)
            if not value > 0:
                raise ValueError(f"heartbeat {name} must be > 0, got {value!r}")
        if settings.proc_stop_timeout_s < 0:
            raise ValueError(
                f"heartbeat proc_stop_timeout_s must be >= 0, got {settings.proc_stop_timeout_s!r}"
            )
        return settings


class _Stopped(Exception):
    """`HeartbeatThread.stop` was called: unwind the thread at once."""


class _LinkLost(Exception):
    """The connection failed or ended; ``reason`` says why, ``fatal`` if retrying is futile."""

    def __init__(self, reason: str, *, fatal: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    return text if text else type(exc).__name__


class _Link:
    """One authenticated connection: its socket, frame parser and session counters."""

    __slots__ = ("acked", "ever_acked", "next_seq", "parser", "session_id", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = frames.FrameParser(frames.PREAUTH_MAX_FRAME_BYTES)
        self.session_id = secrets.randbits(64)
        self.next_seq = 0  # the seq of the next beat on this session
        self.acked = -1  # highest seq acknowledged
        self.ever_acked = False

    def buffered(self) -> bool:
        """True when TLS has decrypted bytes that a select would not report."""
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class HeartbeatThread:
    """Sends a proc's heartbeats to the system from a daemon thread (20-system.md §2.3).

    ``make_update`` builds the beat (a `SupervisionUpdate`, treated as an opaque typed
    message): it is called on the heartbeat thread, so it must copy shared state
    (``failed_actors``, ``loop_lag``) under its own lock. ``sender`` is the proc agent,
    so the system learns which proc this connection belongs to. ``on_system_lost`` is
    called once, on the heartbeat thread, when the system is declared lost; the owner
    must then stop the proc and call `stop` when done.

    On ``local:`` addresses pass ``post_via_loop`` instead; it is called once per beat.
    """

    def __init__(
        self,
        system_addr: ChannelAddr | str,
        *,
        sender: ActorId,
        make_update: Callable[[], codec.Message] | None = None,
        on_system_lost: Callable[[], None] | None = None,
        post_via_loop: Callable[[], None] | None = None,
        exit_process: bool = False,
        interval_s: float | None = None,
        ack_timeout_s: float | None = None,
        system_loss_timeout_s: float | None = None,
        proc_stop_timeout_s: float | None = None,
        system_actor: ActorId = SYSTEM_ACTOR,
        token: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Resolve settings, the token and (for ``tls:``) the client context; start nothing.

        Raises `ValueError` for a missing ``make_update`` (net) or ``post_via_loop``
        (local), or a bad duration; `ConfigError` for an unusable token or TLS files.
        """
        self.addr = parse(system_addr)
        if self.addr.is_any:
            raise ValueError(f"cannot send heartbeats to {self.addr}: it is not a dialable address")
        self.settings = HeartbeatSettings.from_config(
            interval_s=interval_s,
            ack_timeout_s=ack_timeout_s,
            system_loss_timeout_s=system_loss_timeout_s,
            proc_stop_timeout_s=proc_stop_timeout_s,
        )
        self._local = self.addr.transport == "local"
        if self._local and post_via_loop is None:
            raise ValueError(f"heartbeats to {self.addr} need post_via_loop (local transport)")
        if not self._local and make_update is None:
            raise ValueError(f"heartbeats to {self.addr} need make_update")
        self.sender = sender
        self._system_actor = system_actor
        self._make_update = make_update
        self._on_system_lost = on_system_lost
        self._post_via_loop = post_via_loop
        self._exit_process = exit_process
        self._token = b""
        self._ssl: ssl.SSLContext | None = None
        if not self._local:
            if token is None:
                from palatine.channel.token import resolve_token

                token = resolve_token()
            self._token = token
            if self.addr.transport == "tls":
                if ssl_context is None:
                    from palatine.channel.tls import client_context

                    ssl_context = client_context()
                self._ssl = ssl_context
        self._max_frame = config.get().max_frame_bytes
        self._rng = random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_lock = threading.Lock()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._link: _Link | None = None
        self._update_failed = False
        self._warned: dict[str, float] = {}
        self.last_ok = time.monotonic()
        """Monotonic time of the last acknowledged beat (or of `start`)."""
        self.acked_beats = 0
        """Beats acknowledged so far (local: beats posted)."""
        self.connects = 0
        """Connections that completed the handshake."""
        self.last_error: str | None = None
        """Why the last connection attempt or connection failed, if one did."""
        self.lost_reason: str | None = None
        """The loss message, once the system has been declared lost."""

    # -- public API ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether an authenticated connection to the system is open now."""
        return self._link is not None

    @property
    def lost(self) -> bool:
        """Whether the system has been declared lost."""
        return self.lost_reason is not None

    def is_alive(self) -> bool:
        """Whether the thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread; ``last_ok`` counts from now (call it once ``Joined``)."""
        if self._thread is not None:
            raise RuntimeError("heartbeat thread already started")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread (and, after a system loss, report that the proc stopped).

        Interrupts any wait at once and joins for at most ``timeout_s``; returns whether
        the thread has ended. Safe to call more than once, before `start`, or from the
        heartbeat thread itself (e.g. from ``on_system_lost``), where it does not join.
        """
        self._stop.set()
        with self._wake_lock:
            if self._wake_w is not None:
                try:
                    self._wake_w.send(b"x")
                except OSError:
                    pass  # full (already woken) or closing: either way the thread wakes
        thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False
        thread.join(timeout_s)
        return not thread.is_alive()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        self._selector = selector
        assert self._wake_r is not None
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            self._main()
        except _Stopped:
            pass
        except Exception:
            logger.exception("heartbeat thread to %s failed", self.addr)
        finally:
            self._drop_link()
            selector.close()
            with self._wake_lock:
                for s in (self._wake_r, self._wake_w):
                    if s is not None:
                        s.close()
                self._wake_r = self._wake_w = None

    def _period(self) -> float:
        return self.settings.interval_s * self._rng.uniform(0.5, 1.0)

    def _main(self) -> None:
        s = self.settings
        backoff = s.backoff_initial_s
        next_connect = time.monotonic()
        next_beat = next_connect + self._period()
        while not self._stop.is_set():
            now = time.monotonic()
            if now - self.last_ok > s.system_loss_timeout_s:
                self._declare_lost(now)
                return
            # A hair past the limit, so waking at the deadline finds it exceeded.
            loss_at = self.last_ok + s.system_loss_timeout_s + 1e-3
            if self._local:
                if now >= next_beat:
                    self._post_local()
                    next_beat = time.monotonic() + self._period()
                else:
                    self._wait(None, 0, min(next_beat, loss_at))
                continue
            link = self._link
            if link is None:
                if now < next_connect:
                    self._wait(None, 0, min(next_connect, loss_at))
                    continue
                try:
                    self._link = self._connect(loss_at)
                except _LinkLost as exc:
                    self._connect_failed(exc)
                    delay = backoff * self._rng.uniform(1 - _JITTER, 1 + _JITTER)
                    backoff = min(backoff * 2, s.backoff_max_s)
                    next_connect = time.monotonic() + delay
                    continue
                self.connects += 1
                next_beat = time.monotonic()  # tell the system at once that we are here
                continue
            try:
                if now >= next_beat:
                    next_beat = now + self._period()
                    self._beat(link, min(now + s.ack_timeout_s, loss_at))
                else:
                    self._receive(link, min(next_beat, loss_at))
            except _LinkLost as exc:
                self._drop_link()
                self.last_error = exc.reason
                if link.ever_acked and not exc.fatal:
                    logger.info(
                        "heartbeat connection to system at %s lost (%s); reconnecting",
                        self.addr,
                        exc.reason,
                    )
                    backoff = s.backoff_initial_s
                    next_connect = time.monotonic()
                else:
                    self._connect_failed(exc)
                    delay = backoff * self._rng.uniform(1 - _JITTER, 1 + _JITTER)
                    backoff = min(backoff * 2, s.backoff_max_s)
                    next_connect = time.monotonic() + delay

    def _connect_failed(self, exc: _LinkLost) -> None:
        self.last_error = exc.reason
        if exc.fatal:
            self._warn(f"heartbeat connection to system at {self.addr} refused: {exc.reason}")
        else:
            logger.debug("heartbeat connection to system at %s failed: %s", self.addr, exc.reason)

    def _warn(self, text: str) -> None:
        """One WARNING per distinct text per minute; repeats go to DEBUG."""
        now = time.monotonic()
        last = self._warned.get(text)
        if last is not None and now - last < _WARN_INTERVAL_S:
            logger.debug("%s", text)
            return
        self._warned[text] = now
        logger.warning("%s", text)

    # -- system loss -------------------------------------------------------------------------

    def _declare_lost(self, now: float) -> None:
        s = self.settings
        message = lost_contact_message(self.addr, now - self.last_ok, s.system_loss_timeout_s)
        logger.error("%s", message)
        if self.last_error:
            logger.info("last heartbeat error for system at %s: %s", self.addr, self.last_error)
        self.lost_reason = message
        self._drop_link()
        callback = self._on_system_lost
        if callback is not None:
            try:
                callback()
            except Exception:
                logger.exception("on_system_lost callback of the heartbeat thread failed")
        grace = s.proc_stop_timeout_s + _STOP_GRACE_S
        if self._stop.wait(grace):
            return
        if self._exit_process:
            logger.critical(
                "proc did not stop within %s s of losing the system at %s; exiting with status 1",
                _fmt(grace),
                self.addr,
            )
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(OSError, ValueError):
                    handler.flush()
            os._exit(1)
        logger.error(
            "proc did not stop within %s s of losing the system at %s", _fmt(grace), self.addr
        )

    # -- local transport ---------------------------------------------------------------------

    def _post_local(self) -> None:
        assert self._post_via_loop is not None
        try:
            self._post_via_loop()
        except Exception as exc:  # noqa: BLE001 - the owner's callable; reported, retried
            self.last_error = _describe(exc)
            self._warn(f"heartbeat to system at {self.addr} could not be posted: {self.last_error}")
            return
        self.last_ok = time.monotonic()
        self.acked_beats += 1

    # -- waiting -------------------------------------------------------------------------------

    def _wait(self, sock: socket.socket | None, events: int, deadline: float) -> bool:
        """Wait until ``sock`` is ready for ``events``; False once ``deadline`` passes.

        With ``sock=None`` it only sleeps until the deadline. Raises `_Stopped` when
        `stop` is called, whatever it was waiting for.
        """
        selector = self._selector
        assert selector is not None
        if sock is not None:
            selector.register(sock, events)
        try:
            while True:
                if self._stop.is_set():
                    raise _Stopped
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return False
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        raise _Stopped
                    if sock is not None:
                        return True
        finally:
            if sock is not None:
                selector.unregister(sock)

    # -- connecting ----------------------------------------------------------------------------

    def _connect(self, limit: float) -> _Link:
        """Dial (``connect_timeout``), authenticate (``auth_timeout``) and open a fresh
        session; nothing waits past ``limit`` (when the system would be declared lost)."""
        s = self.settings
        sock = self._dial(min(time.monotonic() + s.connect_timeout_s, limit))
        link = _Link(sock)
        try:
            self._handshake(link, min(time.monotonic() + s.auth_timeout_s, limit))
        except BaseException:
            link.close()
            raise
        return link

    def _dial(self, deadline: float) -> socket.socket:
        addr = self.addr
        if addr.transport == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = addr.sockaddr()
        else:
            try:
                infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as exc:
                raise _LinkLost(f"cannot resolve {addr.host}: {_describe(exc)}") from None
            family, kind, proto, _, target = infos[0]
            sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            err = sock.connect_ex(target)
            if err == errno.EAGAIN and addr.transport == "unix":
                # A unix connect never completes later: the listen backlog is full.
                raise _LinkLost("the system's listen backlog is full")
            if err in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
                if not self._wait(sock, selectors.EVENT_WRITE, deadline):
                    raise _LinkLost(
                        f"connect timeout: no connection within {_fmt(self.settings.connect_timeout_s)} s"
                    )
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise _LinkLost(os.strerror(err))
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._tls_handshake(sock, deadline)
        except BaseException:
            sock.close()
            raise
        return sock

    def _tls_handshake(self, raw: socket.socket, deadline: float) -> socket.socket:
        assert self._ssl is not None
        try:
            sock = self._ssl.wrap_socket(
                raw, server_hostname=self.addr.host, do_handshake_on_connect=False
            )
        except (OSError, ValueError) as exc:
            raise _LinkLost(f"tls: {_describe(exc)}") from None
        while True:
            try:
                sock.do_handshake()
                return sock
            except ssl.SSLWantReadError:
                ready = self._wait(sock, selectors.EVENT_READ, deadline)
            except ssl.SSLWantWriteError:
                ready = self._wait(sock, selectors.EVENT_WRITE, deadline)
            except ssl.SSLCertVerificationError as exc:
                raise _LinkLost(
                    f"tls: {exc.verify_message or _describe(exc)}", fatal=True
                ) from None
            except (OSError, ValueError) as exc:
                raise _LinkLost(f"tls: {_describe(exc)}") from None
            if not ready:
                raise _LinkLost("tls handshake timeout")

    def _handshake(self, link: _Link, deadline: float) -> None:
        """The client side of §2.5, then ``Init`` for a brand-new session at seq 0."""
        hs = ClientHandshake(self._token)
        while not hs.done:
            got = self._read(link, deadline)
            if not got:
                raise _LinkLost(
                    f"handshake timeout: not authenticated within {_fmt(self.settings.auth_timeout_s)} s"
                )
            for frame in got:
                try:
                    reply = hs.receive(frame)
                except HandshakeError as exc:
                    raise _LinkLost(exc.reason, fatal=exc.fatal) from None
                if reply is not None:
                    self._send(link, frames.encode_frame(reply), deadline)
                if hs.done:
                    break
        link.parser.limit = self._max_frame
        self._send(link, frames.encode_frame(frames.Init(link.session_id, 0)), deadline)

    # -- I/O -----------------------------------------------------------------------------------

    def _send(self, link: _Link, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        sock = link.sock
        while view:
            try:
                n = sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                if not self._wait(sock, selectors.EVENT_WRITE, deadline):
                    raise _LinkLost("send timeout: the system is not reading") from None
                continue
            except ssl.SSLWantReadError:
                if not self._wait(sock, selectors.EVENT_READ, deadline):
                    raise _LinkLost("send timeout: the system is not reading") from None
                continue
            except OSError as exc:
                raise _LinkLost(_describe(exc)) from None
            view = view[n:]

    def _read(self, link: _Link, deadline: float) -> list[frames.Frame]:
        """The frames that arrive before ``deadline`` ([] if none).

        Raises `_LinkLost` on EOF, a socket error or a malformed frame.
        """
        sock = link.sock
        while True:
            if not link.buffered() and not self._wait(sock, selectors.EVENT_READ, deadline):
                return []
            try:
                data = sock.recv(_RECV_BYTES)
            except (BlockingIOError, ssl.SSLWantReadError):
                continue
            except ssl.SSLWantWriteError:
                self._wait(sock, selectors.EVENT_WRITE, deadline)
                continue
            except OSError as exc:
                raise _LinkLost(_describe(exc)) from None
            if not data:
                if link.parser.at_boundary:
                    raise _LinkLost("connection closed by the system")
                raise _LinkLost("connection closed by the system inside a frame")
            try:
                got = link.parser.feed(data)
            except frames.FrameError as exc:
                raise _LinkLost(f"protocol error: {exc.reason}") from None
            if got:
                return got

    def _drop_link(self) -> None:
        link = self._link
        self._link = None
        if link is not None:
            link.close()

    # -- beats ---------------------------------------------------------------------------------

    def _envelope(self) -> Envelope | None:
        assert self._make_update is not None
        try:
            msg = self._make_update()
            data = codec.encode_message(msg)
            type_id = type(msg).__palatine_type_id__
        except Exception:
            if not self._update_failed:
                self._update_failed = True
                logger.exception("cannot build a heartbeat for the system at %s", self.addr)
            return None
        self._update_failed = False
        return Envelope(
            sender=self.sender,
            dest=self._system_actor.port(type_id),
            type_id=type_id,
            encoding=ENC_MSGPACK,
            data=data,
        )

    def _beat(self, link: _Link, deadline: float) -> None:
        """Send one beat and wait for its ``Ack`` until ``deadline``.

        A missing ack is not a connection failure: acks are cumulative, so a late one
        (handled by `_receive` between beats) still refreshes ``last_ok``.
        """
        env = self._envelope()
        if env is None:
            return
        seq = link.next_seq
        head, bufs, _ = frames.encode_message(seq, True, env)
        link.next_seq = seq + 1
        self._send(link, frames.join_message(head, bufs), deadline)
        while link.acked < seq:
            got = self._read(link, deadline)
            if not got:
                logger.debug(
                    "heartbeat %d to system at %s not acknowledged within %s s",
                    seq,
                    self.addr,
                    _fmt(self.settings.ack_timeout_s),
                )
                return
            self._on_frames(link, got)

    def _receive(self, link: _Link, deadline: float) -> None:
        """Between beats: take late acks, and notice EOF (raises `_LinkLost`) at once."""
        got = self._read(link, deadline)
        if got:
            self._on_frames(link, got)

    def _on_frames(self, link: _Link, got: list[frames.Frame]) -> None:
        for frame in got:
            if type(frame) is frames.Ack:
                seq = frame.seq
                if seq >= link.next_seq:
                    raise _LinkLost(
                        f"protocol error: ack {seq} beyond the last seq sent ({link.next_seq - 1})"
                    )
                if seq > link.acked:
                    self.acked_beats += seq - link.acked
                    link.acked = seq
                    link.ever_acked = True
                    self.last_ok = time.monotonic()
            elif type(frame) is frames.Reject:
                raise _LinkLost(rejected_reason(frame.reason), fatal=True)
            else:
                raise _LinkLost(f"protocol error: unexpected {type(frame).__name__} frame")
