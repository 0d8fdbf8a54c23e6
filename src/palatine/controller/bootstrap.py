"""The controller role: validate the command, bootstrap, run (30-controller.md §1–§2).

`run_controller` is the seed's ``spawn_controller`` with bounded waits and clear errors:

1. attach a client proc to the system (``cannot reach system at ADDR: …``);
2. ``UpsertWorld`` the worker world ``W`` with the worker labels, ``Exec{program}`` with
   ``--program`` (hosts start the workers) or ``Local`` without it;
3. poll the snapshot until ``W`` is Live — failing at once when a worker proc dies during
   startup (§2.3), and with an actionable message after the world-ready timeout;
4. bootstrap the controller proc ``X[0]`` with its role labels plus the extra labels;
5. spawn the ControllerActor through that proc's agent;
6. spawn one worker actor per rank through the worker procs' agents, together, and
   collect acknowledgements of ``N`` distinct ranks;
7. ``UpsertWorld`` the controller world ``X`` (the readiness signal), then the ready line;
8. run until ``X[0]`` is stopped (§2.4).

A failure after step 2 stops ``W`` and ``X`` (best effort, ≤ 5 s) so a retry can recreate
them, then raises `BootstrapError` with the message the CLI prints and ``serve`` reports.

The pure parts — command validation, the live-wait verdict, the messages — are separate
functions so they are unit-tested without sockets. ``PALATINE_CONTROLLER_WORKER_ACTOR_TYPE``
**(ours, for tests and tools)** overrides the worker actor type spawned in step 6.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.controller.messages import CONTROLLER_ACTOR_TYPE, ControllerParams, WorkerProcRecord
from palatine.errors import CallTimeout, ConfigError, JoinError, PalatineError
from palatine.ids import (
    RESERVED_ACTOR_NAMES,
    ActorId,
    ProcId,
    WorldId,
    host_world_of,
    is_host_world,
    is_reserved_world,
)
from palatine.supervision import format_seconds, signal_text
from palatine.system.messages import (
    Snapshot,
    SnapshotFilter,
    Spawn,
    Spawned,
    WorldSnapshot,
)
from palatine.worker.messages import WorkerParams

__all__ = [
    "LABEL_ROLE",
    "LABEL_WORKER_WORLD",
    "LABEL_WORKER",
    "LABEL_CONTROLLER_ACTOR_ID",
    "WORKER_ACTOR_TYPE",
    "BootstrapError",
    "ControllerCommand",
    "ControllerTimeouts",
    "WaitState",
    "parse_key_val",
    "validate_command",
    "proc_labels",
    "world_labels",
    "inspect_worker_world",
    "startup_failure_text",
    "not_live_text",
    "format_ranks",
    "poll_delay",
    "run_controller",
]

log = logging.getLogger(__name__)

LABEL_ROLE = "proc.palatine.dev/role"
LABEL_WORKER_WORLD = "proc.palatine.dev/workerWorld"
LABEL_WORKER = "world.palatine.dev/worker"
LABEL_CONTROLLER_ACTOR_ID = "world.palatine.dev/controllerActorId"
_RESERVED_LABEL_PREFIX = "proc.palatine.dev/"

WORKER_ACTOR_TYPE = "palatine.worker.WorkerActor"
"""Registered type name of the tensor worker actor (step 6)."""

_FAILED_HEALTH = ("Exited", "Expired", "ConnectionFailure")
_CLEANUP_S = 5.0


class BootstrapError(PalatineError):
    """The controller bootstrap failed; the message is the one line shown to the user.

    Raised by `run_controller`; the CLI prints it and exits 1, ``palatine serve`` puts it
    in ``Finished.error``.
    """


class ControllerCommand(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The seed's ``ControllerCommand``: the flags of ``palatine controller`` and the
    fields of a serve ``Run.Controller`` request, with the seed's defaults."""

    worker_world: str
    system_addr: str
    controller_actor_id: str = "controller[0].root"
    world_size: int
    num_procs_per_host: int = 8
    worker_name: str = "worker"
    program: str | None = None
    supervision_query_interval_in_sec: float = 2.0
    supervision_update_interval_in_sec: float = 2.0
    worker_progress_check_interval_in_sec: float = 10.0
    operation_timeout_in_sec: float = 120.0
    operations_per_worker_progress_request: int = 100
    fail_on_worker_timeout: bool = False
    is_cpu_worker: bool = False
    extra_proc_labels: list[tuple[str, str]] | None = None


class ControllerTimeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Controller-only bounds from ``PALATINE_*`` variables (§2.1), in seconds."""

    world_ready_s: float = 300.0
    spawn_s: float = 120.0
    stall_report_s: float = 5.0
    client_liveness_s: float = 30.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ControllerTimeouts:
        """Read the variables; a malformed value raises `ConfigError` (a usage error)."""
        env = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for field, var in (
            ("world_ready_s", "PALATINE_CONTROLLER_WORLD_READY_TIMEOUT"),
            ("spawn_s", "PALATINE_CONTROLLER_SPAWN_TIMEOUT"),
            ("stall_report_s", "PALATINE_STALL_REPORT_TIMEOUT"),
            ("client_liveness_s", "PALATINE_CLIENT_LIVENESS_TIMEOUT"),
        ):
            text = env.get(var)
            if text:
                values[field] = config.parse_seconds(text, name=var)
        return cls(**values)


# --------------------------------------------------------------------------- validation


def parse_key_val(text: str) -> tuple[str, str]:
    """Split ``KEY=VALUE`` at the first ``=`` (``k=v=3`` → ``("k", "v=3")``).

    Raises `ValueError` with the seed's message when there is no ``=``.
    """
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"invalid KEY=value: no '=' found in '{text}'")
    return key, value


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value:g}")


def validate_command(cmd: ControllerCommand) -> None:
    """Check every input before anything starts (§1, §2.1); raise `ConfigError`.

    Beyond the seed: the controller actor id must be ``X[0].name`` with ``X`` neither the
    worker world nor a host or reserved world and ``name`` not a reserved agent name;
    extra labels may not use the reserved ``proc.palatine.dev/`` keys.
    """
    try:
        ChannelAddr.parse(cmd.system_addr)
    except ValueError as e:
        raise ConfigError(f"invalid --system-addr {cmd.system_addr!r}: {e}") from None
    try:
        worker = WorldId.parse(cmd.worker_world)
    except ValueError as e:
        raise ConfigError(f"invalid --worker-world {cmd.worker_world!r}: {e}") from None
    if is_reserved_world(worker):
        raise ConfigError(
            f"invalid --worker-world {cmd.worker_world!r}: the name is reserved "
            "(system, user, unknown and names starting with 'host')"
        )
    try:
        actor = ActorId.parse(cmd.controller_actor_id)
    except ValueError as e:
        raise ConfigError(f"invalid --controller-actor-id {cmd.controller_actor_id!r}: {e}") from None
    bad = f"invalid --controller-actor-id {cmd.controller_actor_id!r}"
    if actor.proc.rank != 0 or actor.pid != 0:
        raise ConfigError(f"{bad}: it must name pid 0 on rank 0 of its world (like controller[0].root)")
    if actor.world == worker:
        raise ConfigError(f"{bad}: its world must differ from the worker world {worker}")
    if is_host_world(actor.world) or is_reserved_world(actor.world):
        raise ConfigError(f"{bad}: world {actor.world} is reserved")
    if actor.name in RESERVED_ACTOR_NAMES:
        raise ConfigError(f"{bad}: actor name {actor.name!r} is reserved for the runtime")
    if cmd.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {cmd.world_size}")
    if cmd.num_procs_per_host < 1:
        raise ConfigError(f"--num-procs-per-host must be >= 1, got {cmd.num_procs_per_host}")
    if not cmd.worker_name.isidentifier() or cmd.worker_name in RESERVED_ACTOR_NAMES:
        raise ConfigError(f"invalid --worker-name {cmd.worker_name!r}: an identifier, not proc or comm")
    if cmd.operations_per_worker_progress_request < 1:
        raise ConfigError(
            "--operations-per-worker-progress-request must be >= 1, got "
            f"{cmd.operations_per_worker_progress_request}"
        )
    for name in (
        "supervision_query_interval_in_sec",
        "supervision_update_interval_in_sec",
        "worker_progress_check_interval_in_sec",
        "operation_timeout_in_sec",
    ):
        _positive(name, getattr(cmd, name))
    if cmd.program is not None:
        try:
            argv = shlex.split(cmd.program)
        except ValueError as e:
            raise ConfigError(f"invalid --program {cmd.program!r}: {e}") from None
        if not argv:
            raise ConfigError("invalid --program '': empty command")
    for key, _value in cmd.extra_proc_labels or ():
        if not key:
            raise ConfigError("invalid --extra-proc-labels: empty key")
        if key.startswith(_RESERVED_LABEL_PREFIX):
            raise ConfigError(
                f"invalid --extra-proc-labels key {key!r}: keys under "
                f"{_RESERVED_LABEL_PREFIX} are reserved"
            )


def proc_labels(cmd: ControllerCommand) -> dict[str, str]:
    """Labels of the controller proc: role, worker world, then the extra labels (§2.2 step 4)."""
    labels = {LABEL_ROLE: "controller", LABEL_WORKER_WORLD: cmd.worker_world}
    for key, value in cmd.extra_proc_labels or ():
        labels[key] = value
    return labels


def world_labels(cmd: ControllerCommand) -> dict[str, str]:
    """Labels of the worker world (§2.2 step 2)."""
    actor = ActorId.parse(cmd.controller_actor_id)
    return {LABEL_WORKER: "1", LABEL_CONTROLLER_ACTOR_ID: f"{actor.proc}.{actor.name}"}


# --------------------------------------------------------------------------- the live wait


class WaitState(msgspec.Struct, frozen=True, kw_only=True):
    """What one step-3 snapshot says about the worker world.

    ``failure`` is set when a proc died during startup (the bootstrap fails at once);
    ``failed_rank`` names it. ``joined`` counts ranks that joined and are Alive.
    """

    present: bool
    live: bool
    joined: int
    missing: list[int]
    host_procs: list[str]
    failure: str | None = None
    failed_rank: int | None = None


def startup_failure_text(proc: str, health: str, exit_code: int | None, exit_signal: int | None,
                         reason: str | None, host: str, pid: int | None) -> str:
    """``worker proc W[2] exited with code 1 during startup (host node3, pid 812); see its stderr``."""
    where = ", ".join(p for p in (f"host {host}" if host else "", f"pid {pid}" if pid else "") if p)
    suffix = f" ({where})" if where else ""
    if health == "Exited":
        if exit_signal is not None:
            what = f"was {signal_text(exit_signal)} during startup"
        elif exit_code is not None:
            what = f"exited with code {exit_code} during startup"
        elif reason and not pid:
            return f"worker proc {proc} could not be started{suffix}: {reason}"
        else:
            what = f"exited during startup ({reason})" if reason else "exited during startup"
    elif health == "Expired":
        what = "stopped sending heartbeats during startup"
    else:
        what = "lost its connection to the system during startup"
    return f"worker proc {proc} {what}{suffix}; see its stderr"


def inspect_worker_world(world: str, size: int, snap: WorldSnapshot | None) -> WaitState:
    """The verdict of one step-3 snapshot (§2.2, §2.3); the lowest failed rank wins."""
    if snap is None:
        return WaitState(present=False, live=False, joined=0, missing=list(range(size)), host_procs=[])
    joined = 0
    missing: list[int] = []
    for rank in range(size):
        name = f"{world}[{rank}]"
        entry = snap.procs.get(name)
        if entry is not None and entry.health in _FAILED_HEALTH:
            text = startup_failure_text(
                name, entry.health, entry.exit_code, entry.exit_signal, entry.reason,
                entry.host, entry.pid,
            )
            return WaitState(
                present=True, live=False, joined=joined, missing=missing,
                host_procs=list(snap.host_procs), failure=text, failed_rank=rank,
            )
        if entry is not None and entry.addr:
            joined += 1
        else:
            missing.append(rank)
    return WaitState(
        present=True, live=snap.status == "Live", joined=joined, missing=missing,
        host_procs=list(snap.host_procs),
    )


def format_ranks(ranks: list[int]) -> str:
    """``0, 2-5, 7``: ascending ranks with consecutive runs collapsed."""
    out: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if start is not None and prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None and prev is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None and prev is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def not_live_text(cmd: ControllerCommand, state: WaitState, timeout_s: float) -> str:
    """The actionable timeout message of §2.3, with a hint on one line."""
    world = cmd.worker_world
    hw = host_world_of(world)
    text = (
        f"worker world {world} did not become Live within {format_seconds(timeout_s)} s: "
        f"{state.joined} of {cmd.world_size} procs joined"
    )
    if state.missing:
        text += f" (missing ranks {format_ranks(state.missing)})"
    hosts_needed = -(-cmd.world_size // cmd.num_procs_per_host)
    if cmd.program is not None and not state.host_procs:
        text += (
            f"; no host has joined host world {hw}; start hosts with 'palatine host "
            f"--system-addr {cmd.system_addr} --host-world {hw} --host-rank H' "
            f"(H = 0..{hosts_needed - 1})"
        )
    elif cmd.program is not None and len(state.host_procs) < hosts_needed:
        text += (
            f"; only {len(state.host_procs)} of {hosts_needed} hosts have joined host world "
            f"{hw} (--num-procs-per-host {cmd.num_procs_per_host}); start the others with "
            f"'palatine host --host-world {hw} ...'"
        )
    elif cmd.program is None and not state.host_procs:
        text += (
            f"; start each worker with 'palatine worker --world-id {world} --proc-id "
            f"{world}[r] --bootstrap-addr {cmd.system_addr}'"
        )
    return text


def poll_delay(elapsed_s: float) -> float:
    """Step 3's poll period: every 10 ms for the first second, then every 100 ms."""
    return 0.01 if elapsed_s < 1.0 else 0.1


