"""A fork server: worker procs forked from a pre-imported interpreter.

Executing ``python -m palatine worker`` costs each proc an interpreter start and about
250 module imports, ≈ 0.2 s of CPU (more where bytecode is not cached): four workers on
two cores take half a second before they can join. A host can instead keep one *fork
server*, a child process started once with the same interpreter and environment, which
imports the worker's modules, never starts a thread, and forks a fresh proc for each
request. Every worker is still its own OS process, in its own session and process
group, with the host's pipes as stdout and stderr; it runs the same code path as an
exec'd one (``runpy`` of ``palatine.__main__`` with ``worker ...`` as arguments). The
host's side is here (`ForkServer`, `ForkedProcess`); the server process's is
`palatine.hosting.forkserver_main`.

Only programs ``<this interpreter> -m palatine worker ...`` are forked, and only when the
variables read at interpreter start (``PYTHON*``, ``LD_*``, ``MALLOC_*``,
``GLIBC_TUNABLES``) are those the server started with (`ForkServer.accepts`); anything
else is exec'd as before. ``PALATINE_FORK_SERVER=0`` (config key ``fork_server``) turns
the server off.

Supervision. The server is the workers' parent: it watches each through a pidfd, SIGKILLs
a dead worker's process group before the reap when the host asks for that (as
`palatine.hosting.children` does for exec'd children), reaps it and reports its return code at
once. Signals from the host go through the server, which delivers them only to a worker
it has not reaped yet, so a reused pid is never hit. Parent death: the server dies with
the host (``PR_SET_PDEATHSIG`` armed against the host's pid) and each worker dies with
the server (armed against the server's pid, `palatine.hosting.child_env.arm_parent_death_signal`);
a server whose host closes the connection SIGKILLs its workers' groups and exits. The
host treats a lost server like the end of each of its live workers, status unknown.

Fork safety. The server starts no thread but the warm import's (below), which has ended
before any fork; it counts its OS threads before every fork and refuses the request
(the host then execs) if there is more than one. It
configures no logging, creates no event loop and resolves no cluster token, so a worker
starts from the same state as a fresh interpreter that imported the same modules. The
``random`` module reseeds itself in the child; workers of one server share its hash
seed, as processes forked by ``multiprocessing`` do.

Protocol, on a private ``SOCK_SEQPACKET`` socket pair, one JSON object per message:

* host → server: ``{"op": "spawn", "id", "argv", "env", "cwd", "kill_group"}`` with the
  worker's stdout and stderr as ``SCM_RIGHTS`` fds; ``{"op": "signal", "pid", "sig"}``;
  ``{"op": "warm", "modules"}`` once (see below).
* server → host: ``{"op": "ready", "pid"}`` once; ``{"op": "started", "id", "pid"}`` or
  ``{"op": "failed", "id", "reason"}`` per spawn; ``{"op": "exited", "pid", "returncode"}``
  (negative: killed by that signal) per worker, always after its ``started``;
  ``{"op": "warmed", "seconds"}`` once the warm modules are imported.

Warming. A respawned rank (``DeviceMesh.recover``, ``ProcMesh.respawn``) must be back in
well under the time a fresh interpreter takes to import torch (≈ 1.4 s of CPU here). So
once the host's spawns have settled (no spawn for `WARM_AFTER_S`), the host asks its
server to import the ``fork_server_warm`` modules (``PALATINE_FORK_SERVER_WARM``): a proc
forked later starts with them loaded. The hosts of a `palatine.local_mesh`, whose workers
all import torch, warm torch and torch._dynamo (which building the first optimizer
imports, ≈ 1 s more) unless the variable says otherwise; other hosts warm nothing unless
asked, so that actor meshes that never use torch do not pay for it. The import runs on
a thread beside the server's loop, which goes on reaping and signalling workers (an exit
is reported at once even then). A spawn asked for meanwhile does not wait for the import
(no fork may happen while it runs): `ForkServer.spawn` refuses it at once, and the host
execs the program, a cold start of a fraction of a second, with the proc importing what
it needs on first use. Done then, not at the server's start, and not as part of a mesh
becoming ready: every mesh would then wait for imports (≈ 2.4 s of CPU for torch and
torch._dynamo, much more on a loaded machine) that only a respawn soon after the start
gains from; a recovery early in a mesh's life costs an exec instead, never a wait behind
the warm-up (the server waits only, at most 1 s, for a warm thread that said it was
done to be gone).
numpy's OpenBLAS starts a thread pool when it loads, which would make the server
unforkable, so the server imports with ``OPENBLAS_NUM_THREADS=1`` unless it is set:
numpy's own BLAS calls in a proc forked afterwards run on one thread (torch's do not use
OpenBLAS). A module that cannot be imported, or that leaves a thread running, is reported
on the server's stderr; in the second case later spawns are exec'd instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palatine import config
from palatine.hosting.child_env import Handoff

__all__ = ["PRELOAD", "ForkServer", "ForkServerError", "ForkedProcess", "fork_server_supported"]

log = logging.getLogger(__name__)

#: Modules the server imports once, so that a forked worker does not: what a worker
#: proc has loaded when it reports ready and runs its first tensor-worker command.
PRELOAD: tuple[str, ...] = (
    "runpy",
    "uvloop",
    "palatine.cli",
    "palatine.cli.role",
    "palatine.cli.worker",
    "palatine.hosting.agent",
    "palatine.channel.net",
    "palatine.channel.net.rx",
    "palatine.channel.net.tx",
    "palatine.channel.local",
    "palatine.channel.tls",
    "palatine.channel.token",
    "palatine.hosting.heartbeat",
    "palatine.hosting.stacks",
    "palatine.tensor.worker",
    "palatine.tensor.worker.functions",
    "cloudpickle",
)

#: The server's end of the socket pair (an inherited fd) and the pid it dies with.
FD_VAR = Handoff.variable("fork_server_fd")
PARENT_VAR = Handoff.variable("parent_pid")
#: Largest message either side reads (a spawn request carries a whole environment).
MAX_MESSAGE_BYTES = 1024 * 1024
_READY_TIMEOUT_S = 30.0
_REPLY_TIMEOUT_S = 10.0
#: How long no spawn may have been asked for before the host warms its server.
WARM_AFTER_S = 0.2


class ForkServerError(Exception):
    """Raised by `ForkServer.spawn` when the server cannot start a worker (not started,
    gone, refused the fork); the caller execs the program instead."""


def _startup_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The variables an interpreter reads when it starts (changing them later is moot)."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(("PYTHON", "LD_", "MALLOC_")) or k == "GLIBC_TUNABLES"
    }


def fork_server_supported() -> bool:
    """Whether this platform has what the server needs (fork, pidfds, fd passing) and the
    ``fork_server`` config key is on."""
    return (
        config.get().fork_server
        and sys.platform.startswith("linux")
        and hasattr(os, "pidfd_open")
        and hasattr(socket, "send_fds")
    )


# --------------------------------------------------------------------------- host side


class ForkedProcess:
    """The host's handle on a worker the fork server started (`subprocess.Popen`'s part).

    ``returncode`` is set when the server reports the exit (negative: killed by that
    signal); ``lost`` when the server went away first, so the status will never be known.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.lost = False

    def poll(self) -> int | None:
        return self.returncode


