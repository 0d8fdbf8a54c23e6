"""Hosts: the proc agent of ``hostW[h]`` that starts and watches world W's procs.

A host receives ``SpawnProc`` from the system. ``Exec`` worlds: one child process per
proc (`palatine.hosting.children`; ``python -m palatine worker`` procs are forked by the host's
fork server, `palatine.hosting.forkserver`, started with the host), every exit reported to the system **at once** as
``ProcExited`` (retried until acknowledged). ``Local`` worlds: the procs are bootstrapped
inside the host's own process and share its loop. Children are killed when the host
stops, on ``KillProcs`` and on ``ProcStop``; they also die with the host through the
parent-death signal.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from typing import Any

from palatine import config
from palatine.channel import token as token_mod
from palatine.channel.addr import ChannelAddr
from palatine.core.actor import handler
from palatine.errors import SpawnError
from palatine.hosting.agent import MANAGED, ProcAgent, ProcHandle, bootstrap_proc
from palatine.hosting.child_env import child_env, log_path_for, stack_path_for
from palatine.hosting.children import Child, ChildProcs
from palatine.hosting.forkserver import ForkServer
from palatine.hosting.output import OutputFanout
from palatine.ids import SYSTEM_ACTOR, ProcId, WorldId, is_host_world, served_world_of
from palatine.protocol.agent import (
    HostStarted,
    KilledProcs,
    KillProc,
    KillProcs,
    OutputWatched,
    ProcSnapshot,
    ProcSnapshotRequest,
    ProcStop,
    SpawnProc,
    SpawnProcResult,
    StackDump,
    StackTrace,
    StartHost,
    StopHost,
    WatchOutput,
)
from palatine.protocol.system import (
    ChildProc,
    Exec,
    FailedProc,
    ProcAssignment,
    ProcExited,
    StartedProc,
    UpsertWorld,
)

__all__ = ["HostAgent", "join_host"]

log = logging.getLogger(__name__)


class HostAgent(ProcAgent):
    """The agent of a host proc: `ProcAgent` plus SpawnProc / KillProcs / child stacks."""

    __palatine_name__ = "palatine.hosting.host.HostAgent"

    def __init__(
        self,
        *args: Any,
        fork_server: ForkServer | None = None,
        log_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # Where the procs' logs go: the job's log directory, else the configured one.
        self.log_dir = log_dir
        self.children = ChildProcs(on_exit=self._child_exited, fork_server=fork_server)
        self.output = OutputFanout()  # workers' output for clients that watch it
        self.local_procs: dict[ProcId, ProcHandle] = {}
        # Hosts of other host worlds started in this process (`StartHost`), by world.
        self.more_hosts: dict[WorldId, ProcHandle] = {}
        self._reports: set[asyncio.Task[None]] = set()

    async def init(self) -> None:
        # Without a shared fork server, start ours now: its imports overlap the join and
        # whatever comes before the first SpawnProc.
        self.children.start_fork_server()
        self.output.bind(self.cx.mailbox, str(self.cx.actor_id.proc))
        self.children.forward = self.output.take
        await super().init()

    @handler
    def on_watch_output(self, msg: WatchOutput) -> OutputWatched:
        """Send a world's output to a client's sink (`palatine.hosting.output`)."""
        self.output.watch(msg.world, msg.sink, msg.max_bytes, msg.level)
        log_dir = self.log_dir if self.log_dir is not None else config.get().log_dir
        return OutputWatched(host=self.proc.proc_id, log_dir=str(log_dir))

    # ------------------------------------------------------------ spawning
    @handler
    async def on_spawn_proc(self, msg: SpawnProc) -> SpawnProcResult:
        me = self.proc.proc_id
        served = served_world_of(me.world)
        if msg.world_id == me.world:
            raise SpawnError(f"host {me} refused to spawn: {msg.world_id} is the host's own world")
        if msg.world_id != served:
            raise SpawnError(f"host {me} refused to spawn: it serves {served}, not {msg.world_id}")
        for a in msg.procs:
            if a.proc_id.world != msg.world_id:
                raise SpawnError(
                    f"host {me} refused to spawn: {a.proc_id} is not in {msg.world_id}"
                )
        if msg.shape and msg.num_procs_per_host:  # what a rejoin brings (`world_spec`)
            self.world_spec = UpsertWorld(
                world_id=msg.world_id,
                shape=list(msg.shape),
                num_procs_per_host=msg.num_procs_per_host,
                env=msg.env,
                labels=dict(msg.labels),
            )
        if isinstance(msg.env, Exec):
            return await self._spawn_exec(msg, msg.env.program)
        return await self._spawn_local(msg)

    async def _spawn_exec(self, msg: SpawnProc, program: str) -> SpawnProcResult:
        argv = shlex.split(program)
        execution_id = self.joined.execution_id if self.joined else "unknown"
        token = token_mod.resolve_token().decode()

        async def one(a: ProcAssignment) -> Child:
            log_dir = self.log_dir if self.log_dir is not None else config.get().log_dir
            log_path = log_path_for(log_dir, execution_id, self.proc.proc_id, a.proc_id)
            env = child_env(
                world_id=msg.world_id,
                proc_id=a.proc_id,
                rank=a.rank,
                local_rank=a.local_rank,
                world_size=msg.world_size,
                local_world_size=msg.local_world_size,
                bootstrap_addr=str(self.system_addr),
                execution_id=execution_id,
                host_proc_id=self.proc.proc_id,
                stack_file=stack_path_for(log_path),
                cluster_token=token,
                supervision_update_interval_s=self.interval_s,
            )
            return await self.children.spawn(str(a.proc_id), argv, env, log_path)

        # Together: requests to a fork server are pipelined (an exec'd spawn never waits).
        children = await asyncio.gather(*(one(a) for a in msg.procs))
        started: list[StartedProc] = []
        failed: list[FailedProc] = []
        for a, child in zip(msg.procs, children, strict=True):
            if child.pid is None:
                reason = child.exit.reason if child.exit else "could not start"
                failed.append(FailedProc(proc_id=a.proc_id, reason=reason))
            else:
                started.append(StartedProc(proc_id=a.proc_id, pid=child.pid))
        return SpawnProcResult(started=started, failed=failed)

    async def _spawn_local(self, msg: SpawnProc) -> SpawnProcResult:
        async def one(pid: ProcId) -> ProcHandle:
            return await bootstrap_proc(
                pid,
                self.system_addr,
                supervision_update_interval_s=self.interval_s,
                mode=MANAGED,
                host_proc=self.proc.proc_id,
            )

        results = await asyncio.gather(*(one(a.proc_id) for a in msg.procs), return_exceptions=True)
        started: list[StartedProc] = []
        failed: list[FailedProc] = []
        import os

        for a, r in zip(msg.procs, results, strict=True):
            if isinstance(r, BaseException):
                failed.append(FailedProc(proc_id=a.proc_id, reason=f"{type(r).__name__}: {r}"))
            else:
                self.local_procs[a.proc_id] = r
                started.append(StartedProc(proc_id=a.proc_id, pid=os.getpid()))
        return SpawnProcResult(started=started, failed=failed)

    # ------------------------------------------------------------ exits
    def _child_exited(
        self, child: Child, exit_code: int | None, exit_signal: int | None, tail: list[str]
    ) -> None:
        report = ProcExited(
            proc_id=ProcId.parse(child.proc_id),
            host_proc=self.proc.proc_id,
            pid=child.pid,
            exit_code=exit_code,
            exit_signal=exit_signal,
            reason=child.exit.reason if child.exit else "",
            stderr_tail=tail,
        )
        task = asyncio.get_running_loop().create_task(self._report_exit(report))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_exit(self, report: ProcExited) -> None:
        """Send ``ProcExited`` at once; retry with backoff until acknowledged or stopping."""
        delay = 0.05
        for _ in range(20):
            if self.state == "Stopping" and self.proc.stopping:
                return
            try:
                await self.cx.mailbox.ask(SYSTEM_ACTOR, report, 2.0)
                return
            except Exception as e:  # noqa: BLE001 - retried
                log.debug("exit report for %s failed: %s", report.proc_id, e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    # ------------------------------------------------------------ stopping
    @handler
    async def on_kill_procs(self, msg: KillProcs) -> KilledProcs:
        killed = await self.children.kill_all(
            world=str(msg.world_id), grace_s=config.get().child_term_grace_s
        )
        ids = [ProcId.parse(c.proc_id) for c in killed]
        for pid, h in list(self.local_procs.items()):
            if pid.world == msg.world_id:
                await h.shutdown(msg.reason or "killed", leave=False)
                self.local_procs.pop(pid, None)
                ids.append(pid)
        return KilledProcs(proc_ids=ids)

    @handler
    def on_kill_proc(self, msg: KillProc) -> KilledProcs:
        child = self.children.get(str(msg.proc_id))
        if child is None or child.done() or msg.pid not in (None, child.pid):
            return KilledProcs(proc_ids=[])
        log.warning("%s: killing pid %s: %s", msg.proc_id, child.pid, msg.reason or "asked to")
        self.children.kill(child)
        return KilledProcs(proc_ids=[msg.proc_id])

    # ------------------------------------------------------------ more hosts
    @handler
    async def on_start_host(self, msg: StartHost) -> HostStarted:
        me = self.proc.proc_id
        world = msg.host_world
        if not is_host_world(world.name) or world == me.world:
            raise SpawnError(f"host {me} cannot start a host of {world}: not another host world")
        if self.state != "Joined":
            raise SpawnError(f"host {me} cannot start a host of {world}: it is {self.state}")
        handle = self.more_hosts.get(world)
        if handle is None:
            handle = await bootstrap_proc(
                world.proc(me.rank),
                self.system_addr,
                supervision_update_interval_s=self.interval_s,
                labels={"proc.palatine.dev/role": "host"},
                join_timeout_s=self.join_timeout_s,
                agent_cls=HostAgent,
                agent_args={"fork_server": self.children.fork_server, "log_dir": self.log_dir},
            )
            self.more_hosts[world] = handle
        return HostStarted(host=handle.proc.proc_id, addr=str(handle.addr))

    @handler
    async def on_stop_host(self, msg: StopHost) -> HostStarted:
        handle = self.more_hosts.pop(msg.host_world, None)
        if handle is None:
            raise SpawnError(f"host {self.proc.proc_id} runs no host of {msg.host_world}")
        await self._stop_host(handle, msg.reason or "stopped by its client", leave=True)
        return HostStarted(host=handle.proc.proc_id, addr=str(handle.addr))

    @staticmethod
    async def _stop_host(handle: ProcHandle, reason: str, leave: bool) -> None:
        agent = handle.agent
        if isinstance(agent, HostAgent):
            await agent.kill_children(1.0)
        await handle.shutdown(reason, leave=leave)

    async def kill_children(self, grace_s: float | None = None) -> None:
        more, self.more_hosts = self.more_hosts, {}
        for handle in more.values():
            await self._stop_host(handle, "its process's host stopping", leave=False)
        await self.children.aclose(
            grace_s if grace_s is not None else config.get().child_term_grace_s
        )
        for h in list(self.local_procs.values()):
            await h.shutdown("host stopping", leave=False)
        self.local_procs.clear()

    @handler
    async def on_proc_stop(self, msg: ProcStop) -> None:
        self.state = "Stopping"
        try:
            async with asyncio.timeout(msg.timeout_s):
                await self.kill_children(min(config.get().child_term_grace_s, msg.timeout_s))
        except TimeoutError:
            self.children.kill_now()
        await super().on_proc_stop(msg)

    async def on_stop(self, reason: str) -> None:
        await self.kill_children(1.0)
        self.output.close()
        await super().on_stop(reason)

    # ------------------------------------------------------------ introspection
    @handler
    def on_snapshot(self, msg: ProcSnapshotRequest) -> ProcSnapshot:
        snap = super().on_snapshot(msg)
        snap.children = [
            ChildProc(
                proc_id=ProcId.parse(c.proc_id),
                pid=c.pid,
                state=c.state,
                started_at=c.started_at,
                exit=c.exit.reason if c.exit else None,
            )
            for c in self.children.children
        ]
        return snap

    @handler
    async def on_stack_dump(self, msg: StackDump) -> StackTrace:
        if msg.target is None or msg.target == self.proc.proc_id:
            return self.own_stacks(msg)
        from palatine.hosting.stacks import dump_external

        child = self.children.get(str(msg.target))
        if child is None or child.pid is None or not child.running:
            return StackTrace(
                proc_id=msg.target,
                error=f"{msg.target} is not a running child of {self.proc.proc_id}",
            )
        try:
            stack_file = stack_path_for(child.log_path) if child.log_path else None
            method, text = await dump_external(child.pid, stack_file, msg.native, msg.timeout_s)
            return StackTrace(proc_id=msg.target, pid=child.pid, method=method, text=text)
        except Exception as e:  # noqa: BLE001 - the handler never raises
            return StackTrace(proc_id=msg.target, pid=child.pid, error=str(e))


async def join_host(
    host_world: str,
    host_rank: int,
    system_addr: ChannelAddr,
    interval_s: float | None,
    stop: asyncio.Event,
    main_proc: bool = False,
) -> ProcHandle | None:
    """Start and join host ``host_world[host_rank]`` (the CLI's and serve's host role);
    None when ``stop`` is set before it has joined. Raises `JoinError`."""
    from palatine.core.runtime import unless_stopped
    from palatine.ids import WorldId

    return await unless_stopped(
        bootstrap_proc(
            WorldId.parse(host_world).proc(host_rank),
            system_addr,
            supervision_update_interval_s=interval_s,
            labels={"proc.palatine.dev/role": "host"},
            main_proc=main_proc,
            join_timeout_s=config.get().join_timeout_s,
            agent_cls=HostAgent,
        ),
        stop,
    )