def _records(world: str, size: int, snap: WorldSnapshot | None) -> list[WorkerProcRecord]:
    """Per-rank proc records kept from the last step-3 snapshot (for stall reports)."""
    out: list[WorkerProcRecord] = []
    if snap is None:
        return out
    for rank in range(size):
        entry = snap.procs.get(f"{world}[{rank}]")
        if entry is None:
            continue
        host_proc = None
        if entry.host_proc:
            try:
                host_proc = ProcId.parse(entry.host_proc)
            except ValueError:
                host_proc = None
        out.append(
            WorkerProcRecord(
                rank=rank, proc_id=WorldId(world).proc(rank), pid=entry.pid, host=entry.host,
                addr=entry.addr, host_proc=host_proc,
            )
        )
    return out


# --------------------------------------------------------------------------- running


def _err_text(e: BaseException) -> str:
    return str(getattr(e, "message", "") or e)


async def _wait_live(client: Any, cmd: ControllerCommand, timeouts: ControllerTimeouts,
                     stop: asyncio.Event) -> WorldSnapshot:
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
            raise BootstrapError(f"stopped while waiting for worker world {cmd.worker_world}")
        if now >= deadline:
            text = not_live_text(cmd, state, timeouts.world_ready_s)
            if last_error and not state.present:
                text += f" (last snapshot error: {last_error})"
            raise BootstrapError(text)
        try:
            snap = await client.ask(Snapshot(filter=flt), min(rpc, max(0.05, deadline - now)))
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last_error = _err_text(e)
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
        log.error("last stderr lines of %s[%d]:\n%s", world, rank, "\n".join(f"  {ln}" for ln in tail))


