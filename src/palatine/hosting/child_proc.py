"""One child process of a host as the host sees it: its record and its output pipes.

`Child` is the record `palatine.hosting.children.ChildProcs` keeps per proc (state, pid, exit,
the last output lines); `ChildExit` is how it ended; `PipeReader` reads one of its
output pipes on the host's loop and splits it into lines. No process machinery here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from palatine.hosting.forkserver import ForkedProcess

__all__ = [
    "TAIL_LINES",
    "Child",
    "ChildExit",
    "ChildState",
    "PipeReader",
    "split_proc_id",
    "write_all",
]

log = logging.getLogger(__name__)

#: Output lines kept in memory per child for its exit report.
TAIL_LINES = 50

#: A line longer than this without a newline is emitted in pieces (bounds memory).
_MAX_LINE_BYTES = 64 * 1024

_READ_CHUNK = 64 * 1024
_READS_PER_WAKEUP = 8

ChildState = Literal["running", "stopping", "exited", "failed"]


def split_proc_id(proc_id: str) -> str:
    """``W[r]`` -> ``W`` (the text itself when it has no rank)."""
    m = re.fullmatch(r"(.*)\[(\d+)\]", proc_id)
    return m.group(1) if m else proc_id


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class ChildExit(msgspec.Struct, frozen=True, kw_only=True):
    """How a child ended (or why it never started).

    ``reason`` is `describe_exit` text, or ``cannot execute 'x': …`` for a failed start
    (then both code and signal are ``None``). ``requested`` is true when the host asked
    it to stop (`ChildProcs.terminate`), which the system treats as expected.
    """

    exit_code: int | None
    exit_signal: int | None
    reason: str
    ended_at: float
    stderr_tail: list[str]
    requested: bool = False


class Child:
    """One child process of a host, from spawn to reap.

    ``state`` moves ``running`` -> (``stopping``) -> ``exited``; a program that could not
    be started is ``failed`` from the outset, with ``pid`` ``None``. ``started_at`` and
    ``exit.ended_at`` are wall-clock times (``time.time()``). ``tail`` holds the last
    lines of stdout and stderr together, in arrival order.
    """

    def __init__(
        self, proc_id: str, argv: list[str], log_path: Path | None, tail_lines: int
    ) -> None:
        self.proc_id = proc_id
        self.world = split_proc_id(proc_id)
        self.argv = list(argv)
        self.log_path = log_path
        self.pid: int | None = None
        self.started_at = time.time()
        self.state: ChildState = "running"
        self.exit: ChildExit | None = None
        self.stop_requested = False
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._done = asyncio.Event()
        self._popen: subprocess.Popen[bytes] | ForkedProcess | None = None
        self._log_fd: int | None = None
        self._open_streams = 0
        self._streams_done = asyncio.Event()
        self._pidfd: int | None = None
        self._readers: list[PipeReader] = []
        self._died_at: float | None = None

    def __repr__(self) -> str:
        return f"<Child {self.proc_id} pid={self.pid} {self.state}>"

    @property
    def tail(self) -> list[str]:
        """The last output lines (stdout and stderr interleaved), oldest first."""
        return list(self._tail)

    @property
    def running(self) -> bool:
        """Whether the process has not been seen to end yet."""
        return self.state in ("running", "stopping")

    def done(self) -> bool:
        """Whether the end has been recorded (``exit`` is set)."""
        return self._done.is_set()

    async def wait(self, timeout_s: float | None = None) -> ChildExit:
        """Wait until the child's end is recorded; raises `TimeoutError` after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            await self._done.wait()
        assert self.exit is not None
        return self.exit

    def info(self) -> dict[str, Any]:
        """The snapshot row (``proc_id, pid, state, started_at, exit``)."""
        return {
            "proc_id": self.proc_id,
            "pid": self.pid,
            "state": self.state,
            "started_at": self.started_at,
            "exit": None if self.exit is None else self.exit.reason,
        }


class PipeReader:
    """Reads one output pipe of a child without blocking the loop; splits it into lines."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        on_lines: Callable[[list[bytes]], None],
        on_eof: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._fd = fd
        self._on_lines = on_lines
        self._on_eof = on_eof
        self._partial = b""
        self._closed = False
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        for _ in range(_READS_PER_WAKEUP):
            try:
                data = os.read(self._fd, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError as e:
                log.debug("reading a child pipe failed: %s", e)
                data = b""
            if not data:
                self.close()
                return
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        buf = self._partial + data
        lines = buf.split(b"\n")
        self._partial = lines.pop()
        while len(self._partial) > _MAX_LINE_BYTES:
            lines.append(self._partial[:_MAX_LINE_BYTES])
            self._partial = self._partial[_MAX_LINE_BYTES:]
        if lines:
            self._on_lines(lines)

    def close(self) -> None:
        """Stop reading, emit an unterminated last line, release the fd (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self._partial:
            partial, self._partial = self._partial, b""
            self._on_lines([partial])
        self._on_eof()