class ForkServer:
    """The host's end of one fork server process; use it on the host's event loop.

    `start` launches the server (from the loop's thread, which the server's parent-death
    signal is tied to); `spawn` may be called at once and waits until the server is
    ready. One server may serve several `palatine.hosting.children.ChildProcs`; exits are routed
    by pid to the callback given to `spawn`.
    """

    def __init__(self, preload: Sequence[str] = PRELOAD, warm: Sequence[str] | None = None) -> None:
        self._preload = tuple(preload)
        self._popen: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[int] | None = None
        self._startup: dict[str, str] = {}
        self._executable = os.path.abspath(sys.executable)
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._on_exit_by_id: dict[int, Callable[[int | None], None]] = {}
        self._on_exit: dict[int, Callable[[int | None], None]] = {}
        self._closed = False
        if warm is None:
            warm = (config.get().fork_server_warm or "").split(",")
        self._warm = tuple(m.strip() for m in warm if m.strip())
        self._warm_timer: asyncio.TimerHandle | None = None
        #: The server has imported its warm modules (``{"op": "warmed"}``).
        self.warmed = False
        #: The warm modules being imported (asked for, not yet ``warmed``), if any.
        self.warming: tuple[str, ...] = ()

    @property
    def pid(self) -> int | None:
        """The server process's pid (None before `start`)."""
        return self._popen.pid if self._popen is not None else None

    @property
    def alive(self) -> bool:
        """Started, not closed, connection not lost."""
        return self._sock is not None and not self._closed

    def start(self) -> None:
        """Launch the server process (idempotent); it becomes ready in the background."""
        if self._popen is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._ready = loop.create_future()
        host_sock, server_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env[FD_VAR] = str(server_sock.fileno())
        env[PARENT_VAR] = str(os.getpid())
        self._startup = _startup_vars(env)
        code = f"from palatine.hosting.forkserver_main import main; main({list(self._preload)!r})"
        try:
            # Forked from the loop's thread on purpose (see palatine.hosting.children).
            self._popen = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                pass_fds=(server_sock.fileno(),),
            )
        except (OSError, subprocess.SubprocessError) as e:
            host_sock.close()
            self._fail_ready(f"cannot start the fork server: {e}")
            return
        finally:
            server_sock.close()
        host_sock.setblocking(False)
        self._sock = host_sock
        loop.add_reader(host_sock.fileno(), self._readable)
        log.debug("fork server started: pid %d", self._popen.pid)

    def accepts(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``argv`` run with ``env`` is a worker this server can fork."""
        if self._closed or self._popen is None:
            return False
        if len(argv) < 4 or list(argv[1:4]) != ["-m", "palatine", "worker"]:
            return False
        exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
        if exe is None or os.path.abspath(exe) != self._executable:
            return False
        return _startup_vars(env) == self._startup

    async def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        stdout_fd: int,
        stderr_fd: int,
        *,
        kill_group: bool,
        on_exit: Callable[[int | None], None],
    ) -> int:
        """Fork ``argv`` (see `accepts`) with ``env`` in ``cwd``; its pid.

        ``on_exit(returncode)`` is called on the loop once the worker is reaped, or with
        ``None`` if the server is lost first. Raises `ForkServerError` if no worker was
        started.
        """
        ready = self._ready
        if ready is None or self._closed:
            raise ForkServerError("the fork server is not running")
        if self.warming:  # no fork until the import ends: start cold now, not later
            raise ForkServerError(f"the fork server is still importing {', '.join(self.warming)}")
        try:
            async with asyncio.timeout(_READY_TIMEOUT_S):
                await asyncio.shield(ready)
        except TimeoutError:
            raise ForkServerError(
                f"the fork server was not ready within {_READY_TIMEOUT_S:g} s"
            ) from None
        except ForkServerError:
            raise
        sock = self._sock
        if sock is None or self._loop is None:
            raise ForkServerError("the fork server is gone")
        self._next_id += 1
        rid = self._next_id
        msg = {
            "op": "spawn",
            "id": rid,
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd,
            "kill_group": kill_group,
        }
        fut: asyncio.Future[int] = self._loop.create_future()
        self._pending[rid] = fut
        if self._warm_timer is not None:
            self._warm_timer.cancel()
            self._warm_timer = None
        try:
            socket.send_fds(sock, [json.dumps(msg).encode()], [stdout_fd, stderr_fd])
        except OSError as e:
            self._pending.pop(rid, None)
            raise ForkServerError(f"cannot reach the fork server: {e}") from None
        self._on_exit_by_id[rid] = on_exit
        try:
            async with asyncio.timeout(_REPLY_TIMEOUT_S):
                return await fut
        except TimeoutError:
            self._on_exit_by_id.pop(rid, None)
            raise ForkServerError(
                f"no answer from the fork server within {_REPLY_TIMEOUT_S:g} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
            if self._warm and not self._pending and self._loop is not None:
                self._warm_timer = self._loop.call_later(WARM_AFTER_S, self._send_warm)

    def warm_now(self) -> bool:
        """Have the server import its warm modules now rather than once the spawns have
        settled: for a launcher that knows its first procs need them (``palatine
        torchrun``: every rank imports torch). False when there is nothing to import
        (none configured, or asked for already)."""
        if self._warm_timer is not None:
            self._warm_timer.cancel()
        if not self._warm or self._sock is None:
            return False
        self._send_warm()
        return bool(self.warming)

    async def wait_warmed(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until the warm import has ended (`warm_now`);
        whether it has. A spawn meanwhile would be exec'd cold."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.warming and not self._closed:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return self.warmed

    def _send_warm(self) -> None:
        """Have the server import the warm modules (once): when the spawns have settled,
        or at once (`warm_now`)."""
        self._warm_timer = None
        modules, self._warm = self._warm, ()
        sock = self._sock
        if sock is None or self._closed or not modules:
            return
        with contextlib.suppress(OSError):  # a lost server is reported by its reader
            sock.send(json.dumps({"op": "warm", "modules": list(modules)}).encode())
            self.warming = modules
            log.debug("fork server warming: %s", ", ".join(modules))

    def signal(self, pid: int, sig: int) -> bool:
        """Have the server signal worker ``pid``'s process group; False if it cannot be asked."""
        sock = self._sock
        if sock is None or self._closed:
            return False
        try:
            sock.send(json.dumps({"op": "signal", "pid": pid, "sig": int(sig)}).encode())
        except OSError:
            return False
        return True

    async def close(self, timeout_s: float = 2.0) -> None:
        """Close the connection (the server kills what it still runs and exits); reap it.

        Workers still registered are reported lost (``on_exit(None)``).
        """
        if self._warm_timer is not None:
            self._warm_timer.cancel()
            self._warm_timer = None
        self._lost("")
        popen = self._popen
        if popen is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while popen.poll() is None:
                    await asyncio.sleep(0.01)
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(1.0)

    def kill_now(self) -> None:
        """SIGKILL the server process at once (interpreter exit); its workers die with it."""
        self._closed = True
        if self._popen is not None and self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGKILL)

    # -------------------------------------------------------------- messages

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(MAX_MESSAGE_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                log.warning("fork server connection failed: %s", e)
                data = b""
            if not data:
                self._lost("the fork server closed its connection")
                return
            try:
                self._on_message(json.loads(data))
            except Exception:
                log.exception("bad message from the fork server: %r", data[:200])

    def _on_message(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "exited":
            cb = self._on_exit.pop(int(msg["pid"]), None)
            if cb is not None:
                cb(msg.get("returncode"))
        elif op == "started":
            rid, pid = int(msg["id"]), int(msg["pid"])
            cb = self._on_exit_by_id.pop(rid, None)
            fut = self._pending.get(rid)
            if cb is None or fut is None or fut.done():
                # The requester gave up waiting: nobody would supervise this worker.
                self.signal(pid, signal.SIGKILL)
                return
            self._on_exit[pid] = cb
            fut.set_result(pid)
        elif op == "failed":
            rid = int(msg["id"])
            self._on_exit_by_id.pop(rid, None)
            fut = self._pending.get(rid)
            if fut is not None and not fut.done():
                fut.set_exception(ForkServerError(str(msg.get("reason"))))
        elif op == "warmed":
            self.warmed = True
            self.warming = ()
            log.debug("fork server warmed in %.2f s", msg.get("seconds", 0.0))
        elif op == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(int(msg["pid"]))
            log.debug("fork server %s ready", msg.get("pid"))

    def _fail_ready(self, reason: str) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ForkServerError(reason))
            self._ready.exception()  # retrieved: nobody may be waiting

    def _drop_connection(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            if self._loop is not None:
                try:
                    self._loop.remove_reader(sock.fileno())
                except Exception as e:  # noqa: BLE001 - a closed loop reads nothing
                    log.debug("removing the fork server's reader: %s", e)
            sock.close()
        self._fail_ready("the fork server is gone")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ForkServerError("the fork server is gone"))

    def _lost(self, reason: str) -> None:
        """The connection is gone (``reason``; empty when we closed it): so are its workers."""
        if reason and not self._closed:
            code = self._popen.poll() if self._popen is not None else None
            log.warning("%s (exit status %s); its workers are lost", reason, code)
        self._closed = True
        self._drop_connection()
        self._on_exit_by_id.clear()
        callbacks, self._on_exit = self._on_exit, {}
        for cb in callbacks.values():
            try:
                cb(None)
            except Exception:
                log.exception("fork server: exit callback failed")
