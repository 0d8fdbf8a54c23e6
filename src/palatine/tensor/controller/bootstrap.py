"""The controller role: bootstrap and run.

`run_controller` starts the controller, every wait bounded and every failure named:

1. attach a client proc to the system (``cannot reach system at ADDR: …``);
2. ``UpsertWorld`` the worker world ``W`` with the worker labels, ``Exec{program}`` with
   ``--program`` (hosts start the workers) or ``Local`` without it;
3. poll the snapshot until ``W`` is Live — failing at once when a worker proc dies during
   startup, and with an actionable message after the world-ready timeout;
4. bootstrap the controller proc ``X[0]`` with its role labels plus the extra labels;
5. spawn the ControllerActor through that proc's agent;
6. spawn one worker actor per rank through the worker procs' agents, together, and
   collect acknowledgements of ``N`` distinct ranks;
7. ``UpsertWorld`` the controller world ``X`` (the readiness signal), then the ready line;
8. run until ``X[0]`` is stopped.

A failure after step 2 stops ``W`` and ``X`` (best effort, ≤ 5 s) so a retry can recreate
them, then raises `BootstrapError` with the message the CLI prints and ``serve`` reports.
A stop (signal, serve ``Exit``) during the bootstrap cleans up the same way and returns
normally.

The pure parts — the command and its validation, labels, the live-wait verdicts and
messages — live in `palatine.tensor.controller.startup`.
``PALATINE_CONTROLLER_WORKER_ACTOR_TYPE`` **(ours, for tests and tools)** overrides the
worker actor type spawned in step 6.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from palatine import config
from palatine.channel.addr import ChannelAddr, require_addr
from palatine.config import format_seconds
from palatine.core.runtime import unless_stopped
from palatine.errors import CallTimeout, JoinError, PalatineError, error_text
from palatine.ids import ActorId, WorldId
from palatine.protocol.agent import Spawn, Spawned
from palatine.protocol.controller import CONTROLLER_ACTOR_TYPE, ControllerParams, WorkerProcRecord
from palatine.protocol.system import (
    Snapshot,
    SnapshotFilter,
    SystemSnapshot,
    UpsertWorld,
    WorldSnapshot,
)
from palatine.protocol.worker import WorkerParams
from palatine.tensor.controller.startup import (
    WORKER_ACTOR_TYPE,
    ControllerCommand,
    ControllerTimeouts,
    format_ranks,
    inspect_worker_world,
    not_live_text,
    poll_delay,
    proc_labels,
    worker_records,
    world_labels,
)

__all__ = ["BootstrapError", "run_controller"]

log = logging.getLogger(__name__)

_CLEANUP_S = 5.0


class BootstrapError(PalatineError):
    """The controller bootstrap failed; the message is the one line shown to the user.

    Raised by `run_controller`; the CLI prints it and exits 1, ``palatine serve`` puts it
    in ``Finished.error``.
    """


class _Stopped(BootstrapError):
    """A signal (or ``Exit``) arrived during the bootstrap: clean up and stop normally."""


# --------------------------------------------------------------------------- running


async def _wait_live(
    client: Any, cmd: ControllerCommand, timeouts: ControllerTimeouts, stop: asyncio.Event
) -> WorldSnapshot:
    """Step 3: poll until ``W`` is Live; fail fast on a dead proc; bounded overall."""
    loop = asyncio.get_running_loop()
    rpc = config.get().rpc_timeout_s
    start = loop.time()
    deadline = start + timeouts.world_ready_s
    flt = SnapshotFilter(worlds=[WorldId(cmd.worker_world)])
    state = inspect_worker_world(cmd.worker_world, cmd.world_size, None)
    last_error = ""
    while True:
        now = loop.time()
        if stop.is_set():
            raise _Stopped(f"stopped while waiting for worker world {cmd.worker_world}")
        if now >= deadline:
            text = not_live_text(cmd, state, timeouts.world_ready_s)
            if last_error and not state.present:
                text += f" (last snapshot error: {last_error})"
            raise BootstrapError(text)
        try:
            snap: SystemSnapshot = await client.ask(
                Snapshot(filter=flt), min(rpc, max(0.05, deadline - now))
            )
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last_error = error_text(e)
            log.debug("snapshot during startup failed: %s", last_error)
        else:
            world = snap.worlds.get(cmd.worker_world)
            state = inspect_worker_world(cmd.worker_world, cmd.world_size, world)
            if state.failure is not None:
                await _log_stderr_tail(client, cmd.worker_world, state.failed_rank)
                raise BootstrapError(state.failure)
            if state.live and world is not None:
                return world
        await asyncio.sleep(poll_delay(loop.time() - start))


async def _log_stderr_tail(client: Any, world: str, rank: int | None) -> None:
    """Best effort: log the dead proc's last stderr lines, as the system recorded them."""
    try:
        reply = await client.world_state(world)
    except Exception:  # noqa: BLE001 - only a diagnostic
        return
    st = reply.state
    if st is None or rank is None or rank not in st.procs:
        return
    tail = [ln for ln in st.procs[rank].stderr_tail if ln.strip()][-20:]
    if tail:
        log.error(
            "last stderr lines of %s[%d]:\n%s", world, rank, "\n".join(f"  {ln}" for ln in tail)
        )


