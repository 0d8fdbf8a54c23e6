"""The heartbeat thread of a managed proc.

Every managed proc proves it is alive with a `SupervisionUpdate` to the system actor
every ``interval × U[0.5, 1.0]`` seconds. The beats come from a daemon thread,
``palatine-heartbeat``, with its **own connection** to the system address, never from
the event loop: a long handler or a busy loop must not look like a dead proc. Only a C
call that holds the GIL (or SIGSTOP) silences it.

The connection speaks the channel protocol through the sans-IO
halves in `palatine.wire.frames` and `palatine.wire.handshake`: token handshake, then
``Init{session_id, next_seq=0}`` with a fresh random session per connection, then one
``Message{seq, ack_now=True, envelope}`` per beat. Beats are idempotent, so nothing is
ever retransmitted: a beat lost with its connection is simply superseded by the next.
Acks are cumulative, so a late ``Ack`` still proves the system is alive now. A beat is
also sent right after each (re)connection, so a restarted system hears from the proc at
once instead of up to one period later.

Between beats the thread watches the socket, so a closed connection (the system died
or restarted) is noticed at once and re-dialed with backoff. The system, in turn, sees
this persistent connection close when the proc dies (its "connection lost" signal).

When no beat has been acknowledged for ``system_loss_timeout`` the thread logs
``lost contact with system at ADDR: no heartbeat acknowledged for 10.4 s (limit 10 s);
stopping``, calls ``on_system_lost()`` (the owner stops the proc), and waits
``proc_stop_timeout + 2`` s for the owner to call `HeartbeatThread.stop`; if it does
not and ``exit_process`` is set (the process's main proc), it ends the process with
status 1, since the owner's loop is evidently blocked.

The connection is a `palatine.fastpath.blocking.BlockingConn`: non-blocking sockets
whose every wait goes through one selector that also watches a wake-up socket, so each
wait is bounded by a deadline and `stop` interrupts any of them (connect, TLS handshake,
token handshake, waiting for an ack). From the event loop's point of view the
connection is still "blocking": the thread owns it and no loop is involved.

Each beat also carries what the proc uses of its machine (``resources``: CPU, RSS and,
with NVML, its GPU), read on this thread at most once a second
(`palatine.hosting.resources`), so that ``palatine top`` shows every host's procs, and
the counters, gauges and histograms its code published (`palatine.hosting.user_metrics`,
in ``counters``), which the system serves on its metrics endpoint.

On local transport (``local:N``) there is nothing to dial: the owner supplies
``post_via_loop``, which the thread calls once per beat (it typically schedules the
beat on the loop with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from palatine import config
from palatine.channel.addr import ChannelAddr, require_addr
from palatine.config import format_seconds
from palatine.errors import error_text
from palatine.fastpath.blocking import BlockingConn, LinkLost, Stopped, Waiter
from palatine.hosting import user_metrics
from palatine.hosting.resources import ResourceSampler
from palatine.ids import SYSTEM_ACTOR, ActorId
from palatine.protocol.supervision import ProcSupervisionState
from palatine.wire import codec, frames
from palatine.wire.envelope import ENC_MSGPACK, Envelope
from palatine.wire.handshake import rejected_reason

__all__ = [
    "THREAD_NAME",
    "HeartbeatSettings",
    "HeartbeatThread",
    "lost_contact_message",
]

logger = logging.getLogger(__name__)

THREAD_NAME: Final = "palatine-heartbeat"
"""The name of the heartbeat thread (visible in stack dumps)."""


_STOP_GRACE_S: Final = 2.0  # the "+ 2" of "proc_stop_timeout + 2"
_JITTER: Final = 0.1
_WARN_INTERVAL_S: Final = 60.0


def _notify(callback: Callable[[], None] | None, name: str) -> None:
    """Call an owner's callback from the heartbeat thread; a failure is logged, never raised."""
    if callback is not None:
        try:
            callback()
        except Exception:
            logger.exception("%s callback of the heartbeat thread failed", name)


