"""The pipes of `palatine serve`: request lines read and response lines written through
the loop, so a launcher that is slow to read or write never blocks it (nor the role it
runs). Reading ahead is bounded, and no request is read while too many responses wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
from collections.abc import Callable

__all__ = ["MAX_LINE_BYTES", "TOO_LONG", "Lines", "OnReady", "Responses"]

log = logging.getLogger("palatine.cli.serving")

MAX_LINE_BYTES = 1 << 20
TOO_LONG = b"<a line over MAX_LINE_BYTES>"  # queued for such a line (told apart by identity)
_READ_AHEAD_LINES = 256  # request lines read ahead of the server at most
_RESPONSES_HIGH = 1 << 20  # response bytes waiting to be read before requests wait too

OnReady = Callable[[str, str], None]
"""``on_ready(role, addr)``: the role can serve (print the ready line)."""


class Lines:
    """Lines read from a non-blocking fd through the loop; ``None`` at EOF.

    A pipe or socket is read when the loop says it is readable; a regular file (or
    ``/dev/null``), which cannot be polled and never blocks, is read a chunk per loop turn.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._buf = bytearray()
        self._skipping = False
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._paused = False
        self._was_blocking = os.get_blocking(fd)
        os.set_blocking(fd, False)
        try:
            self._loop.add_reader(fd, self._readable)
            self._polled = True
        except PermissionError:  # not pollable: a regular file
            self._polled = False
            self._loop.call_soon(self._read_turn)

    def restore(self) -> None:
        """Give the fd back as it was (blocking or not): it may be shared."""
        try:
            os.set_blocking(self.fd, self._was_blocking)
        except OSError:
            pass

    def get(self) -> asyncio.Future[bytes | None]:
        """The next line (``None`` at EOF), as a future; reading resumes once the lines
        read ahead are taken (at most `_READ_AHEAD_LINES` wait)."""
        if self._paused and not self._closed and self.queue.qsize() <= _READ_AHEAD_LINES // 2:
            self._paused = False
            if self._polled:
                self._loop.add_reader(self.fd, self._readable)
            else:
                self._loop.call_soon(self._read_turn)
        return asyncio.ensure_future(self.queue.get())

    def _pause_if_ahead(self) -> None:
        if not self._closed and not self._paused and self.queue.qsize() >= _READ_AHEAD_LINES:
            self._paused = True
            if self._polled:
                self._loop.remove_reader(self.fd)

    def _read_turn(self) -> None:
        if not self._closed and not self._paused:
            self._readable()
            if not self._closed and not self._paused:
                self._loop.call_soon(self._read_turn)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError as e:
            log.warning("reading requests: %s", e)
            data = b""
        if not data:
            self.close()
            if self._buf.strip() and not self._skipping:
                self.queue.put_nowait(bytes(self._buf))
            self._buf.clear()
            self.queue.put_nowait(None)
            return
        if self._skipping:  # the rest of a line over the limit: dropped as it comes
            i = data.find(b"\n")
            if i < 0:
                return
            self._skipping = False
            data = data[i + 1 :]
        self._buf += data
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                break
            line = bytes(self._buf[:i])
            del self._buf[: i + 1]
            self.queue.put_nowait(line if len(line) <= MAX_LINE_BYTES else TOO_LONG)
        if len(self._buf) > MAX_LINE_BYTES and not self._skipping:
            self._buf.clear()
            self._skipping = True
            self.queue.put_nowait(TOO_LONG)
        self._pause_if_ahead()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._polled and not self._paused:
                self._loop.remove_reader(self.fd)


def _same_file(fd: int, other: int) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.fstat(other))
    except OSError:
        return False


class Responses:
    """Response lines written to a non-blocking fd through the loop: a launcher that is
    slow to read never blocks the loop (nor the role it runs). While more than
    `_RESPONSES_HIGH` bytes wait, `backlogged` holds and the server reads no requests."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._polled = False
        self._broken = False
        self.drained = asyncio.Event()
        self.drained.set()
        # Shared with this process's stderr (logging), the fd stays blocking: a full pipe
        # then blocks the loop, as a full stderr would anyway. Shared with stdout, the ready
        # lines go through here too (`ordered_ready`), so lines never interleave.
        self.shares_stdout = _same_file(fd, 1)
        self._was_blocking = os.get_blocking(fd)
        if not _same_file(fd, 2):
            try:
                os.set_blocking(fd, False)
            except OSError as e:
                log.warning("responses: %s", e)

    @property
    def backlogged(self) -> bool:
        return len(self._buf) > _RESPONSES_HIGH

    def write(self, data: bytes) -> None:
        if self._broken:
            log.warning(
                "response not written (the response fd is broken): %s",
                data.decode(errors="replace").strip(),
            )
            return
        self._buf += data
        self._flush()

    def _flush(self) -> None:
        buf = self._buf
        while buf:
            try:
                n = os.write(self.fd, buf)
            except BlockingIOError:
                break
            except OSError as e:
                log.warning("cannot write the responses: %s", e)
                self._broken = True
                buf.clear()
                break
            del buf[:n]
        if buf:
            self.drained.clear()
            if not self._polled:
                self._loop.add_writer(self.fd, self._flush)
                self._polled = True
        else:
            if self._polled:
                self._loop.remove_writer(self.fd)
                self._polled = False
            self.drained.set()

    async def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for what is queued to be written, then stop."""
        if self._buf:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.drained.wait()
            except TimeoutError:
                log.warning(
                    "%d bytes of responses not read within %g s: dropped", len(self._buf), timeout_s
                )
        if self._polled:
            self._loop.remove_writer(self.fd)
            self._polled = False
        try:
            os.set_blocking(self.fd, self._was_blocking)  # (it may be shared)
        except OSError:
            pass

    def ordered_ready(self, on_ready: OnReady) -> OnReady:
        """``on_ready`` for a server whose responses go to its stdout: what it prints is
        queued behind the responses already written, never into the middle of one."""
        if not self.shares_stdout:
            return on_ready

        def ready(role: str, addr: str) -> None:
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                on_ready(role, addr)
            self.write(text.getvalue().encode())

        return ready
