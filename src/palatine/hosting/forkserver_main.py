"""The fork server process itself (see `palatine.hosting.forkserver` for the whole story).

Started by `palatine.hosting.forkserver.ForkServer.start` as ``python -c "from
palatine.hosting.forkserver_main import main; main([...])"``: it arms its parent-death signal,
imports the modules it was given, then serves spawn and signal requests on its socket
until the host closes it. A forked child returns out of the server's frames (`_Server.serve`
hands it a `_Start`) and runs ``palatine.__main__`` as ``python -m palatine`` would, so
it exits through the interpreter's normal shutdown.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from palatine.hosting.forkserver import FD_VAR, MAX_MESSAGE_BYTES, PARENT_VAR, PRELOAD

__all__ = ["main"]

#: How long a spawn waits for the warm thread, done importing, to be gone.
_THREAD_EXIT_S = 1.0


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _import(modules: Sequence[str], *, warm: bool) -> None:
    """Import ``modules`` into the server (what its forked procs then share).

    When warming, numpy's OpenBLAS is kept from starting its thread pool (a server with a
    second thread may not fork), and a module that starts a thread anyway is reported.
    """
    blas = "OPENBLAS_NUM_THREADS"
    pinned = warm and blas not in os.environ
    if pinned:
        os.environ[blas] = "1"
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - a broken module must not take the server down
                what = "warm" if warm else "preload"
                sys.stderr.write(f"palatine fork server: cannot {what} {name}: {e}\n")
    finally:
        if pinned:
            os.environ.pop(blas, None)
    if warm and _thread_count() > 2:  # (this thread is the second)
        sys.stderr.write(
            f"palatine fork server: importing {', '.join(modules)} started a thread;"
            " later procs are exec'd\n"
        )
    # Keep what was imported out of the collector's reach: workers then do not dirty
    # (copy) the shared pages by merely scanning them.
    gc.freeze()


class _Start:
    """What a freshly forked child runs once the server's frames have unwound."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def run(self) -> None:
        import runpy

        # What ``python -m palatine worker ...`` does: the working directory first on the
        # path (``-c`` put "" there), the module's file as argv[0] (run_module sets it).
        if sys.path and sys.path[0] == "":
            sys.path[0] = os.getcwd()
        sys.argv = [self.argv[0], *self.argv[3:]]
        runpy.run_module(self.argv[2], run_name="__main__", alter_sys=True)