async def _spawn_workers(client: Any, cmd: ControllerCommand, controller: ActorId,
                         timeout_s: float, actor_type: str) -> None:
    """Step 6: one Spawn per rank, all at once; N distinct ranks must acknowledge."""
    world = WorldId(cmd.worker_world)
    n = cmd.world_size
    futures: dict[asyncio.Future[Any], int] = {}
    for rank in range(n):
        params = WorkerParams(
            world_size=n, rank=rank, device_index=None if cmd.is_cpu_worker else 0,
            controller_actor=controller,
        )
        msg = Spawn(actor_type=actor_type, actor_name=cmd.worker_name,
                    params=msgspec.msgpack.encode(params))
        fut = client.mailbox.ask(world.proc(rank).actor("proc"), msg, timeout_s)
        futures[asyncio.ensure_future(fut)] = rank
    acked: set[int] = set()
    pending = set(futures)
    try:
        async with asyncio.timeout(timeout_s):
            while len(acked) < n and pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
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
                        f"{_err_text(failed[1])}"
                    )
    except TimeoutError:
        pass
    finally:
        for fut in pending:
            fut.cancel()
    if len(acked) < n:
        missing = [r for r in range(n) if r not in acked]
        raise BootstrapError(
            f"worker actors did not acknowledge their spawn within {format_seconds(timeout_s)} s: "
            f"missing ranks {format_ranks(missing)} of world {world}"
        )


