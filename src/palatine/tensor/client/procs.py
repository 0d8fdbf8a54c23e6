"""Role processes started through the CLI (``local_mesh``, tests, benchmarks).

`RoleProcess` starts ``palatine <role> ...`` in its own process group, waits (bounded)
for its JSON ready line, and kills the whole group on `kill`/`close`. Each child also
holds the read end of a *lifeline* pipe (``PALATINE_LIFELINE_FD``): when the launcher
dies, even by SIGKILL, the child reads EOF and stops itself, so nothing is left behind.
A role's stdout and stderr are pipes that a thread of the launcher drains for as long as
the role runs: into its log file, and the lines meant for a person onto the console.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from palatine.hosting.child_env import Handoff, describe_exit
from palatine.output.console import ConsoleWriter, chatter_shown

__all__ = ["RoleProcess", "descendants", "end_descendants", "palatine_cmd"]

log = logging.getLogger(__name__)

_READ_BYTES = 256 * 1024
#: A longer line without a newline is passed on in pieces (bounds memory).
_MAX_LINE_BYTES = 64 * 1024
#: How much of a role's stderr `RoleProcess.stderr` keeps.
_TAIL_BYTES = 1024 * 1024
#: How long `RoleProcess.kill` waits for the pump to see the pipes close.
_PUMP_JOIN_S = 1.0


def _prctl() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


# Resolved here, not in the child: between fork and exec the child may only call what
# needs no lock (the pumps of other roles are threads that may hold the import lock).
_PRCTL = _prctl()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (no orphans)."""
    pr_set_pdeathsig = 1
    _PRCTL(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def descendants(roles: list[RoleProcess]) -> list[Any]:
    """The processes the roles started (workers of a host's fork server, say), as
    ``psutil.Process``: taken before the roles stop, since an orphan is no longer
    anybody's child and is found by nothing else."""
    import psutil

    found: list[Any] = []
    for role in roles:
        with contextlib.suppress(psutil.Error):
            found.extend(psutil.Process(role.popen.pid).children(recursive=True))
    return found


def end_descendants(procs: list[Any], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for `descendants` to be gone after their roles stopped,
    SIGKILL the ones still running, and return every pid: a role's worker dies with
    its fork server (``PR_SET_PDEATHSIG``), but a moment after it, and whatever it left
    (its socket files) can be removed only once it is gone."""
    import psutil

    def running(proc: Any) -> bool:  # a zombie has ended: only its reaper is late
        try:
            return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    alive = [proc for proc in procs if running(proc)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [proc for proc in alive if running(proc)]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            log.warning("pid %d (%s) outlived its role; killing it", proc.pid, proc.name())
            proc.kill()
    deadline = time.monotonic() + 1.0
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [proc for proc in alive if running(proc)]
    return [proc.pid for proc in procs]


def palatine_cmd() -> list[str]:
    """How to run the CLI with this interpreter."""
    return [sys.executable, "-m", "palatine"]


class RoleProcess:
    """One ``palatine <role>`` process with its ready line, its output always drained.

    A thread of this object (the *pump*) reads the role's stdout and stderr until they
    close, so the role never blocks on a pipe nobody reads, whatever it prints and for
    however long it runs. Every line goes to ``log_path`` when given (in full), the last
    ones are kept for `stderr`, and the lines meant for a person (see
    `palatine.output.console.classify`) go to ``console`` when given. The JSON ready line on
    stdout is taken by `wait_ready`. ``prefix`` runs the command through another
    (``ip netns exec NODE``: a role on a test bed's node).
    """

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 20.0,
        *,
        die_with_parent: bool = True,
        log_path: str | None = None,
        console: ConsoleWriter | None = None,
        wait: bool = True,
        prefix: list[str] | None = None,
        on_exit: Callable[[RoleProcess, int], None] | None = None,
    ) -> None:
        self.args = args
        # called on the pump's thread with the exit status once the role has ended by
        # itself (its output closed), not when `kill` ends it
        self.on_exit = on_exit
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.update(env or {})
        lifeline_r, self._lifeline_w = os.pipe()
        full_env.update(Handoff(lifeline_fd=lifeline_r).to_env())
        log_file = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - the pump's
        try:
            self.popen = subprocess.Popen(
                [*(prefix or []), *palatine_cmd(), *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=full_env,
                start_new_session=True,
                pass_fds=(lifeline_r,),
                preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509 - lock-free
            )
        except BaseException:
            if log_file is not None:
                log_file.close()
            os.close(self._lifeline_w)
            raise
        finally:
            os.close(lifeline_r)
        #: when it was started (monotonic), for the time its start-up took or failed after
        self.started_at = time.monotonic()
        #: when its output closed (monotonic): it had ended then, or about then
        self.output_closed_at: float | None = None
        self.ready: dict[str, Any] | None = None
        self._ready_event = threading.Event()
        self._stderr_tail: collections.deque[bytes] = collections.deque()
        self._stderr_tail_bytes = 0
        #: guards `_stderr_tail` and `_stderr_tail_bytes`: the pump appends, `stderr` reads
        self._tail_lock = threading.Lock()
        self._stop_pump = False
        self._killing = False
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self._pump = threading.Thread(
            target=self._run_pump,
            args=(self.popen.stdout, self.popen.stderr, log_file, console),
            name=f"palatine-pump-{self.popen.pid}",
            daemon=True,
        )
        self._pump.start()
        if wait:  # else the caller calls wait_ready (several roles starting at once)
            self.wait_ready(ready_timeout_s)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def addr(self) -> str:
        assert self.ready is not None
        return str(self.ready["addr"])

    def ready_within(self, timeout_s: float) -> bool:
        """Whether the ready line has come, waiting at most ``timeout_s`` for it."""
        return self._ready_event.wait(timeout_s)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait (bounded) for the ready line; raise with the stderr tail if it never comes.

        The error says what happened and when: the role ended by itself (how, and how
        long after its start), or it was still running without a ready line when the
        wait ran out (then it is killed here), counted from its start.
        """
        deadline = time.monotonic() + timeout_s
        while not self._ready_event.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or self.popen.poll() is not None:
                break
        if self.ready is not None:
            return self.ready
        code = self.popen.poll()
        after_s = time.monotonic() - self.started_at
        if code is not None:
            self._pump.join(0.5)  # its last words
            closed = self.output_closed_at  # (another role's wait may have come first)
            after_s = min(after_s, after_s if closed is None else closed - self.started_at)
            what = (
                f"{describe_exit(None if code < 0 else code, -code if code < 0 else None)} "
                f"{after_s:.2f} s after its start, before its ready line"
            )
        else:
            what = (
                f"printed no ready line in the {after_s:.2f} s since its start; killed it (SIGKILL)"
            )
        self.kill()
        where = f" (log: {self.log_path})" if self.log_path else ""
        raise RuntimeError(
            f"palatine {' '.join(self.args)} (pid {self.pid}) {what}{where}; "
            f"stderr:\n{self.stderr()[-4000:]}"
        )

    def _run_pump(
        self,
        stdout: IO[bytes],
        stderr: IO[bytes],
        log_file: IO[bytes] | None,
        console: ConsoleWriter | None,
    ) -> None:
        """Read both pipes until they close (or `kill` gives up on them); route each line."""
        partial = {stdout.fileno(): b"", stderr.fileno(): b""}
        err_fd = stderr.fileno()
        try:
            with selectors.DefaultSelector() as sel:
                for f in (stdout, stderr):
                    os.set_blocking(f.fileno(), False)
                    sel.register(f.fileno(), selectors.EVENT_READ)
                while partial and not self._stop_pump:
                    for key, _ in sel.select(0.1):
                        fd = int(key.fd)
                        try:
                            data = os.read(fd, _READ_BYTES)
                        except BlockingIOError:
                            continue
                        except OSError:
                            data = b""
                        if not data:
                            sel.unregister(fd)
                            rest = partial.pop(fd)
                            lines = [rest] if rest else []
                        else:
                            buf = partial[fd] + data
                            lines = buf.split(b"\n")
                            partial[fd] = lines.pop()
                            while len(partial[fd]) > _MAX_LINE_BYTES:
                                lines.append(partial[fd][:_MAX_LINE_BYTES])
                                partial[fd] = partial[fd][_MAX_LINE_BYTES:]
                        if lines:
                            self._route(lines, fd == err_fd, log_file, console)
        except Exception:  # a pump that dies must say why
            log.exception("reading the output of palatine %s failed", " ".join(self.args))
        finally:
            if not partial:
                self.output_closed_at = time.monotonic()
            if log_file is not None:
                with contextlib.suppress(OSError):
                    log_file.close()
        on_exit = self.on_exit
        if on_exit is not None and not self._stop_pump and not self._killing:
            try:
                code = self.popen.wait(timeout=_PUMP_JOIN_S)
            except subprocess.TimeoutExpired:
                return  # its output closed, yet it runs: not an exit
            try:
                on_exit(self, code)
            except Exception:
                log.exception("handling the exit of palatine %s failed", " ".join(self.args))

    def _route(
        self,
        lines: list[bytes],
        is_stderr: bool,
        log_file: IO[bytes] | None,
        console: ConsoleWriter | None,
    ) -> None:
        if not is_stderr and self.ready is None:
            for line in lines:
                if line.startswith(b"{") and self.ready is None:
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and obj.get("event") == "ready":
                        self.ready = obj
                        self._ready_event.set()
        if log_file is not None:
            try:
                log_file.write(b"".join(line + b"\n" for line in lines))
                log_file.flush()
            except OSError as e:
                log.warning("cannot write %s any more: %s", self.log_path, e)
                with contextlib.suppress(OSError):
                    log_file.close()
                log_file = None
        if is_stderr:
            with self._tail_lock:
                for line in lines:
                    self._stderr_tail.append(line)
                    self._stderr_tail_bytes += len(line) + 1
                while self._stderr_tail_bytes > _TAIL_BYTES and len(self._stderr_tail) > 1:
                    self._stderr_tail_bytes -= len(self._stderr_tail.popleft()) + 1
        if console is not None:
            console.write_lines(lines, drop_internal=not chatter_shown())

    def stderr(self) -> str:
        """The last lines the role wrote to stderr (about 1 MiB at most)."""
        with self._tail_lock:
            data = b"".join(line + b"\n" for line in self._stderr_tail)
        return data.decode(errors="replace")

    def signal(self, sig: int) -> None:
        os.kill(self.popen.pid, sig)

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.popen.poll()
            if code is not None:
                return code
            time.sleep(0.02)
        raise TimeoutError(f"palatine {' '.join(self.args)} did not exit within {timeout_s} s")

    def terminate(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the group; the exit status."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                return self.wait(grace_s)
            except TimeoutError:
                pass
        self.kill()
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group (idempotent)."""
        self._killing = True
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.cut_lifeline()
        # The pipes close with the group; a process that left it may still hold them.
        self._pump.join(_PUMP_JOIN_S)
        if self._pump.is_alive():
            self._stop_pump = True
            self._pump.join(_PUMP_JOIN_S)

    close = kill  # what fixtures and `contextlib.closing` call

    def cut_lifeline(self) -> None:
        """Close the launcher's end of the lifeline (idempotent): the role then stops
        itself, as when the launcher dies."""
        fd, self._lifeline_w = self._lifeline_w, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