async def _spawn_workers(
    client: Any,
    cmd: ControllerCommand,
    controller: ActorId,
    timeout_s: float,
    actor_type: str,
    stop: asyncio.Event,
) -> None:
    """Step 6: one Spawn per rank, all at once; N distinct ranks must acknowledge."""
    world = WorldId(cmd.worker_world)
    n = cmd.world_size
    futures: dict[asyncio.Future[Any], int] = {}
    for rank in range(n):
        params = WorkerParams(
            world_size=n,
            rank=rank,
            device_index=None if cmd.is_cpu_worker else 0,
            controller_actor=controller,
        )
        msg = Spawn(
            actor_type=actor_type, actor_name=cmd.worker_name, params=msgspec.msgpack.encode(params)
        )
        fut = client.mailbox.ask(world.proc(rank).actor("proc"), msg, timeout_s)
        futures[asyncio.ensure_future(fut)] = rank
    acked: set[int] = set()
    pending = set(futures)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        async with asyncio.timeout(timeout_s):
            while len(acked) < n and pending:
                done, pending = await asyncio.wait(
                    {*pending, stopper}, return_when=asyncio.FIRST_COMPLETED
                )
                if stopper in done:
                    raise _Stopped("stopped while spawning the worker actors")
                pending.discard(stopper)
                failed: tuple[int, BaseException] | None = None
                for fut in sorted(done, key=lambda f: futures[f]):
                    rank = futures[fut]
                    exc = fut.exception()  # retrieved for every future, so none is reported later
                    if exc is None:
                        reply: Spawned = fut.result()
                        acked.add(reply.rank)
                    elif not isinstance(exc, CallTimeout) and failed is None:
                        failed = (rank, exc)
                if failed is not None:
                    raise BootstrapError(
                        f"cannot spawn worker actor {cmd.worker_name} on {world.proc(failed[0])}: "
                        f"{error_text(failed[1])}"
                    )
    except TimeoutError:
        pass
    finally:
        stopper.cancel()
        for fut in pending:
            fut.cancel()
    if len(acked) < n:
        missing = [r for r in range(n) if r not in acked]
        raise BootstrapError(
            f"worker actors did not acknowledge their spawn within {format_seconds(timeout_s)} s: "
            f"missing ranks {format_ranks(missing)} of world {world}"
        )


def _controller_params(
    cmd: ControllerCommand,
    actor: ActorId,
    system_addr: str,
    timeouts: ControllerTimeouts,
    records: list[WorkerProcRecord],
    actor_type: str = WORKER_ACTOR_TYPE,
) -> ControllerParams:
    return ControllerParams(
        world_size=cmd.world_size,
        num_procs_per_host=cmd.num_procs_per_host,
        worker_world=WorldId(cmd.worker_world),
        worker_name=cmd.worker_name,
        system_addr=system_addr,
        comm=actor.proc.actor("comm"),
        supervision_query_interval_s=cmd.supervision_query_interval_s,
        worker_progress_check_interval_s=cmd.worker_progress_check_interval_s,
        operation_timeout_s=cmd.operation_timeout_s,
        operations_per_worker_progress_request=cmd.operations_per_worker_progress_request,
        fail_on_worker_timeout=cmd.fail_on_worker_timeout,
        stall_report_timeout_s=timeouts.stall_report_s,
        client_liveness_timeout_s=timeouts.client_liveness_s,
        system_loss_timeout_s=config.system_loss_timeout_s(None, cmd.supervision_update_interval_s),
        worker_procs=records,
        worker_actor_type=actor_type,
        worker_device_index=None if cmd.is_cpu_worker else 0,
        spawn_timeout_s=timeouts.spawn_s,
        adopted=cmd.adopt_world,
    )