def _controller_params(cmd: ControllerCommand, actor: ActorId, system_addr: str,
                       timeouts: ControllerTimeouts, records: list[WorkerProcRecord]) -> ControllerParams:
    return ControllerParams(
        world_size=cmd.world_size,
        num_procs_per_host=cmd.num_procs_per_host,
        worker_world=WorldId(cmd.worker_world),
        worker_name=cmd.worker_name,
        system_addr=system_addr,
        comm=actor.proc.actor("comm"),
        supervision_query_interval_s=cmd.supervision_query_interval_in_sec,
        worker_progress_check_interval_s=cmd.worker_progress_check_interval_in_sec,
        operation_timeout_s=cmd.operation_timeout_in_sec,
        operations_per_worker_progress_request=cmd.operations_per_worker_progress_request,
        fail_on_worker_timeout=cmd.fail_on_worker_timeout,
        stall_report_timeout_s=timeouts.stall_report_s,
        client_liveness_timeout_s=timeouts.client_liveness_s,
        system_loss_timeout_s=config.system_loss_timeout_s(
            None, cmd.supervision_update_interval_in_sec
        ),
        worker_procs=records,
    )


async def _stop_worlds(client: Any, worlds: list[str]) -> None:
    """Best effort, bounded: ask the system to stop ``worlds``."""
    try:
        async with asyncio.timeout(_CLEANUP_S):
            await client.stop(worlds, proc_timeout_s=_CLEANUP_S)
    except Exception as e:  # noqa: BLE001 - best effort
        log.warning("could not ask the system to stop %s: %s", ", ".join(worlds), _err_text(e))