class _Server:
    """The server's loop: requests on the socket, workers' ends on their pidfds."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, tuple[int, bool]] = {}  # pid -> (pidfd, kill_group)
        # The warm import runs beside the loop, which goes on reaping and signalling
        # workers meanwhile; the host asks for no spawn until it has ended (no fork with a
        # second thread), and one asked for all the same is refused.
        self.warming: threading.Thread | None = None
        self.warm_asked = False

    def warm(self, modules: list[str]) -> None:
        t0 = time.monotonic()
        _import(modules, warm=True)
        self.send({"op": "warmed", "seconds": round(time.monotonic() - t0, 3)})

    def warmed(self) -> None:
        """Wait for the warm thread, which has said ``warmed`` (the host asks for no
        spawn before), to end and be gone from the OS (it lingers a moment after `join`),
        at most `_THREAD_EXIT_S` in all. A thread still importing is not waited for: the
        spawn is refused (the host execs it) rather than held behind the warm-up."""
        warming = self.warming
        if warming is None:
            return
        deadline = time.monotonic() + _THREAD_EXIT_S
        warming.join(_THREAD_EXIT_S)
        if warming.is_alive():
            return  # still importing: the thread count refuses this spawn
        self.warming = None
        while _thread_count() != 1 and time.monotonic() < deadline:
            time.sleep(0.001)

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.sock.send(json.dumps(msg).encode())
        except OSError as e:
            sys.stderr.write(f"palatine fork server: cannot reach the host: {e}\n")

    def serve(self) -> _Start | None:
        """Serve until the host goes; in a forked child, return what it must run."""
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.send({"op": "ready", "pid": os.getpid()})
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    try:
                        data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 2)
                    except OSError as e:
                        sys.stderr.write(f"palatine fork server: {e}\n")
                        data, fds = b"", []
                    if not data:
                        self.stop_all()
                        return None
                    start = self.request(data, fds)
                    if start is not None:
                        return start
                else:
                    self.reap(key.data)

    def request(self, data: bytes, fds: list[int]) -> _Start | None:
        try:
            msg = json.loads(data)
            op = msg.get("op")
        except ValueError:
            op, msg = None, {}
        if op == "spawn":
            return self.spawn(msg, fds)
        for fd in fds:
            os.close(fd)
        if op == "warm" and not self.warm_asked:  # (the host asks once)
            self.warm_asked = True
            modules = [str(m) for m in msg.get("modules") or []]
            self.warming = threading.Thread(
                target=self.warm, args=(modules,), name="palatine-warm", daemon=True
            )
            self.warming.start()
        elif op == "signal":
            child = self.children.get(int(msg["pid"]))
            if child is not None:  # not reaped: the pid is still ours
                pidfd, _ = child
                # A worker the host stops takes its process group along.
                self.children[int(msg["pid"])] = (pidfd, True)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(msg["pid"]), int(msg["sig"]))
        return None

    def spawn(self, msg: dict[str, Any], fds: list[int]) -> _Start | None:
        rid = msg.get("id")
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            self.send({"op": "failed", "id": rid, "reason": "spawn request without stdout/stderr"})
            return None
        self.warmed()
        threads = _thread_count()
        if threads != 1:
            for fd in fds:
                os.close(fd)
            self.send(
                {"op": "failed", "id": rid, "reason": f"the fork server has {threads} threads"}
            )
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            self.send({"op": "failed", "id": rid, "reason": f"fork: {e}"})
            return None
        if pid == 0:
            return self.become_child(msg, fds)
        for fd in fds:
            os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            # Unwatchable (out of fds?): a worker nobody would see die must not run.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.send({"op": "failed", "id": rid, "reason": f"pidfd_open: {e}"})
            return None
        self.children[pid] = (pidfd, bool(msg.get("kill_group", True)))
        self.sel.register(pidfd, selectors.EVENT_READ, pid)
        self.send({"op": "started", "id": rid, "pid": pid})
        return None

    def become_child(self, msg: dict[str, Any], fds: list[int]) -> _Start:
        """In the forked child: shed the server's state, take the worker's stdio and env."""
        os.setsid()
        self.sel.close()
        self.sock.close()
        for pidfd, _ in self.children.values():
            os.close(pidfd)
        self.children.clear()
        out_fd, err_fd = fds
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (null, out_fd, err_fd):
            if fd > 2:
                os.close(fd)
        os.chdir(msg["cwd"])
        env = dict(msg["env"])
        env[PARENT_VAR] = str(os.getppid())  # the worker dies with this server
        os.environ.clear()
        os.environ.update(env)
        return _Start(list(msg["argv"]))

    def reap(self, pid: int) -> None:
        pidfd, kill_group = self.children[pid]
        if kill_group:
            # Before the reap the zombie still holds its pid: only its own group is hit.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got, status = pid, None
        if got == 0:
            return  # not ended yet (a spurious wake-up)
        del self.children[pid]
        self.sel.unregister(pidfd)
        os.close(pidfd)
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        self.send({"op": "exited", "pid": pid, "returncode": code})

    def stop_all(self) -> None:
        """The host is gone: no worker of ours may outlive it."""
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def main(preload: Sequence[str] = PRELOAD) -> None:
    """The fork server process (started by `ForkServer.start`); serves until the host goes."""
    fd = int(os.environ.pop(FD_VAR))
    from palatine.hosting.child_env import arm_parent_death_signal

    arm_parent_death_signal()
    os.environ.pop(PARENT_VAR, None)
    os.close(os.pidfd_open(os.getpid()))  # no pidfds, no server: the host sees EOF and execs
    _import(preload, warm=False)
    start = _Server(socket.socket(fileno=fd)).serve()
    if start is not None:
        start.run()