async def _stop_worlds(client: Any, worlds: list[str]) -> None:
    """Best effort, bounded: ask the system to stop ``worlds``."""
    try:
        async with asyncio.timeout(_CLEANUP_S):
            await client.stop(worlds, proc_timeout_s=_CLEANUP_S)
    except Exception as e:  # noqa: BLE001 - best effort
        log.warning("could not ask the system to stop %s: %s", ", ".join(worlds), error_text(e))


async def run_controller(
    cmd: ControllerCommand,
    addr: ChannelAddr,
    stop: asyncio.Event,
    on_ready: Callable[[str], None],
    *,
    main_proc: bool = False,
    timeouts: ControllerTimeouts | None = None,
) -> tuple[int, str | None]:
    """Bootstrap and run the controller of ``cmd``, checked by `validate_command`, which
    also gives ``addr`` (its ``system_addr``, parsed once), until its proc stops.

    Returns ``(exit status, reason)``: ``(0, None)`` after a normal stop, ``(1, why)``
    after losing the client or the system. Raises `BootstrapError` when the bootstrap
    fails (after cleanup), `ConfigError` for bad timeouts in the environment.
    """
    from palatine.hosting.agent import MANAGED, bootstrap_proc
    from palatine.system.service import System
    from palatine.tensor.controller.actor import ControllerActor

    require_addr(addr, "run_controller")
    timeouts = timeouts or ControllerTimeouts.from_env()
    cfg = config.get()
    actor_id = ActorId.parse(cmd.controller_actor_id)
    x_world = str(actor_id.world)
    actor_type = cfg.controller_worker_actor_type or WORKER_ACTOR_TYPE

    # 1. attach
    try:
        client = await unless_stopped(System(addr).attach(timeout_s=cfg.join_timeout_s), stop)
    except (JoinError, OSError) as e:
        raise BootstrapError(f"cannot reach system at {cmd.system_addr}: {error_text(e)}") from None
    if client is None:
        log.info("controller stopped while reaching the system")
        return 0, None
    handle = None
    created = False
    try:
        # 2. upsert the worker world (an adopted one exists: its owner keeps it)
        if not cmd.adopt_world:
            try:
                await client.upsert_world(
                    cmd.worker_world,
                    [cmd.world_size],
                    cmd.num_procs_per_host,
                    cmd.program,
                    world_labels(cmd),
                )
            except Exception as e:  # noqa: BLE001 - every failure is the bootstrap's message
                raise BootstrapError(error_text(e)) from None
            created = True
            log.info("created worker world %s; waiting for it to be Live", cmd.worker_world)
        # 3. wait until Live
        world = await _wait_live(client, cmd, timeouts, stop)
        records = worker_records(cmd.worker_world, cmd.world_size, world)
        # 4. the controller proc
        try:
            handle = await unless_stopped(
                bootstrap_proc(
                    actor_id.proc,
                    addr,
                    supervision_update_interval_s=cmd.supervision_update_interval_s,
                    labels=proc_labels(cmd),
                    mode=MANAGED,
                    join_timeout_s=cfg.join_timeout_s,
                    main_proc=main_proc,
                ),
                stop,
            )
        except (JoinError, OSError) as e:
            raise BootstrapError(
                f"cannot start controller proc {actor_id.proc}: {error_text(e)}"
            ) from None
        if handle is None:
            raise _Stopped(f"stopped while starting controller proc {actor_id.proc}")
        # 5. the ControllerActor, through the proc agent
        params = _controller_params(cmd, actor_id, str(addr), timeouts, records, actor_type)
        spawn = Spawn(
            actor_type=CONTROLLER_ACTOR_TYPE,
            actor_name=actor_id.name,
            params=msgspec.msgpack.encode(params),
        )
        try:
            reply = await client.mailbox.ask(handle.agent_id, spawn, cfg.rpc_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to spawn is a BootstrapError
            raise BootstrapError(
                f"cannot spawn controller actor {actor_id}: {error_text(e)}"
            ) from None
        if reply.actor_id != actor_id:
            raise BootstrapError(
                f"controller actor spawned as {reply.actor_id}, expected {actor_id}"
            )
        inst = handle.proc.instance(actor_id)
        controller = inst.actor if inst is not None else None
        # 6. the worker actors
        await _spawn_workers(client, cmd, actor_id, timeouts.spawn_s, actor_type, stop)
        log.info("spawned %d worker actors %s", cmd.world_size, cmd.worker_name)
        # 7. announce
        try:
            await client.upsert_world(x_world, [1], 1, None, {})
        except Exception as e:  # noqa: BLE001 - any failure to announce is a BootstrapError
            raise BootstrapError(
                f"cannot create controller world {x_world}: {error_text(e)}"
            ) from None
        # what the controller's proc brings to a restarted system when it rejoins it
        handle.agent.world_spec = UpsertWorld(world_id=WorldId(x_world), shape=[1])
    except BaseException:
        if created:
            await _stop_worlds(client, [cmd.worker_world, x_world])
        if handle is not None:
            await handle.shutdown("bootstrap failed", leave=True)
        await _close_client(client)
        if isinstance(sys.exc_info()[1], _Stopped):
            log.info("controller stopped during its bootstrap")
            return 0, None
        raise
    # 8. ready
    on_ready(str(handle.addr))
    assert isinstance(controller, ControllerActor) or controller is None
    mine = [x_world] if cmd.adopt_world else [cmd.worker_world, x_world]
    return await _serve(cmd, client, handle, controller, inst, stop, mine)


async def _close_client(client: Any) -> None:
    try:
        async with asyncio.timeout(2.0):
            await client.close()
    except Exception as e:  # noqa: BLE001 - best effort
        log.debug("closing the bootstrap client: %s", e)


async def _serve(
    cmd: ControllerCommand,
    client: Any,
    handle: Any,
    controller: Any,
    inst: Any,
    stop: asyncio.Event,
    worlds: list[str],
) -> tuple[int, str | None]:
    """Step 9: run until the proc stops, a signal arrives or the actor dies."""
    if controller is not None:
        controller.on_stop_worlds = lambda: setattr(client.client, "quiet_returns", True)
    waiter = asyncio.ensure_future(handle.wait())
    stopper = asyncio.ensure_future(stop.wait())
    watched: list[asyncio.Future[Any]] = [waiter, stopper]
    if inst is not None:
        watched.append(inst.terminal)
    code, why = 0, None
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if stopper.done() and not waiter.done():
            log.info("controller stopping: signal")
            await _stop_worlds(client, worlds)
            try:
                async with asyncio.timeout(_CLEANUP_S):
                    await asyncio.shield(waiter)
            except TimeoutError:
                log.warning("the system did not stop the controller proc within %g s", _CLEANUP_S)
        elif not waiter.done() and handle.agent.state == "Stopping" and inst.state != "failed":
            # The proc is being stopped (ProcStop, system lost): its actors stop first.
            try:
                async with asyncio.timeout(config.get().proc_stop_timeout_s + 2.0):
                    await asyncio.shield(waiter)
            except TimeoutError:
                log.warning("the controller proc did not finish stopping")
        elif not waiter.done():
            # The ControllerActor ended while its proc still runs: nothing can serve the client.
            why = f"controller actor {cmd.controller_actor_id} stopped: {inst.status}"
            log.error("%s", why)
            code = 1
            await _stop_worlds(client, worlds)
        reason = waiter.result() if waiter.done() else "stopped"
        if reason == "system lost":
            code, why = 1, f"lost contact with system at {cmd.system_addr}"
        elif controller is not None and controller.client_state == "lost":
            code, why = 1, controller.exit_reason or "the client was lost"
    finally:
        for fut in (waiter, stopper):
            fut.cancel()
        reason = (
            "system lost" if code == 1 and why and why.startswith("lost contact") else "stopped"
        )
        try:
            async with asyncio.timeout(10.0):
                await handle.shutdown(reason, leave=handle.agent.state == "Joined")
        except Exception as e:  # noqa: BLE001 - best effort at exit
            log.warning("controller proc shutdown: %s", error_text(e))
        await _close_client(client)
    return code, why