async def run_controller(
    cmd: ControllerCommand,
    stop: asyncio.Event,
    on_ready: Callable[[str], None],
    *,
    main_proc: bool = False,
    timeouts: ControllerTimeouts | None = None,
) -> tuple[int, str | None]:
    """Bootstrap (§2.2) and run the controller until its proc stops (§2.4).

    Returns ``(exit status, reason)``: ``(0, None)`` after a normal stop, ``(1, why)``
    after losing the client or the system. Raises `BootstrapError` when the bootstrap
    fails (after cleanup), `ConfigError` for invalid input.
    """
    from palatine.agent import MANAGED, bootstrap_proc
    from palatine.controller.actor import ControllerActor
    from palatine.system.service import System

    validate_command(cmd)
    timeouts = timeouts or ControllerTimeouts.from_env()
    cfg = config.get()
    actor_id = ActorId.parse(cmd.controller_actor_id)
    x_world = str(actor_id.world)
    addr = ChannelAddr.parse(cmd.system_addr)
    actor_type = os.environ.get("PALATINE_CONTROLLER_WORKER_ACTOR_TYPE") or WORKER_ACTOR_TYPE

    # 1. attach
    try:
        client = await System(addr).attach(timeout_s=cfg.join_timeout_s)
    except (JoinError, OSError) as e:
        raise BootstrapError(f"cannot reach system at {cmd.system_addr}: {_err_text(e)}") from None
    handle = None
    created = False
    try:
        # 2. upsert the worker world
        try:
            await client.upsert_world(
                cmd.worker_world, [cmd.world_size], cmd.num_procs_per_host, cmd.program,
                world_labels(cmd),
            )
        except Exception as e:  # noqa: BLE001 - every failure is the bootstrap's message
            raise BootstrapError(_err_text(e)) from None
        created = True
        log.info("created worker world %s; waiting for it to be Live", cmd.worker_world)
        # 3. wait until Live
        world = await _wait_live(client, cmd, timeouts, stop)
        records = _records(cmd.worker_world, cmd.world_size, world)
        # 4. the controller proc
        try:
            handle = await bootstrap_proc(
                actor_id.proc, addr,
                supervision_update_interval_s=cmd.supervision_update_interval_in_sec,
                labels=proc_labels(cmd), mode=MANAGED, join_timeout_s=cfg.join_timeout_s,
                main_proc=main_proc,
            )
        except (JoinError, OSError) as e:
            raise BootstrapError(f"cannot start controller proc {actor_id.proc}: {_err_text(e)}") from None
        # 5. the ControllerActor, through the proc agent
        params = _controller_params(cmd, actor_id, str(addr), timeouts, records)
        spawn = Spawn(actor_type=CONTROLLER_ACTOR_TYPE, actor_name=actor_id.name,
                      params=msgspec.msgpack.encode(params))
        try:
            reply = await client.mailbox.ask(handle.agent_id, spawn, cfg.rpc_timeout_s)
        except Exception as e:  # noqa: BLE001
            raise BootstrapError(f"cannot spawn controller actor {actor_id}: {_err_text(e)}") from None
        if reply.actor_id != actor_id:
            raise BootstrapError(f"controller actor spawned as {reply.actor_id}, expected {actor_id}")
        inst = handle.proc.instance(actor_id)
        controller = inst.actor if inst is not None else None
        # 6. the worker actors
        await _spawn_workers(client, cmd, actor_id, timeouts.spawn_s, actor_type)
        log.info("spawned %d worker actors %s", cmd.world_size, cmd.worker_name)
        # 7. announce
        try:
            await client.upsert_world(x_world, [1], 1, None, {})
        except Exception as e:  # noqa: BLE001
            raise BootstrapError(f"cannot create controller world {x_world}: {_err_text(e)}") from None
    except BaseException:
        if created:
            await _stop_worlds(client, [cmd.worker_world, x_world])
        if handle is not None:
            await handle.shutdown("bootstrap failed", leave=True)
        await _close_client(client)
        raise
    # 8. ready
    on_ready(str(handle.addr))
    assert isinstance(controller, ControllerActor) or controller is None
    return await _serve(cmd, client, handle, controller, inst, stop, [cmd.worker_world, x_world])


async def _close_client(client: Any) -> None:
    try:
        async with asyncio.timeout(2.0):
            await client.close()
    except Exception as e:  # noqa: BLE001 - best effort
        log.debug("closing the bootstrap client: %s", e)


async def _serve(cmd: ControllerCommand, client: Any, handle: Any, controller: Any, inst: Any,
                 stop: asyncio.Event, worlds: list[str]) -> tuple[int, str | None]:
    """Step 9: run until the proc stops, a signal arrives or the actor dies (§2.4)."""
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
        reason = "system lost" if code == 1 and why and why.startswith("lost contact") else "stopped"
        try:
            async with asyncio.timeout(10.0):
                await handle.shutdown(reason, leave=handle.agent.state == "Joined")
        except Exception as e:  # noqa: BLE001 - best effort at exit
            log.warning("controller proc shutdown: %s", _err_text(e))
        await _close_client(client)
    return code, why
