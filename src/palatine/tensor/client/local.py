"""`local_mesh` and `connect`: start or attach to a mesh of workers.

`local_mesh` starts ``palatine system``, ``hosts`` × ``palatine host`` and ``palatine
controller`` as real processes (the same code paths as the CLI), each holding a
lifeline pipe, then `connect`s. `connect` attaches a detached client proc to the
system, finds the worker world and its controller by their labels, waits until both
are Live (bounded), attaches, and builds the `DeviceMesh`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from palatine import config
from palatine.channel import sockets
from palatine.channel import token as token_mod
from palatine.channel.addr import ChannelAddr, require_addr
from palatine.config import roles
from palatine.config.roles import ControllerOptions, HostOptions, LocalOptions, SystemOptions
from palatine.core import runtime
from palatine.errors import DeviceException
from palatine.fastpath.blocking import BlockingConn, LinkLost, Stopped, Waiter
from palatine.fastpath.direct_tx import open_direct
from palatine.hosting.child_env import Handoff
from palatine.hosting.limits import check_open_files, mesh_open_files
from palatine.hosting.output import watch_output
from palatine.ids import ActorId, ProcId
from palatine.output.console import ConsoleWriter
from palatine.output.logs import LogSession
from palatine.protocol.controller import Attach, AttachRejected, AttachReply
from palatine.protocol.supervision import exit_text
from palatine.system.worlds import execution_id_from_env
from palatine.tensor.client.actor import ClientActor
from palatine.tensor.client.liveness import controller_lost
from palatine.tensor.client.mesh import DeviceMesh
from palatine.tensor.client.procs import RoleProcess, descendants, end_descendants
from palatine.tensor.client.session import Session
from palatine.tensor.client.shutdown import LocalRoles

__all__ = [
    "LocalCluster",
    "MeshOptions",
    "check_shape",
    "connect",
    "local_mesh",
    "mesh_options",
    "start_checked",
    "start_local",
]

log = logging.getLogger("palatine")

WORKER_LABEL = "world.palatine.dev/worker"
CONTROLLER_LABEL = "world.palatine.dev/controllerActorId"


class MeshOptions(NamedTuple):
    """The keyword arguments of `local_mesh` and `LocalJob`, by whom they are for (each
    declared once in `palatine.config.roles`, where their flags come from too)."""

    local: LocalOptions
    system: SystemOptions
    host: HostOptions
    controller: ControllerOptions


_MESH_KINDS = (LocalOptions, SystemOptions, HostOptions, ControllerOptions)


def mesh_options(caller: str, options: Mapping[str, Any]) -> MeshOptions:
    """``options`` checked and sorted: a key goes to every role that declares it, by its
    Python name (seconds end in ``_s``) or its alias (``_in_sec``, the flag's spelling).
    An unknown key, or both spellings of one, is a `TypeError` naming it and the allowed
    ones; a value of the wrong type a `TypeError`, one out of bounds a `ValueError`."""
    values = roles.sort_kwargs(caller, options, _MESH_KINDS)
    return MeshOptions(
        roles.build(caller, LocalOptions, values),
        roles.build(caller, SystemOptions, values),
        roles.build(caller, HostOptions, values),
        roles.build(caller, ControllerOptions, values),
    )


#: What the fork servers of a local mesh's hosts import once the spawns have settled
#: (``fork_server_warm``): torch, and torch._dynamo, which building the first optimizer
#: imports (≈ 1.4 s and 1 s of CPU here), so that a respawned rank pays for neither.
TENSOR_WARM = "torch,torch._dynamo"


#: How long the end of the controller's process waits for the other roles still running
#: to be seen ended too, when they were killed with it (a few milliseconds if so).
ROLES_SETTLE_S = 0.1


class LocalCluster:
    """The processes a `local_mesh` started, their log directory and console, torn down on `stop`.

    Every role's output is drained for as long as it runs (`RoleProcess`): into
    ``<logs>/<role>.log``, and what is meant for a person (a program's output, warnings,
    errors) onto this process's stderr through one `ConsoleWriter`, which never blocks a
    role: a console that does not keep up loses lines, counted, never the log files.

    It also keeps the system: when ``palatine system`` ends while the job runs, it is
    started again at the same address, with the same token and execution id, up to
    ``system_restarts`` times (`palatine.config.Config`), and the running hosts, procs
    and controller rejoin it. Without a restart left, or when the new one does not come
    up, ``on_system_lost`` is told at once: its parent sees the exit as it happens,
    which no heartbeat can match.

    A system that runs but no longer answers (stopped, stuck, swapping) is treated as a
    dead one: a thread probes it (`SystemProbe`: a token handshake, which its event loop
    must answer), and one silent for `system_probe_timeout_s` is killed, so that it is
    started again as above. That bound is well inside the procs' own
    (``system_loss_timeout``, after which they stop themselves): the restart and their
    rejoining come first, and the job goes on as after a SIGKILL.

    The controller cannot be started again: when its process ends while the job runs,
    ``on_controller_lost`` is told at once, whatever else ended with it (a lost node, the
    OOM killer), and both tellings name the roles found ended by then (`ended_roles`).
    """

    owns_worlds = True  # (`LocalRoles`: its session stops the system and every world)

    def __init__(
        self,
        env: dict[str, str],
        logs: LogSession,
        system_restarts: int | None = None,
        system_loss_s: float | None = None,
    ) -> None:
        self.env = env
        #: how long the job's procs go on without an answer from the system
        #: (``system_loss_timeout`` at their heartbeat interval): a restart must come first
        self.system_loss_s = (
            config.system_loss_timeout_s() if system_loss_s is None else system_loss_s
        )
        self.logs = logs
        self.dashboard_url = ""  # the web dashboard's link (local_mesh(dashboard=True))
        self.console = ConsoleWriter(
            limit_bytes=config.get().console_buffer_bytes, complete_in=f"the logs in {logs.path}"
        )
        self.procs: list[RoleProcess] = []
        self.system_addr = ""
        self.system: RoleProcess | None = None
        self.restarts_left = (
            config.get().system_restarts if system_restarts is None else system_restarts
        )
        #: (pid that ended, how, pid of its successor or None, seconds to restart)
        self.system_restarts: list[tuple[int, str, int | None, float]] = []
        #: told (on a launcher thread) why the system is gone for good
        self.on_system_lost: Callable[[str, int, int | None], None] | None = None
        #: told (on a launcher thread) how the controller's process ended while the job ran
        self.on_controller_lost: Callable[[str, int, int], None] | None = None
        self._system_args: list[str] = []
        self._startup_s = 60.0
        #: guards `_stopping`, `_ended`, `restarts_left` and a restart's change of `system`
        #: and `procs` (pump threads), so no restart adds a proc once `stop` has begun
        self._lock = threading.Lock()
        self._stopping = False
        self._ended: set[int] = set()  # pids of systems whose end was handled
        #: pid of a system killed for its silence -> what it did (for its restart's record)
        self._stalled: dict[int, str] = {}
        self._probe: SystemProbe | None = None

    def start_system(self, role_args: list[str], timeout_s: float) -> RoleProcess:
        """Start the system role and keep it (see the class)."""
        self._system_args = role_args
        self._startup_s = timeout_s
        self.system = self.start(role_args, timeout_s, "system", on_exit=self._system_ended)
        self.system_addr = self.system.addr
        self._probe = SystemProbe(self, system_probe_timeout_s(self.system_loss_s))
        return self.system

    def current_system(self) -> RoleProcess | None:
        """The running system (None once `stop` has begun); a restarted one once it is up."""
        with self._lock:
            return None if self._stopping else self.system

    def system_stalled(self, rp: RoleProcess, silent_s: float, limit_s: float) -> None:
        """``rp`` answered no liveness probe for ``silent_s``: kill it (on the probe's
        thread); its end is then handled as any (`_system_ended`): started again."""
        how = (
            f"did not answer a liveness probe for {silent_s:.1f} s (limit "
            f"{config.format_seconds(limit_s)} s, {config.env_var('system_probe_timeout_s')}); "
            "killed it (SIGKILL)"
        )
        with self._lock:
            if self._stopping or rp is not self.system or rp.popen.poll() is not None:
                return
            if self.restarts_left <= 0:  # a kill would end the job; it may yet answer
                if rp.pid not in self._stalled:
                    log.warning(
                        "the system at %s (pid %d) has not answered a liveness probe for "
                        "%.1f s, and no restart is left",
                        self.system_addr,
                        rp.pid,
                        silent_s,
                    )
                self._stalled[rp.pid] = how
                return
            self._stalled[rp.pid] = how
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rp.pid, signal.SIGKILL)  # (not rp.kill: its end must be seen)

    def _system_ended(self, rp: RoleProcess, code: int) -> None:
        """The system ended by itself (on its pump's thread): start it again, or tell."""
        how = exit_text(None if code < 0 else code, -code if code < 0 else None)
        with self._lock:
            how = self._stalled.pop(rp.pid, how)
            if self._stopping or rp is not self.system or code == 0 or rp.pid in self._ended:
                return  # (0: it was asked to stop, which its procs hear from it)
            self._ended.add(rp.pid)
            if self.restarts_left <= 0:
                self.system_restarts.append((rp.pid, how, None, 0.0))
                self._lost(f"the system at {self.system_addr} (pid {rp.pid}) {how}", rp.pid, code)
                return
            self.restarts_left -= 1
            t0 = time.monotonic()
            args = list(self._system_args)
            args[args.index("--system-addr") + 1] = self.system_addr
            try:
                new = self._start_role(args, "system", self._system_ended, wait=False)
            except (OSError, RuntimeError) as e:
                self._lost(
                    f"the system at {self.system_addr} (pid {rp.pid}) {how}, and it could not "
                    f"be started again: {e}",
                    rp.pid,
                    code,
                )
                return
            self.procs.append(new)  # (`stop` ends it; it is not `system` until it is up)
        try:
            # The procs give up on a lost system after the loss timeout: no use after it.
            new.wait_ready(min(self._startup_s, self.system_loss_s))
        except RuntimeError as e:
            with self._lock:
                if self._stopping:
                    return
                self.system_restarts.append((rp.pid, how, None, time.monotonic() - t0))
                self._lost(
                    f"the system at {self.system_addr} (pid {rp.pid}) {how}, and it did not "
                    f"start again: {e}",
                    rp.pid,
                    code,
                )
            return
        took = time.monotonic() - t0
        with self._lock:
            if self._stopping:
                return
            self.system = new
        self.system_restarts.append((rp.pid, how, new.pid, took))
        log.warning(
            "the system at %s (pid %d) %s; started it again as pid %d in %.2f s: the job's "
            "procs rejoin it",
            self.system_addr,
            rp.pid,
            how,
            new.pid,
            took,
        )
        ended = new.popen.poll()
        if ended is not None:  # it ended before it was the system: its exit was not seen
            self._system_ended(new, ended)

    def _lost(self, text: str, pid: int, code: int) -> None:
        tell = self.on_system_lost
        if tell is None:
            log.error("%s", text)
            return
        tell(text, pid, code)

    def controller_ended(self, rp: RoleProcess, code: int) -> None:
        """The controller's process ended by itself (on its pump's thread): the job
        cannot go on without it; tell ``on_controller_lost`` at once, unless the mesh is
        being stopped."""
        with self._lock:
            if self._stopping:
                return
        tell = self.on_controller_lost
        if tell is None:
            return
        # Roles killed with it (a lost node, the OOM killer) are ending too: let them, so
        # that the telling names them.
        deadline = time.monotonic() + ROLES_SETTLE_S
        while time.monotonic() < deadline and any(
            other.popen.poll() is None for other in list(self.procs) if other is not rp
        ):
            time.sleep(0.01)
        how = exit_text(None if code < 0 else code, -code if code < 0 else None)
        tell(f"its process (pid {rp.pid}) {how}", rp.pid, code)

    def ended_roles(self, but: int) -> list[str]:
        """The roles of this mesh but pid ``but`` found ended now, each with its pid and
        how it ended (``host-0 (pid 41) killed by signal 9 (SIGKILL)``), and a system's
        successor when it was started again. It takes no lock (the keeper of the system
        calls it with `_lock` held): copies of the lists are read."""
        procs = list(self.procs)
        restarted = {old: new for old, _, new, _ in list(self.system_restarts) if new}
        out = []
        for rp in procs:
            code = rp.popen.poll()
            if rp.pid == but or code is None:
                continue
            name = os.path.basename(rp.log_path or "role")[: -len(".log")] or "role"
            how = exit_text(None if code < 0 else code, -code if code < 0 else None)
            again = f", started again as pid {restarted[rp.pid]}" if rp.pid in restarted else ""
            out.append(f"{name} (pid {rp.pid}) {how}{again}")
        return out

    def _start_role(
        self,
        role_args: list[str],
        name: str,
        on_exit: Callable[[RoleProcess, int], None] | None,
        wait: bool,
        timeout_s: float | None = None,
    ) -> RoleProcess:
        return RoleProcess(
            role_args,
            self.env,
            self._startup_s if timeout_s is None else timeout_s,
            die_with_parent=False,
            log_path=self.logs.file(f"{name}.log"),
            console=self.console,
            wait=wait,
            on_exit=on_exit,
        )

    def start(
        self,
        role_args: list[str],
        timeout_s: float,
        name: str,
        wait: bool = True,
        on_exit: Callable[[RoleProcess, int], None] | None = None,
    ) -> RoleProcess:
        """Start one role; with ``wait`` (else see `wait_ready`) return once it is ready."""
        try:
            rp = self._start_role(role_args, name, on_exit, wait, timeout_s)
        except RuntimeError as e:
            self.stop(1.0, clean=False)
            raise RuntimeError(f"local mesh failed to start: {e}") from None
        self.procs.append(rp)
        return rp

    def wait_ready(self, procs: list[RoleProcess], timeout_s: float) -> None:
        """Wait for the ready lines of roles started together (``start(wait=False)``)."""
        deadline = time.monotonic() + timeout_s
        for rp in procs:
            try:
                rp.wait_ready(max(0.1, deadline - time.monotonic()))
            except RuntimeError as e:
                self.stop(1.0, clean=False)
                raise RuntimeError(f"local mesh failed to start: {e}") from None

    def stop(self, grace_s: float = 5.0, *, clean: bool = True) -> None:
        """Stop every role; remove the logs after a ``clean`` run, else keep them and say where."""
        with self._lock:
            self._stopping = True
        if self._probe is not None:
            self._probe.stop()
        started = descendants(self.procs)
        for rp in reversed(self.procs):
            if rp.popen.poll() is None:
                try:
                    rp.popen.send_signal(15)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for rp in reversed(self.procs):
            try:
                rp.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                pass
            rp.kill()
        self.procs.clear()
        # Workers die with their host, a moment after it; their files go once they have.
        end_descendants(started, max(1.0, deadline - time.monotonic()))
        sockets.sweep()  # the socket files of its procs that died where nobody alive saw it
        self.console.close(1.0)
        if self.logs.owned and self.logs.path.exists():
            if not clean:
                log.warning("the logs of this mesh are kept in %s", self.logs.path)
            self.logs.close(clean=clean)


def system_probe_timeout_s(system_loss_s: float) -> float:
    """`Config.system_probe_timeout_s`, or by default a quarter of the procs'
    ``system_loss_s``, from 0.5 to 3 s: room for a restart (a second or two) and their
    rejoining before they give up, without taking a loaded machine's pause for a stall."""
    configured = config.get().system_probe_timeout_s
    if configured is not None:
        return configured
    return max(0.5, min(3.0, system_loss_s / 4))


#: How a dial fails where nobody listens (tcp, unix path): the probed system is ending.
_REFUSED = frozenset(os.strerror(code) for code in (errno.ECONNREFUSED, errno.ENOENT))


class SystemProbe:
    """A thread that checks a `LocalCluster`'s running system answers, and has a silent
    one killed (`LocalCluster.system_stalled`).

    A probe dials the system and completes the token handshake, which the system's event
    loop must answer: a stopped or stuck system accepts the connection (its kernel does)
    but never answers. Probes run every quarter of the bound (0.2 s at least); the system
    is stalled when none has been answered for the whole bound. A refused connection is
    no silence: the system no longer listens because it is ending (its exit is handled
    as any). Nothing else is sent: the system logs nothing for a probe. A restarted
    system is watched from when it is up.
    """

    def __init__(self, cluster: LocalCluster, limit_s: float) -> None:
        self._cluster = cluster
        self.limit_s = limit_s
        self._token = os.fsencode(cluster.env["PALATINE_CLUSTER_TOKEN"])
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="palatine-system-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (idempotent); any probe or wait is interrupted at once."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _run(self) -> None:
        waiter = Waiter(self._stop, self._wake_r)
        try:
            self._watch(waiter)
        except Stopped:
            pass
        finally:
            waiter.close()
            self._wake_r.close()
            self._wake_w.close()

    def _watch(self, waiter: Waiter) -> None:
        period = max(0.2, self.limit_s / 4)
        watched: RoleProcess | None = None
        answered = time.monotonic()
        while True:
            waiter.wait(None, 0, time.monotonic() + period)
            rp = self._cluster.current_system()
            if rp is None:
                return
            if rp is not watched:  # the first, or a restarted one: it has just come up
                watched, answered = rp, time.monotonic()
            if rp.popen.poll() is not None:
                continue  # ended: its exit is handled (and it is started again) elsewhere
            if self._answers(waiter, ChannelAddr.parse(rp.addr), answered + self.limit_s):
                answered = time.monotonic()
            elif time.monotonic() - answered >= self.limit_s:
                self._cluster.system_stalled(rp, time.monotonic() - answered, self.limit_s)
                watched = None  # (it ends now; its successor is watched once up)

    def _answers(self, waiter: Waiter, addr: ChannelAddr, deadline: float) -> bool:
        """Whether the system at ``addr`` completes a handshake before ``deadline``, or
        refuses the connection (an answer too: nobody listens there any more)."""
        now = time.monotonic()
        try:
            conn = BlockingConn.connect(
                addr,
                waiter,
                token=self._token,
                ssl_context=None,  # (a local mesh serves unix or tcp)
                max_frame_bytes=config.get().max_frame_bytes,
                connect_timeout_s=max(0.0, deadline - now),
                auth_timeout_s=max(0.0, deadline - now),
                limit=max(now, deadline),
            )
        except LinkLost as e:
            log.debug("liveness probe of the system at %s: %s", addr, e.reason)
            return e.reason in _REFUSED
        conn.close()
        return True


def local_mesh(hosts: int = 1, procs_per_host: int = 4, **options: Any) -> DeviceMesh:
    """Start system, hosts, controller and workers as real processes; a `DeviceMesh`.

    What the workers print, and the roles' warnings and errors, appear on this process's
    stderr; everything (palatine's own INFO lines too) is in the mesh's log directory:
    ``log_dir`` when given (kept), else a fresh directory under ``PALATINE_LOG_DIR`` (by
    default ``palatine-logs`` in the temp dir) that is removed when the mesh ends cleanly
    and kept, with a warning naming it, when it fails (`palatine.output.logs`).

    ``options`` are those of `MeshOptions` (`palatine.config.roles` declares each once):
    seconds end in ``_s`` (``operation_timeout_s=60``), and the command line's spelling
    (``operation_timeout_in_sec``) is accepted for the same option.
    """
    check_shape(hosts, procs_per_host)
    opts = mesh_options("local_mesh", options)
    cluster = start_checked(hosts, procs_per_host, opts)
    try:
        mesh = connect(
            cluster.system_addr,
            "worker",
            timeout_s=opts.local.startup_timeout_s,
            _local=cluster,
            _token=cluster.env["PALATINE_CLUSTER_TOKEN"],
        )
    except BaseException:
        cluster.stop(1.0, clean=False)
        raise
    if sys.stderr.isatty():  # the id for --job, once, to a person (a pipe stays quiet)
        print(f"palatine: job {mesh.job_id} (palatine ps; palatine top --job {mesh.job_id})",
              file=sys.stderr, flush=True)  # fmt: skip
    if cluster.dashboard_url:  # asked for: said wherever stderr goes (a notebook's too)
        print(f"palatine: dashboard {cluster.dashboard_url}", file=sys.stderr, flush=True)
    return mesh


# What one controller takes (its --world-size and --num-procs-per-host bounds).
MAX_PROCS_PER_HOST = 4096
MAX_WORLD_SIZE = 1 << 20


def check_shape(hosts: Any, procs_per_host: Any) -> None:
    """A `ValueError` naming the argument and its allowed range, before anything starts."""
    for name, value, top in (
        ("hosts", hosts, MAX_WORLD_SIZE),
        ("procs_per_host", procs_per_host, MAX_PROCS_PER_HOST),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int from 1 to {top}, not {value!r}")
        if not 1 <= value <= top:
            raise ValueError(f"{name} must be from 1 to {top}, got {value}")
    if hosts * procs_per_host > MAX_WORLD_SIZE:
        raise ValueError(
            f"hosts × procs_per_host must be at most {MAX_WORLD_SIZE}, got "
            f"{hosts} × {procs_per_host} = {hosts * procs_per_host}"
        )


def start_local(hosts: int = 1, procs_per_host: int = 4, **options: Any) -> LocalCluster:
    """Start system, hosts and controller (the controller creates the workers) and wait
    until the worker world is up; the processes, not yet attached to (`connect` does).

    `local_mesh` is this and `connect`; `palatine.job.LocalJob` and ``palatine launch
    --scheduler local`` start here and let a client attach later.
    """
    check_shape(hosts, procs_per_host)
    return start_checked(hosts, procs_per_host, mesh_options("local_mesh", options))


def start_checked(hosts: int, procs_per_host: int, opts: MeshOptions) -> LocalCluster:
    """`start_local` with its shape and options already checked (`check_shape`,
    `mesh_options`), by a caller that needs them itself."""
    cuda = want_cuda(opts.local.device)
    transport = opts.local.transport
    startup = opts.local.startup_timeout_s
    check_open_files(
        mesh_open_files(hosts, procs_per_host), f"a mesh of {hosts * procs_per_host} procs"
    )
    logs = LogSession.create("mesh", opts.local.log_dir)
    sockets.sweep()  # what jobs before this one left, where nobody saw their procs die
    # Every role and worker writes its logs there (roles: <role>.log; workers: see palatine.output.logs).
    # The process's private token (a this_host() cluster of this process has it too).
    env = {"PALATINE_CLUSTER_TOKEN": token_mod.private_token(), "PALATINE_LOG_DIR": str(logs.path)}
    # One execution id for every role, so that a system started again keeps it.
    env.update(Handoff(execution_id=execution_id_from_env()).to_env())
    # (for the job's record, which its system writes: palatine.job.records.SHAPE_ENV)
    env["PALATINE_JOB_SHAPE"] = f"{hosts}x{procs_per_host}"
    if "OMP_NUM_THREADS" not in os.environ:
        # Several workers share this machine's cores: one intra-op thread pool per core.
        env["OMP_NUM_THREADS"] = str(
            max(1, (os.cpu_count() or 1) // max(1, hosts * procs_per_host))
        )
    # A respawned rank (mesh.recover) starts with torch and what the first optimizer
    # imports already loaded: the hosts' fork servers import them once spawns settle.
    if config.env_var("fork_server_warm") not in os.environ:  # (set but empty: none)
        env[config.env_var("fork_server_warm")] = TENSOR_WARM
    # CPU workers import torch on first use, not before they join (PALATINE_PRELOAD=torch
    # restores that); CUDA workers need it at once to pick their device.
    if cuda:
        import torch

        if config.get().preload is None:
            env["PALATINE_PRELOAD"] = "torch"
        env.update(Handoff(devices_per_host=torch.cuda.device_count()).to_env())
    if transport == "unix":
        addr = f"unix:@palatine-{os.getpid()}-{secrets.token_hex(4)}"
    elif transport == "tcp":
        addr = "tcp:127.0.0.1:0"
    else:
        raise ValueError(f"transport must be 'unix' or 'tcp', not {transport!r}")
    # (the hosts hand their heartbeat interval to the procs)
    loss_s = config.system_loss_timeout_s(interval_s=opts.host.supervision_update_interval_s)
    cluster = LocalCluster(env, logs, opts.local.system_restarts, loss_s)
    try:
        system = cluster.start_system(
            ["system", "--system-addr", addr, *roles.to_argv(opts.system)], startup
        )
        # Hosts and the controller start together: the world the controller creates waits
        # for its hosts, and their start-up (interpreter, imports, fork server) overlaps.
        starting = [
            cluster.start(
                [
                    "host",
                    "--system-addr",
                    system.addr,
                    "--host-world",
                    "hostworker",
                    "--host-rank",
                    str(h),
                    *roles.to_argv(opts.host),
                ],
                startup,
                f"host-{h}",
                wait=False,
            )
            for h in range(hosts)
        ]
        program = f"{sys.executable} -m palatine worker"
        ctl = [
            "controller",
            "--worker-world",
            "worker",
            "--system-addr",
            system.addr,
            "--world-size",
            str(hosts * procs_per_host),
            "--num-procs-per-host",
            str(procs_per_host),
            "--program",
            program,
            *roles.to_argv(opts.controller),
        ]
        if not cuda:
            ctl.append("--is-cpu-worker")
        starting.append(
            cluster.start(ctl, startup, "controller", wait=False, on_exit=cluster.controller_ended)
        )
        cluster.wait_ready(starting, startup)
        if opts.local.dashboard or opts.local.dashboard_addr:  # its link: docs/dashboard.md
            from palatine.system.dashboard import role_args

            argv = role_args(system.addr, logs.path, opts.local.dashboard_addr)
            cluster.dashboard_url = cluster.start(argv, startup, "dashboard").addr
        return cluster
    except BaseException:
        cluster.stop(1.0, clean=False)
        raise


def want_cuda(device: str) -> bool:
    """Whether workers asked to run on ``device`` (``auto``, ``cpu``, ``cuda``) use CUDA:
    ``auto`` when this machine has a GPU torch can use; ``cuda`` without one is a
    `ValueError`."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', not {device!r}")
    if device == "cpu":
        return False
    if device == "auto" and "torch" not in sys.modules and not _gpu_device_nodes():
        return False  # no GPU driver here: spare the client the ~2 s torch import
    try:
        import torch

        has = bool(torch.cuda.is_available())
    except ImportError:
        has = False
    if device == "cuda" and not has:
        raise ValueError("device='cuda' but no CUDA device is available")
    return has


def _gpu_device_nodes() -> bool:
    """Whether this machine exposes a GPU driver (NVIDIA or ROCm device nodes).

    Without one ``torch.cuda.is_available()`` is False whatever torch build is installed.
    """
    return any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
    )


def connect(
    system_addr: str | ChannelAddr | None = None,
    worker_world: str | None = None,
    *,
    timeout_s: float | None = None,
    timeout: float | None = None,
    _local: LocalCluster | None = None,
    _token: str | None = None,
    _dims: list[tuple[str, int]] | None = None,
    _roles: LocalRoles | None = None,
    _controller: ActorId | None = None,
) -> DeviceMesh:
    """Attach to the controller of a running worker world; its `DeviceMesh`.

    With no ``system_addr``, the job that ``palatine launch`` runs this program in: the
    system address and worker world it hands over (``PALATINE_SYSTEM_ADDR``,
    ``PALATINE_WORKER_WORLD``, with the cluster token in ``PALATINE_CLUSTER_TOKEN``).
    ``system_addr`` is a `ChannelAddr` (a `SystemHandle.addr`) or its text.
    ``timeout_s`` (default 60; ``timeout`` is its older name) bounds attaching.
    """
    wait_s = roles.renamed("connect", "timeout_s", timeout_s, "timeout", timeout)
    wait_s = 60.0 if wait_s is None else wait_s
    if system_addr is None:
        handed = Handoff.from_env()
        if not handed.system_addr:
            raise ValueError(
                "connect() needs a system address: pass system_addr=, or run the program "
                "under 'palatine launch', which sets PALATINE_SYSTEM_ADDR"
            )
        system_addr = handed.system_addr
        worker_world = worker_world or handed.worker_world or None
    if _token is not None:
        token_mod.set_token(_token)
    # (text from the caller or the handoff, parsed here once)
    addr = ChannelAddr.parse(system_addr) if isinstance(system_addr, str) else system_addr
    require_addr(addr, "connect(system_addr=)")
    if _controller is None:
        session = runtime.submit(lambda: _connect(addr, worker_world, wait_s)).get()
    else:
        session = runtime.submit(lambda: _connect(addr, worker_world, wait_s, _controller)).get()
    if _local is not None:
        session.controller_log = _local.logs.file("controller.log")
        _local.on_system_lost = _system_lost_to(session, _local)
        _local.on_controller_lost = _controller_lost_to(session, _local)
        session.launcher_watches_controller = True
    world = session.world_size
    per = session.per_host if session.per_host and world % session.per_host == 0 else world
    roles_ = _local if _local is not None else _roles
    if _dims is not None:  # the dims of the actor proc mesh it runs on (spawn_tensor_engine)
        mesh = DeviceMesh(session, [n for n, _ in _dims], [k for _, k in _dims], local=roles_)
    else:
        mesh = DeviceMesh(session, ["host", "proc"], [world // per, per], local=roles_)
    session.root_mesh = mesh
    mesh.stream("main")
    return mesh


def _system_lost_to(
    session: Session, cluster: LocalCluster
) -> Callable[[str, int, int | None], None]:
    """What a local mesh's keeper calls when its system is gone for good: the session
    fails at once with ``system_lost``, naming the system's pid and how it ended."""

    def lost(text: str, pid: int, code: int | None) -> None:
        where = f" (its log: {cluster.logs.file('system.log')})"
        exc = DeviceException(
            f"{text}; the job can no longer be supervised{where}{_also_ended(cluster, pid)}",
            "system_lost",
            proc_id="system[0]",
            pid=pid,
            exit_code=code if code is not None and code >= 0 else None,
            exit_signal=-code if code is not None and code < 0 else None,
            reason=text,
        )
        _fail_soon(session, exc)

    return lost


def _controller_lost_to(session: Session, cluster: LocalCluster) -> Callable[[str, int, int], None]:
    """What a local mesh's keeper calls when the controller's process ends under a running
    job: the session fails at once with ``controller_lost``, naming its pid and how it
    ended (the launcher sees the exit before any heartbeat or the system could)."""

    def lost(text: str, pid: int, code: int) -> None:
        if session.detached or session.closed:
            return  # the session ended it: leaving stops the controller's world
        exc = controller_lost(
            session,
            text,
            also=_also_ended(cluster, pid),
            pid=pid,
            exit_code=code if code >= 0 else None,
            exit_signal=-code if code < 0 else None,
        )
        _fail_soon(session, exc)

    return lost


def _also_ended(cluster: LocalCluster, pid: int) -> str:
    """``; also ended: ...``: the mesh's other roles found ended with ``pid``'s (as a
    lost node or the OOM killer would end them), or nothing."""
    also = cluster.ended_roles(but=pid)
    return f"; also ended: {', '.join(also)}" if also else ""


def _fail_soon(session: Session, exc: DeviceException) -> None:
    """Fail ``session`` with ``exc`` on its loop (from a launcher thread)."""
    with contextlib.suppress(RuntimeError):  # (its loop has ended: nobody to tell)
        session.loop.call_soon_threadsafe(session.fail, exc)


async def _connect(
    system_addr: ChannelAddr,
    worker_world: str | None,
    timeout: float,
    controller_id: ActorId | None = None,
) -> Session:
    from palatine.system.service import System

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    client = await System(system_addr).attach(timeout_s=timeout)
    session: Session | None = None
    try:
        world, controller, hosts = await _find_worlds(
            client, system_addr, worker_world, deadline, timeout, controller_id
        )
        actor = ClientActor()
        await client.proc.spawn_instance("client_actor", actor, internal=True)
        reply = await client.mailbox.ask(
            controller, Attach(client=actor.cx.actor_id), config.get().rpc_timeout_s
        )
        if isinstance(reply, AttachRejected):
            raise RuntimeError(f"controller {controller} refused the attach: {reply.message}")
        assert isinstance(reply, AttachReply)
        session = Session(
            controller=reply.controller_actor_id,
            client_actor=actor,
            world_size=reply.world_size,
            per_host=reply.num_procs_per_host,
            worker_world=str(reply.worker_world),
            worker_name=reply.worker_name,
            liveness_timeout_s=reply.client_liveness_timeout_s,
            system_client=client,
            loop=loop,
        )
        session.direct = await open_direct(client.proc, reply.controller_actor_id)
        await watch_output(client.proc, client.mailbox, world, hosts)
        session.start_keepalive()
        session.watch_controller(client.proc, reply.controller_actor_id.proc)
        return session
    except BaseException:
        try:
            if session is not None and session.direct is not None:
                await session.direct.aclose(1.0)
        except Exception as e:  # noqa: BLE001 - the attach error is the one to raise
            log.debug("attach failed; closing its direct session: %s", e)
        finally:
            await client.close()
        raise


async def _find_worlds(
    client: Any,
    addr: ChannelAddr,
    wanted: str | None,
    deadline: float,
    timeout: float,
    controller_id: ActorId | None = None,
) -> tuple[str, ActorId, list[ProcId]]:
    """The worker world, its controller and the hosts its procs run on, once both worlds
    are Live. ``controller_id``: the controller is known (an engine on an actor proc
    mesh, whose world carries no worker labels)."""
    loop = asyncio.get_running_loop()
    last = "no worker world"
    while True:
        if controller_id is not None and wanted is not None:
            snap = await client.snapshot(worlds=[wanted])
        else:
            snap = await client.snapshot(world_labels={WORKER_LABEL: "1"})
        names = [w for w in snap.worlds if wanted is None or w == wanted]
        if wanted is None and len(names) > 1:
            raise ValueError(
                f"several worker worlds at {addr}: {sorted(names)}; pass worker_world="
            )
        if names:
            name = names[0]
            w = snap.worlds[name]
            cid = (
                str(controller_id) if controller_id is not None else w.labels.get(CONTROLLER_LABEL)
            )
            ctl_status = "absent"
            if cid:
                controller = ActorId.parse(cid)
                csnap = await client.snapshot(worlds=[controller.proc.world.name])
                cw = csnap.worlds.get(controller.proc.world.name)
                ctl_status = cw.status if cw is not None else "absent"
                if w.status == "Live" and ctl_status == "Live":
                    hosts = {p.host_proc for p in w.procs.values() if p.host_proc}
                    return name, controller, [ProcId.parse(h) for h in sorted(hosts)]
            joined = sum(1 for p in w.procs.values() if p.health == "Alive")
            last = (
                f"{name}: {w.status} {joined}/{len(w.procs) or '?'} procs; controller: {ctl_status}"
            )
        if loop.time() > deadline:
            raise TimeoutError(
                f"no Live worker world {wanted or '(any)'!r} with a Live controller at {addr} "
                f"after {timeout:g} s ({last})"
            )
        await asyncio.sleep(0.02)
