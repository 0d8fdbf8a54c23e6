"""`DirectTx`: a session to one local proc that any thread writes, without the loop.

A `NetTx` belongs to its loop: a message from another thread first wakes the loop,
which then writes it. Where waking an idle CPU costs tens of microseconds (a VM that
halts idle vCPUs), that hop is the dearest part of a small message, and it sits on
the path of every result a worker stream sends and every call a client thread makes.

A DirectTx is an ordinary session on a connection of its own,
opened with `BlockingConn`. `send` encodes and writes from the calling thread, without
blocking, under one lock: messages leave in the order of the `send` calls of all
threads together. What the socket does not take at once waits in a backlog that the
loop writes out when the socket is writable; later sends queue behind it, so order
holds and no thread ever waits for the peer. The loop reads the peer's acks; a message
is held until acked, and when the connection ends every message not acked goes back to
its sender (``on_return``), as a NetTx returns what it cannot deliver. So does every
message still unacked after ``message_delivery_timeout_s`` (a peer alive but no longer
reading), which ends the session. `aclose` writes the backlog out, shuts the write side
and closes once the peer has read to the end.

Local (``unix:``) addresses only: such a connection ends only when one of the two
procs ends, so there is no reconnect and no resend.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.errors import error_text
from palatine.fastpath.blocking import BlockingConn, LinkLost
from palatine.ids import ActorId
from palatine.wire.envelope import Envelope
from palatine.wire.frames import Ack, FrameError, Reject, encode_message

__all__ = ["DirectTx", "ReturnCallback", "drop_sent", "open_direct"]

log = logging.getLogger(__name__)

ReturnCallback = Callable[[Envelope, str], None]
"""Takes back a message that was not delivered, with the reason (``broken link: …``)."""
_RECV_BYTES: Final = 65536
_IOV_MAX: Final = 512  # buffers per sendmsg call
_CLOSING: Final = "closing"  # `closed` while `aclose` waits for the peer to read to the end


class DirectTx:
    """One session to ``addr`` written by any thread (module doc)."""

    __slots__ = (
        "addr",
        "_sock",
        "_parser",
        "_loop",
        "_on_return",
        "_lock",
        "_seq",
        "_backlog",
        "_unacked",
        "_max_frame",
        "_timeout",
        "_writing",
        "_waiter",
        "_check",
        "_read_to_end",
        "_close_error",
        "closed",
    )

    def __init__(
        self,
        conn: BlockingConn,
        addr: ChannelAddr,
        loop: asyncio.AbstractEventLoop,
        on_return: ReturnCallback,
    ) -> None:
        self.addr = addr
        self._sock = conn.sock
        self._sock.setblocking(False)
        self._parser = conn.parser
        self._loop = loop
        self._on_return = on_return
        self._lock = threading.Lock()
        self._seq = conn.next_seq
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._unacked: collections.deque[tuple[int, Envelope, float]] = collections.deque()
        cfg = config.get()
        self._max_frame = cfg.max_frame_bytes
        self._timeout = cfg.message_delivery_timeout_s
        self._writing = False  # the loop watches for writability (a backlog is waiting)
        self._waiter: asyncio.Future[None] | None = None  # `aclose`: the backlog is out / EOF
        self._check: asyncio.TimerHandle | None = None
        self._read_to_end = False  # closing: the peer closed after reading everything
        self._close_error: str | None = None  # closing: why that cannot be known
        self.closed: str | None = None  # why it ended

    @classmethod
    def open(
        cls, addr: ChannelAddr, loop: asyncio.AbstractEventLoop, on_return: ReturnCallback
    ) -> DirectTx:
        """Connect and open the session (blocking: call it off the loop thread).

        Raises `LinkLost` when the proc cannot be reached within the configured connect
        and handshake timeouts. The loop starts reading acks at once.
        """
        if addr.transport != "unix":
            raise LinkLost(f"a direct session needs a unix address, not {addr}", fatal=True)
        conn = BlockingConn.connect_configured(addr)
        tx = cls(conn, addr, loop, on_return)
        loop.call_soon_threadsafe(tx._watch)
        return tx

    def __repr__(self) -> str:
        state = f"closed: {self.closed}" if self.closed is not None else f"next seq {self._seq}"
        return f"DirectTx({self.addr}, {state})"

    # -- any thread ---------------------------------------------------------------------

    def send(self, envs: Sequence[Envelope]) -> None:
        """Write ``envs`` in this order, after everything sent before (never blocks).

        A message over the frame limit, or sent after the session ended, goes back to
        its sender through ``on_return`` (on the loop).
        """
        returned: list[tuple[Envelope, str]] = []
        with self._lock:
            if self.closed is not None:
                returned = [(env, self.closed) for env in envs]
            else:
                parts: list[Any] = []
                taken: list[Envelope] = []
                seq = self._seq
                for env in envs:  # encode all before taking any seq: a failure takes none
                    # A message with buffers asks for its ack at once, as a NetTx's does:
                    # held until acked, it would keep the sender's pooled memory busy.
                    head, bufs, size = encode_message(seq, bool(env.buffers), env)
                    if size > self._max_frame:
                        returned.append(
                            (
                                env,
                                f"message of {size} bytes exceeds max frame size {self._max_frame}",
                            )
                        )
                        continue
                    seq += 1
                    taken.append(env)
                    parts.append(head)
                    parts.extend(bufs)
                if parts:
                    now = time.monotonic()
                    unacked = self._unacked
                    for i, env in enumerate(taken):
                        unacked.append((self._seq + i, env, now))
                    self._seq = seq
                    self._write(parts)
        if returned:
            self._loop.call_soon_threadsafe(self._return, returned)

    def _write(self, parts: list[Any]) -> None:
        """Write now what the socket takes; queue the rest (lock held)."""
        backlog = self._backlog
        if backlog:  # (an empty view would never be taken off the backlog)
            backlog.extend(view for view in _views(parts) if view)
            return
        try:
            if len(parts) == 1:
                n = self._sock.send(parts[0])
            else:
                n = self._sock.sendmsg(parts[:_IOV_MAX])
        except BlockingIOError:
            n = 0
        except OSError as exc:
            self._loop.call_soon_threadsafe(self._end, error_text(exc))
            return
        if n == sum(len(p) for p in parts):  # the usual case (parts are bytes or "B" views)
            return
        backlog.extend(view for view in _views(parts) if view)
        drop_sent(backlog, n)
        if backlog and not self._writing:
            self._writing = True
            self._loop.call_soon_threadsafe(self._watch_writable)

    # -- loop thread --------------------------------------------------------------------

    def _watch(self) -> None:
        if self.closed is None:
            self._loop.add_reader(self._sock.fileno(), self._on_readable)
            self._check = self._loop.call_later(min(1.0, self._timeout / 10), self._check_acks)

    def _check_acks(self) -> None:
        """End the session when the oldest message waits for its ack past the delivery
        timeout (a peer alive but not reading), as a NetTx returns it."""
        self._check = None
        if self.closed is not None:
            return
        unacked = self._unacked
        if unacked and time.monotonic() - unacked[0][2] > self._timeout:
            self._end(f"delivery timeout: no ack within {self._timeout:g} s")
            return
        self._check = self._loop.call_later(min(1.0, self._timeout / 10), self._check_acks)

    def _watch_writable(self) -> None:
        if self.closed is None:
            self._loop.add_writer(self._sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        with self._lock:
            backlog = self._backlog
            try:
                n = self._sock.sendmsg(list(itertools.islice(backlog, _IOV_MAX)))
            except BlockingIOError:
                return
            except OSError as exc:
                reason: str | None = error_text(exc)
            else:
                reason = None
                drop_sent(backlog, n)
                if backlog:
                    return
                self._writing = False
            self._loop.remove_writer(self._sock.fileno())
        if reason is not None:
            self._end(reason)
            return
        self._wake_closer()

    def _read_pending(self) -> None:
        """Read what is already there, without waiting (closing)."""
        for _ in range(64):
            if not self._on_readable():
                return

    def _closing_ends(self, error: str | None) -> None:
        """While `aclose` waits: the peer's side is done (``error``: not cleanly)."""
        self._close_error = error
        self._loop.remove_reader(self._sock.fileno())
        self._wake_closer()

    def _wake_closer(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_readable(self) -> bool:
        """Read once: acks, or the end. True if there may be more to read."""
        try:
            data = self._sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return False
        except OSError as exc:
            if self.closed == _CLOSING:  # e.g. reset: the peer may not have read it all
                self._closing_ends(error_text(exc))
            else:
                self._end(error_text(exc))
            return False
        if not data:
            if self.closed == _CLOSING:  # the peer read everything we wrote, then closed
                self._read_to_end = True
                self._closing_ends(None)
            else:
                self._end(f"connection to {self.addr} closed by the peer")
            return False
        try:
            frames = self._parser.feed(data)
        except FrameError as exc:
            self._end(f"protocol error: {exc.reason}")
            return False
        for frame in frames:
            if type(frame) is Ack:
                with self._lock:
                    unacked = self._unacked
                    while unacked and unacked[0][0] <= frame.seq:
                        unacked.popleft()
            elif type(frame) is Reject:
                why = f"the peer rejected the session: {frame.reason}"
                if self.closed == _CLOSING:
                    self._closing_ends(why)
                else:
                    self._end(why)
                return False
        return True

    def _end(self, reason: str) -> None:
        """The session is over: close, and return every message not acked."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = reason
            returned = [(env, reason) for _, env, _ in self._unacked]
            self._unacked.clear()
            self._backlog.clear()
            self._writing = False
        self._close_socket()
        self._return(returned)

    def _close_socket(self) -> None:
        if self._check is not None:
            self._check.cancel()
            self._check = None
        fd = self._sock.fileno()
        if fd >= 0:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)
        self._sock.close()
        self._wake_closer()

    def _return(self, returned: list[tuple[Envelope, str]]) -> None:
        at = str(self.addr)
        for env, reason in returned:
            env.mark_returned_at(at)
            self._on_return(env, f"broken link: {reason}")

    async def aclose(self, timeout_s: float) -> None:
        """Write out the backlog, let the peer read everything, then close (loop thread;
        ``timeout_s`` bounds it all).

        The write side is shut first and the socket closed once the peer has read to the
        end and closed its side, so nothing written is lost to the close. Messages the
        peer did not confirm (no ack, and no clean end in time) go back to their senders,
        and `LinkLost` says so.
        """
        if self.closed is not None:
            return
        loop = self._loop
        deadline = loop.time() + timeout_s
        left = 0
        try:
            if self._backlog:
                await self._wait(deadline)
            with self._lock:
                if self.closed is not None:
                    return  # ended meanwhile: `_end` returned what was held
                left = len(self._backlog)
                self.closed = _CLOSING  # later sends come back; EOF now means "all read"
                self._backlog.clear()
                self._writing = False
            if not left:
                try:
                    self._sock.shutdown(socket.SHUT_WR)
                except OSError as exc:
                    self._close_error = error_text(exc)
                else:
                    await self._wait(deadline)
        finally:
            unconfirmed, why = self._finish_close(left, timeout_s)
        if unconfirmed:
            raise LinkLost(f"closed {self.addr} with {unconfirmed} messages unconfirmed: {why}")

    def _finish_close(self, left: int, timeout_s: float) -> tuple[int, str]:
        """The end of `aclose` (also when it is cancelled): close the socket and return
        what the peer did not confirm; ``(how many, why)``."""
        if self.closed != _CLOSING:  # ended before closing began, or cancelled before it
            if self.closed is None:
                self._end("closed")
            return 0, ""
        if not self._read_to_end and self._close_error is None:
            self._read_pending()  # acks (or the end) that came in meanwhile
        with self._lock:
            unconfirmed = [] if self._read_to_end else [env for _, env, _ in self._unacked]
            self._unacked.clear()
            if self._close_error is not None:
                why = self._close_error
            elif left:
                why = f"{left} buffers unwritten after {timeout_s:g} s"
            else:
                why = f"the peer did not finish reading within {timeout_s:g} s"
            self.closed = "closed"
        self._close_socket()
        if unconfirmed:
            reason = f"closed before the peer confirmed delivery: {why}"
            self._return([(env, reason) for env in unconfirmed])
        return len(unconfirmed), why

    async def _wait(self, deadline: float) -> None:
        """Until `_wake_closer` (the backlog is out, EOF, or the end) or ``deadline``."""
        self._waiter = waiter = self._loop.create_future()
        try:
            await asyncio.wait_for(waiter, max(0.0, deadline - self._loop.time()))
        except TimeoutError:
            pass
        finally:
            self._waiter = None


def _views(parts: list[Any]) -> list[memoryview]:
    """Byte views of what a send did not take (bytes, bytearrays or views)."""
    return [memoryview(p) for p in parts]


def drop_sent(views: collections.deque[memoryview], n: int) -> None:
    """Take the ``n`` bytes a write just sent off the front of ``views``."""
    while n:
        first = views[0]
        if n >= len(first):
            n -= len(first)
            views.popleft()
        else:
            views[0] = first[n:]
            return


async def open_direct(proc: Any, dest: ActorId) -> DirectTx | None:
    """A direct session from ``proc`` (a `palatine.core.proc.Proc`, on its loop) to ``dest``'s
    proc; messages it cannot deliver go back through ``proc.return_envelope``. None (the
    loop sends instead) when lanes are off (config ``lanes``), ``dest`` is not local, or
    the session cannot be opened."""
    if not config.get().lanes:
        return None
    try:
        addr = await proc.address_of(dest)
        if addr is None or addr.transport != "unix":
            return None
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(DirectTx.open, addr, loop, proc.return_envelope)
    except Exception as e:  # noqa: BLE001 - the loop path reports an unreachable peer itself
        log.info("no direct session to %s (the loop sends instead): %s", dest.proc, e)
        return None
