"""A host's child processes: spawn, log, watch, terminate.

`ChildProcs` is the OS-process machinery under the host's proc agent, independent of the
actor runtime. It runs on the host's event loop and, for each worker proc:

* starts the program with stdin on the null device, stdout and stderr on pipes, a new
  session and process group, the host's working directory and ``os.environ`` plus the
  given variables (`palatine.hosting.child_env.child_env` builds them);
* appends every output line to the proc's log file, forwards it to the host's stderr as
  ``[W[r]] line`` (undecodable bytes replaced; never blocking the loop: a console that
  does not keep up loses lines, counted, not the log file) and keeps the last 50 lines for
  the exit report;
* watches the process through a ``pidfd`` registered with ``loop.add_reader`` (a waiter
  thread where pidfds are unavailable) and calls ``on_exit(child, exit_code, exit_signal,
  tail)`` as soon as it dies, so the system hears of a death within milliseconds rather
  than after a heartbeat timeout;
* terminates children by process group: SIGTERM, a grace period, SIGKILL, reap, so no
  orphan outlives the host.

With a fork server (`palatine.hosting.forkserver`), a ``<python> -m palatine worker`` program is
forked from an interpreter that has already imported the worker's modules rather than
executed; the server is the child's parent, reaps it and reports its exit at once, and
signals go through it. Output, logs, exit reports and termination are the same.

A program that cannot be started (``ENOENT``, ``EACCES``, ...) does not raise: `spawn`
returns a `Child` in state ``failed`` whose ``exit.reason`` reads ``cannot execute 'x': No
such file or directory``, and ``on_exit`` is called for it too (with no code, no signal
and an empty tail) right after `spawn` returns, so the host reports every end of a proc
through one path.

Children are started from the loop's thread on purpose: Linux delivers the parent-death
signal when the *thread* that forked the child ends, so forking from a short-lived
executor thread would kill children early. The child side of that contract is
`palatine.hosting.child_env.arm_parent_death_signal`, called by a bootstrapping proc that finds
``PALATINE_PARENT_PID``.

`Child` is the record kept per proc (state, pid, exit, the last output lines),
`ChildExit` how it ended, and `PipeReader` reads one of its output pipes on the loop
and splits it into lines (a ``\\r`` progress bar's states apart: `palatine.output.progress`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self, TextIO

import msgspec

from palatine import config
from palatine.channel import sockets
from palatine.hosting.child_env import describe_exit
from palatine.hosting.forkserver import (
    ForkedProcess,
    ForkServer,
    ForkServerError,
    fork_server_supported,
)
from palatine.output.console import ConsoleWriter, chatter_shown
from palatine.output.progress import CarriageSplitter

if TYPE_CHECKING:
    from palatine.hosting.forkserver import ForkedProcess
__all__ = [
    "TAIL_LINES",
    "Child",
    "ChildExit",
    "ChildProcs",
    "ChildState",
    "OnExit",
    "PipeReader",
    "split_proc_id",
    "write_all",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the record and pipes of one child

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
        on_progress: Callable[[bytes], None] | None = None,
    ) -> None:
        self._loop = loop
        self._fd = fd
        self._on_lines = on_lines
        self._on_eof = on_eof
        self._on_progress = on_progress  # a progress bar's new state (`output.progress`)
        self._carriage = CarriageSplitter()
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
        lines = self._carriage.lines(lines)
        state, self._partial = self._carriage.partial(self._partial)
        while len(self._partial) > _MAX_LINE_BYTES:
            lines.append(self._partial[:_MAX_LINE_BYTES])
            self._partial = self._partial[_MAX_LINE_BYTES:]
        if lines:
            self._on_lines(lines)
        if state is not None and self._on_progress is not None:
            self._on_progress(state)

    def close(self) -> None:
        """Stop reading, emit an unterminated last line, release the fd (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.remove_reader(self._fd)
        except Exception as e:  # noqa: BLE001 - a closed loop reads nothing: the fd goes below
            log.debug("removing the reader of fd %d: %s", self._fd, e)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self._partial or self._carriage.shown:
            partial, self._partial = self._partial, b""
            self._on_lines(self._carriage.lines([partial]))
        self._on_eof()


#: How long an exit report waits for the child's pipes to reach EOF, so that the last
#: lines it printed are in the tail. Short: a grandchild holding the pipes open must not
#: delay the report past the 100 ms target.
_DRAIN_TIMEOUT_S = 0.05

#: How long `ChildProcs.terminate` waits for a SIGKILLed child to be reaped before giving up.
_KILL_WAIT_S = 5.0

#: ``on_exit(child, exit_code, exit_signal, tail)``; may return an awaitable.
OnExit = Callable[[Child, int | None, int | None, list[str]], Awaitable[None] | None]


# --------------------------------------------------------------------------- helpers


def _killpg(pgid: int, sig: int) -> None:
    """Signal a process group, tolerating one that is already empty."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as e:
        log.warning("cannot send %s to process group %d: %s", signal.Signals(sig).name, pgid, e)


# --------------------------------------------------------------------------- the owner


class ChildProcs:
    """The children of one host: spawn, output handling, exit watching, termination.

    Use on the host's event loop. ``on_exit`` is called once per child as soon as its end
    is known (an awaitable it returns runs as a task owned here). ``echo`` forwards output
    lines to ``echo_stream`` (``sys.stderr`` at the time of writing when ``None``).
    With ``kill_group_on_exit`` (default), a child's leftover process group is SIGKILLed
    when the child itself dies, so helpers it started do not outlive it. ``use_pidfd``
    ``None`` picks pidfds when the kernel has them. ``fork_server`` (shared, not closed
    here) or `start_fork_server` (owned) forks the workers it accepts instead of executing
    them (`palatine.hosting.forkserver`); everything else works the same for both kinds. `aclose`
    (or ``async with``) terminates every child and waits for the exit callbacks.
    """

    def __init__(
        self,
        on_exit: OnExit | None = None,
        *,
        echo: bool = True,
        echo_stream: TextIO | None = None,
        kill_group_on_exit: bool = True,
        use_pidfd: bool | None = None,
        tail_lines: int = TAIL_LINES,
        fork_server: ForkServer | None = None,
    ) -> None:
        self._on_exit = on_exit
        self._fork_server = fork_server
        self._owns_fork_server = False
        # The echo never blocks the loop: a console writer thread, bounded, drops with a count.
        self._console = (
            ConsoleWriter(
                echo_stream,
                limit_bytes=config.get().console_buffer_bytes,
                complete_in="the per-proc log files",
                name="palatine-echo",
            )
            if echo
            else None
        )
        self._quiet = not chatter_shown()  # procs' INFO and ready lines: logs only
        # Takes a child's lines before the echo; True: taken, not echoed
        # (`palatine.hosting.output.OutputFanout.take`).
        self.forward: Callable[[Child, list[bytes]], bool] | None = None
        self._kill_group_on_exit = kill_group_on_exit
        self._use_pidfd = hasattr(os, "pidfd_open") if use_pidfd is None else use_pidfd
        self._tail_lines = tail_lines
        self._children: list[Child] = []
        self._by_proc: dict[str, Child] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def fork_server(self) -> ForkServer | None:
        """The fork server children are forked by (given or started here), if any."""
        return self._fork_server

    def start_fork_server(self) -> None:
        """Start a fork server of our own (closed by `aclose`) unless one was given.

        Call it on the loop early (before the first `spawn`) so the server's imports
        overlap other start-up work; workers it can fork then start in milliseconds.
        """
        if self._fork_server is None and fork_server_supported():
            self._fork_server = ForkServer()
            self._owns_fork_server = True
            self._fork_server.start()

    # ------------------------------------------------------------------ queries

    @property
    def children(self) -> list[Child]:
        """Every child spawned here, in spawn order, including ended and failed ones."""
        return list(self._children)

    def get(self, proc_id: str) -> Child | None:
        """The most recent child spawned for ``proc_id``."""
        return self._by_proc.get(str(proc_id))

    def running(self, world: str | None = None) -> list[Child]:
        """Children not yet ended, optionally only those of ``world``."""
        return [c for c in self._children if c.running and (world is None or c.world == str(world))]

    # ------------------------------------------------------------------ spawn

    async def spawn(
        self,
        proc_id: str,
        argv: list[str],
        env: Mapping[str, str],
        log_path: Path | None,
    ) -> Child:
        """Start ``argv`` as proc ``proc_id``; never raises for a bad program.

        The child gets ``os.environ`` plus ``env``, a new session, null stdin, and its
        output appended to ``log_path`` (created with its parents; ``None`` for no file).
        Returns the `Child`, in state ``failed`` with the reason when the program could
        not be executed.
        """
        loop = asyncio.get_running_loop()
        self._loop = loop
        proc_id = str(proc_id)
        child = Child(proc_id, argv, log_path, self._tail_lines)
        self._children.append(child)
        self._by_proc[proc_id] = child
        if self._closing:
            self._fail(child, "not started: the host is stopping")
            return child
        if not argv:
            self._fail(child, "cannot execute '': empty command")
            return child
        if log_path is not None:
            if self._console is not None:
                self._console.complete_in = f"the log files in {log_path.parent}"
            try:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                child._log_fd = os.open(
                    log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
                )
            except OSError as e:
                log.warning("%s: cannot open log file %s: %s", proc_id, log_path, e)
        full_env = {**os.environ, **env}
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        popen: subprocess.Popen[bytes] | ForkedProcess | None
        try:
            popen = await self._fork(child, argv, full_env, out_w, err_w)
            if popen is None:
                # Forked from the loop's thread on purpose (see the module docstring);
                # with vfork this takes about a millisecond.
                popen = subprocess.Popen(  # noqa: ASYNC220
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    env=full_env,
                    start_new_session=True,
                    close_fds=True,
                )
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            for fd in (out_r, err_r):
                os.close(fd)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self._fail(child, f"cannot execute '{argv[0]}': {reason}")
            return child
        finally:
            os.close(out_w)
            os.close(err_w)
        child._popen = popen
        child.pid = popen.pid
        child.started_at = time.time()
        child._open_streams = 2
        for fd in (out_r, err_r):
            child._readers.append(
                PipeReader(
                    loop,
                    fd,
                    lambda lines: self._emit(child, lines),
                    lambda: self._eof(child),
                    lambda state: self._progress(child, state),
                )
            )
        if isinstance(popen, ForkedProcess):
            how = "forked"
            if self._closing:  # the host began to stop while the server was forking
                self._signal(child, signal.SIGKILL)
        else:
            how = "started"
            self._watch(child)
        log.info("%s: %s pid %d: %s", proc_id, how, popen.pid, " ".join(argv))
        return child

    async def _fork(
        self, child: Child, argv: list[str], env: dict[str, str], out_w: int, err_w: int
    ) -> ForkedProcess | None:
        """Start ``argv`` through the fork server when it can; None: exec it instead."""
        server = self._fork_server
        if server is None or not server.accepts(argv, env):
            return None
        handle: ForkedProcess | None = None
        early: list[int | None] = []

        def exited(returncode: int | None) -> None:
            if handle is None:
                early.append(returncode)  # reported before spawn() returned to us
            else:
                self._forked_exit(child, handle, returncode)

        try:
            pid = await server.spawn(
                argv,
                env,
                os.getcwd(),
                out_w,
                err_w,
                kill_group=self._kill_group_on_exit,
                on_exit=exited,
            )
        except ForkServerError as e:
            log.info("%s: fork server unavailable (%s); executing the program", child.proc_id, e)
            return None
        handle = ForkedProcess(pid)
        if early:
            loop = asyncio.get_running_loop()
            loop.call_soon(self._forked_exit, child, handle, early[0])
        return handle

    def _forked_exit(self, child: Child, handle: ForkedProcess, returncode: int | None) -> None:
        """The fork server reaped ``child`` (``returncode``), or was lost (None)."""
        if returncode is None:
            handle.lost = True
            # Its workers die with it (parent-death signal); their groups go too.
            _killpg(handle.pid, signal.SIGKILL)
        else:
            handle.returncode = returncode
        self._on_dead(child)

    def _signal(self, child: Child, sig: int) -> None:
        """Signal ``child``'s process group (through the fork server for a forked child)."""
        assert child.pid is not None
        popen = child._popen
        if isinstance(popen, ForkedProcess) and not popen.lost:
            server = self._fork_server
            if server is not None and server.signal(child.pid, sig):
                return
            if popen.returncode is not None:
                return  # reaped: the pid may be someone else's now
        _killpg(child.pid, sig)

    def _fail(self, child: Child, reason: str) -> None:
        child.state = "failed"
        child.exit = ChildExit(
            exit_code=None, exit_signal=None, reason=reason, ended_at=time.time(), stderr_tail=[]
        )
        child._streams_done.set()
        self._close_log(child)
        log.warning("%s: %s", child.proc_id, reason)
        loop = asyncio.get_running_loop()
        loop.call_soon(self._report, child, None, None, [])

    # ------------------------------------------------------------------ output

    def _emit(self, child: Child, lines: list[bytes]) -> None:
        if child._log_fd is not None:
            try:
                write_all(child._log_fd, b"".join(line + b"\n" for line in lines))
            except OSError as e:
                log.warning("%s: writing log %s failed: %s", child.proc_id, child.log_path, e)
                self._close_log(child)
        # only the lines the tail can keep are decoded here (the echo decodes its own)
        keep = child._tail.maxlen or len(lines)
        child._tail.extend(line.decode("utf-8", "replace").rstrip("\r") for line in lines[-keep:])
        forward = self.forward
        if forward is not None and forward(child, lines):
            return
        if self._console is not None:
            self._console.write_lines(lines, f"[{child.proc_id}] ", drop_internal=self._quiet)

    def _progress(self, child: Child, state: bytes) -> None:
        """A progress bar's new state (a ``\\r`` line): to the client that watches the
        output, as a line ending in ``\\r``; not logged nor echoed (the finished line is)."""
        forward = self.forward
        if forward is not None:
            forward(child, [state + b"\r"])

    def flush_echo(self, timeout_s: float) -> bool:
        """Wait (blocking, bounded) until the echoed lines so far are written; whether they were."""
        return self._console is None or self._console.flush(timeout_s)

    def _eof(self, child: Child) -> None:
        child._open_streams -= 1
        if child._open_streams <= 0:
            child._streams_done.set()
            if child.exit is not None:
                self._close_log(child)

    @staticmethod
    def _close_log(child: Child) -> None:
        fd, child._log_fd = child._log_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------------ exit watching

    def _watch(self, child: Child) -> None:
        assert child.pid is not None and self._loop is not None
        loop = self._loop
        if self._use_pidfd:
            try:
                pidfd = os.pidfd_open(child.pid)
            except ProcessLookupError:
                # Only possible if someone else reaped it; report what we can.
                loop.call_soon(self._on_dead, child)
                return
            except OSError as e:
                log.debug("pidfd_open unavailable (%s); using a waiter thread", e)
                self._use_pidfd = False
            else:
                child._pidfd = pidfd
                loop.add_reader(pidfd, self._on_dead, child)
                return
        thread = threading.Thread(
            target=self._wait_thread,
            args=(loop, child, child.pid),
            name=f"palatine-childwait-{child.pid}",
            daemon=True,
        )
        thread.start()

    def _wait_thread(self, loop: asyncio.AbstractEventLoop, child: Child, pid: int) -> None:
        """Fallback watcher: block until the child ends, leaving the reap to the loop."""
        while True:
            try:
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            loop.call_soon_threadsafe(self._on_dead, child)

    def _on_dead(self, child: Child) -> None:
        """The child's process has ended (it is a zombie): clean its group, reap, report."""
        if child._died_at is not None:
            return
        child._died_at = time.monotonic()
        if child._pidfd is not None:
            assert self._loop is not None
            try:
                self._loop.remove_reader(child._pidfd)
            except Exception as e:  # noqa: BLE001 - a closed loop reads nothing: the fd goes below
                log.debug("removing the reader of pidfd %d: %s", child._pidfd, e)
            with contextlib.suppress(OSError):
                os.close(child._pidfd)
            child._pidfd = None
        assert child.pid is not None and child._popen is not None
        forked = isinstance(child._popen, ForkedProcess)  # its server did this before the reap
        if (self._kill_group_on_exit or child.stop_requested) and not forked:
            # Before the reap, the zombie still holds its pid, so the group id cannot
            # have been reused: this signals only processes that child started.
            _killpg(child.pid, signal.SIGKILL)
        sockets.sweep({child.pid})  # the socket files it left, before its pid can be reused
        self._spawn_task(self._finish(child), f"child-exit-{child.proc_id}")

    async def _finish(self, child: Child) -> None:
        assert child._popen is not None
        returncode = child._popen.poll()
        if returncode is None and not getattr(child._popen, "lost", False):
            # Readiness comes with the exit; the zombie may trail it by a moment.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_KILL_WAIT_S):
                    while (returncode := child._popen.poll()) is None:
                        await asyncio.sleep(0.002)
            if returncode is None:
                log.error("%s: pid %s ended but cannot be reaped", child.proc_id, child.pid)
        if returncode is None:
            code, sig = None, None
        elif returncode < 0:
            code, sig = None, -returncode
        else:
            code, sig = returncode, None
        # Let the pipes drain so the last printed lines are in the tail, but briefly.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                await child._streams_done.wait()
        reason = describe_exit(code, sig)
        child.exit = ChildExit(
            exit_code=code,
            exit_signal=sig,
            reason=reason,
            ended_at=time.time(),
            stderr_tail=child.tail,
            requested=child.stop_requested,
        )
        child.state = "exited"
        if child._streams_done.is_set():
            self._close_log(child)
        level = logging.INFO if child.stop_requested or code == 0 else logging.WARNING
        log.log(level, "%s: pid %s %s", child.proc_id, child.pid, reason)
        self._report(child, code, sig, child.exit.stderr_tail)

    def _report(self, child: Child, code: int | None, sig: int | None, tail: list[str]) -> None:
        """Call ``on_exit`` (owning any awaitable it returns), then release waiters."""
        try:
            if self._on_exit is not None:
                result = self._on_exit(child, code, sig, list(tail))
                if inspect.isawaitable(result):
                    self._spawn_task(_await(result), f"on-exit-{child.proc_id}")
        except Exception:
            log.exception("%s: exit callback failed", child.proc_id)
        finally:
            child._done.set()

    def _spawn_task(self, coro: Awaitable[None], name: str) -> None:
        assert self._loop is not None
        task = self._loop.create_task(_guard(coro, name), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ termination

    async def terminate(self, child: Child, grace_s: float | None = None) -> ChildExit | None:
        """Stop one child: SIGTERM its group, wait ``grace_s``, SIGKILL survivors, reap.

        ``grace_s`` defaults to ``child_term_grace`` (5 s). Returns the child's exit
        (``None`` only if it could not be reaped even after SIGKILL, which is logged).
        """
        if child.pid is None or child.done():
            return child.exit
        grace = config.get().child_term_grace_s if grace_s is None else grace_s
        if child.state == "running":
            child.state = "stopping"
            child.stop_requested = True
            if child._died_at is None:
                self._signal(child, signal.SIGTERM)
        try:
            return await child.wait(grace)
        except TimeoutError:
            pass
        if child._died_at is None:
            log.info(
                "%s: pid %d still running %g s after SIGTERM; sending SIGKILL",
                child.proc_id,
                child.pid,
                grace,
            )
        self.kill(child)
        try:
            return await child.wait(_KILL_WAIT_S)
        except TimeoutError:
            log.error("%s: pid %d did not end after SIGKILL", child.proc_id, child.pid)
            return None

    def kill(self, child: Child) -> None:
        """SIGKILL one child's process group now (no SIGTERM first: for a stuck child,
        whose handlers must not run); it is reaped and its exit reported as any other."""
        if child.pid is not None and not child.done() and child._died_at is None:
            self._signal(child, signal.SIGKILL)

    async def kill_all(self, world: str | None = None, grace_s: float | None = None) -> list[Child]:
        """Terminate every running child (of ``world`` when given) concurrently.

        Returns the children that were running; each is reaped (or logged) on return.
        """
        targets = self.running(world)
        if targets:
            async with asyncio.TaskGroup() as tg:
                for child in targets:
                    tg.create_task(self.terminate(child, grace_s), name=f"kill-{child.proc_id}")
        return targets

    def kill_now(self) -> None:
        """SIGKILL every running child's process group at once, synchronously.

        For interpreter exit and test fixtures; the loop reaps them if it still runs.
        """
        for child in self._children:
            if child.pid is not None and child._died_at is None and child.exit is None:
                child.stop_requested = True
                self._signal(child, signal.SIGKILL)

    async def aclose(self, grace_s: float | None = None) -> None:
        """Refuse new spawns, terminate every child, and wait for the exit callbacks."""
        self._closing = True
        await self.kill_all(None, grace_s)
        pending = {t for t in self._tasks if not t.done()}
        if pending:
            _, still = await asyncio.wait(pending, timeout=_KILL_WAIT_S)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=1.0)
        for child in self._children:
            if child.done():
                # Pipes a surviving orphan still holds (kill_group_on_exit off) end here.
                for reader in child._readers:
                    reader.close()
                self._close_log(child)
        if self._owns_fork_server and self._fork_server is not None:
            await self._fork_server.close()
        if self._console is not None:
            try:
                await asyncio.to_thread(self._console.close, 1.0)
            except RuntimeError:  # at interpreter exit no executor takes work: flush here
                self._console.close(0.2)


async def _await(result: Awaitable[None]) -> None:
    await result


async def _guard(coro: Awaitable[None], name: str) -> None:
    """Run an owned task body; log (never propagate) what it raises."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("task %s failed", name)