def lost_contact_message(addr: ChannelAddr, silent_s: float, limit_s: float) -> str:
    """``lost contact with system at ADDR: no heartbeat acknowledged for 10.4 s (limit 10 s); stopping``."""
    return (
        f"lost contact with system at {addr}: no heartbeat acknowledged for "
        f"{silent_s:.1f} s (limit {format_seconds(limit_s)} s); stopping"
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
        """Explicit arguments, else configuration, else the defaults

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


class HeartbeatThread:
    """Sends a proc's heartbeats to the system from a daemon thread.

    ``make_update`` builds the beat (a `SupervisionUpdate`, treated as an opaque typed
    message): it is called on the heartbeat thread, so it must copy shared state
    (``failed_actors``, ``loop_lag``) under its own lock. ``sender`` is the proc agent,
    so the system learns which proc this connection belongs to. ``on_system_lost`` is
    called once, on the heartbeat thread, when the system is declared lost; the owner
    must then stop the proc and call `stop` when done. ``on_reconnected`` is called on
    the heartbeat thread after each connection but the first: the system may have
    restarted, and the owner rejoins it. With ``keep_dialing`` (a detached client, which
    the system does not supervise), a loss is reported (``on_system_lost``, once per
    loss) and the thread goes on dialing instead of ending.

    On ``local:`` addresses pass ``post_via_loop`` instead; it is called once per beat.
    """

    def __init__(
        self,
        system_addr: ChannelAddr,
        *,
        sender: ActorId,
        make_update: Callable[[], codec.Message] | None = None,
        on_system_lost: Callable[[], None] | None = None,
        on_reconnected: Callable[[], None] | None = None,
        post_via_loop: Callable[[], None] | None = None,
        exit_process: bool = False,
        keep_dialing: bool = False,
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
        (local), or a bad duration; `ConfigError` for an unusable token or TLS files;
        `TypeError` for a ``system_addr`` that is not a `ChannelAddr` (text: parse it).
        """
        require_addr(system_addr, "HeartbeatThread")
        self.addr = system_addr
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
        self._resources = ResourceSampler()  # (what each beat says the proc uses)
        self._on_system_lost = on_system_lost
        self._on_reconnected = on_reconnected
        self._keep_dialing = keep_dialing
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
        self._waiter: Waiter | None = None
        self._link: BlockingConn | None = None
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
        assert self._wake_r is not None
        waiter = Waiter(self._stop, self._wake_r)
        self._waiter = waiter
        try:
            self._main()
        except Stopped:
            pass
        except Exception:
            logger.exception("heartbeat thread to %s failed", self.addr)
        finally:
            self._drop_link()
            waiter.close()
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
                if not self._keep_dialing:
                    self._declare_lost(now)
                    return
                self._lost_but_dialing(now)
            # A hair past the limit, so waking at the deadline finds it exceeded.
            loss_at = self.last_ok + s.system_loss_timeout_s + 1e-3
            if self._local:
                if now >= next_beat:
                    self._post_local()
                    next_beat = time.monotonic() + self._period()
                else:
                    self._sleep(min(next_beat, loss_at))
                continue
            link = self._link
            if link is None:
                if now < next_connect:
                    self._sleep(min(next_connect, loss_at))
                    continue
                try:
                    self._link = self._connect(loss_at)
                except LinkLost as exc:
                    self._connect_failed(exc)
                    delay = backoff * self._rng.uniform(1 - _JITTER, 1 + _JITTER)
                    backoff = min(backoff * 2, s.backoff_max_s)
                    next_connect = time.monotonic() + delay
                    continue
                self.connects += 1
                next_beat = time.monotonic()  # tell the system at once that we are here
                if self.connects > 1:
                    _notify(self._on_reconnected, "on_reconnected")
                continue
            try:
                if now >= next_beat:
                    next_beat = now + self._period()
                    self._beat(link, min(now + s.ack_timeout_s, loss_at))
                else:
                    self._receive(link, min(next_beat, loss_at))
            except LinkLost as exc:
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

    def _connect_failed(self, exc: LinkLost) -> None:
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

    def _lost_but_dialing(self, now: float) -> None:
        """``keep_dialing``: say so (once per loss) and go on dialing; a system that
        comes back (restarted) is rejoined as after any new connection."""
        if self.lost_reason is None:
            message = lost_contact_message(
                self.addr, now - self.last_ok, self.settings.system_loss_timeout_s
            )
            self.lost_reason = message.removesuffix("; stopping") + "; still dialing"
            logger.warning("%s", self.lost_reason)
            _notify(self._on_system_lost, "on_system_lost")
        self.last_ok = now  # (the next report, if any, a whole timeout later)

    def _declare_lost(self, now: float) -> None:
        s = self.settings
        message = lost_contact_message(self.addr, now - self.last_ok, s.system_loss_timeout_s)
        logger.error("%s", message)
        if self.last_error:
            logger.info("last heartbeat error for system at %s: %s", self.addr, self.last_error)
        self.lost_reason = message
        self._drop_link()
        _notify(self._on_system_lost, "on_system_lost")
        grace = s.proc_stop_timeout_s + _STOP_GRACE_S
        if self._stop.wait(None if math.isinf(grace) else grace):  # (inf: no bound)
            return
        if self._exit_process:
            logger.critical(
                "proc did not stop within %s s of losing the system at %s; exiting with status 1",
                format_seconds(grace),
                self.addr,
            )
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(OSError, ValueError):
                    handler.flush()
            os._exit(1)
        logger.error(
            "proc did not stop within %s s of losing the system at %s",
            format_seconds(grace),
            self.addr,
        )

    # -- local transport ---------------------------------------------------------------------

    def _post_local(self) -> None:
        assert self._post_via_loop is not None
        try:
            self._post_via_loop()
        except Exception as exc:  # noqa: BLE001 - the owner's callable; reported, retried
            self.last_error = error_text(exc)
            self._warn(f"heartbeat to system at {self.addr} could not be posted: {self.last_error}")
            return
        self.last_ok = time.monotonic()
        self.acked_beats += 1

    # -- waiting and connecting ----------------------------------------------------------------

    def _sleep(self, deadline: float) -> None:
        """Sleep until ``deadline``; raises `Stopped` as soon as `stop` is called."""
        assert self._waiter is not None
        self._waiter.wait(None, 0, deadline)

    def _connect(self, limit: float) -> BlockingConn:
        """Dial (``connect_timeout``), authenticate (``auth_timeout``) and open a fresh
        session; nothing waits past ``limit`` (when the system would be declared lost)."""
        assert self._waiter is not None
        s = self.settings
        return BlockingConn.connect(
            self.addr,
            self._waiter,
            token=self._token,
            ssl_context=self._ssl,
            max_frame_bytes=self._max_frame,
            connect_timeout_s=s.connect_timeout_s,
            auth_timeout_s=s.auth_timeout_s,
            limit=limit,
        )

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
            state = getattr(msg, "state", None)
            if isinstance(state, ProcSupervisionState):  # (read here: off the proc's loop)
                state.resources = self._resources.sample()
                state.counters.update(user_metrics.report())
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

    def _beat(self, link: BlockingConn, deadline: float) -> None:
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
        link.send(frames.join_message(head, bufs), deadline)
        while link.acked < seq:
            got = link.read(deadline)
            if not got:
                logger.debug(
                    "heartbeat %d to system at %s not acknowledged within %s s",
                    seq,
                    self.addr,
                    format_seconds(self.settings.ack_timeout_s),
                )
                return
            self._on_frames(link, got)

    def _receive(self, link: BlockingConn, deadline: float) -> None:
        """Between beats: take late acks, and notice EOF (raises `LinkLost`) at once."""
        got = link.read(deadline)
        if got:
            self._on_frames(link, got)

    def _on_frames(self, link: BlockingConn, got: list[frames.Frame]) -> None:
        for frame in got:
            if type(frame) is frames.Ack:
                seq = frame.seq
                if seq >= link.next_seq:
                    raise LinkLost(
                        f"protocol error: ack {seq} beyond the last seq sent ({link.next_seq - 1})"
                    )
                if seq > link.acked:
                    self.acked_beats += seq - link.acked
                    link.acked = seq
                    link.ever_acked = True
                    self.last_ok = time.monotonic()
                    if self.lost_reason is not None and self._keep_dialing:
                        self.lost_reason = None
                        logger.info("heartbeats to system at %s acknowledged again", self.addr)
            elif type(frame) is frames.Reject:
                raise LinkLost(rejected_reason(frame.reason), fatal=True)
            else:
                raise LinkLost(f"protocol error: unexpected {type(frame).__name__} frame")
