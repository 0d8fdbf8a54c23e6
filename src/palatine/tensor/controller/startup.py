"""The pure parts of the controller bootstrap, sans-IO.

* `ControllerCommand` — the flags of ``palatine controller`` and the fields of a serve
  ``Run.Controller`` request, with their defaults; `validate_command`
  checks it before anything starts (usage errors, `ConfigError`);
* `ControllerTimeouts` — the controller-only ``PALATINE_*`` bounds;
* the labels of the worker world and the controller proc;
* the step-3 wait: `inspect_worker_world` turns one snapshot into a `WaitState` (live,
  waiting, or failed with the fail-fast text), `not_live_text` is the actionable
  timeout message, `poll_delay` the poll period, `worker_records` the proc records kept
  for stall reports.

`palatine.tensor.controller.bootstrap` runs the sequence around these.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

import msgspec

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.config import format_seconds, roles
from palatine.config.roles import ControllerOptions
from palatine.errors import ConfigError
from palatine.ids import (
    RESERVED_ACTOR_NAMES,
    ActorId,
    ProcId,
    WorldId,
    host_world_of,
    is_host_world,
    is_reserved_world,
)
from palatine.protocol.controller import WorkerProcRecord
from palatine.protocol.supervision import signal_text
from palatine.protocol.system import WorldSnapshot
from palatine.system.worlds import MAX_PROCS_PER_HOST, MAX_WORLD_PROCS

__all__ = [
    "LABEL_CONTROLLER_ACTOR_ID",
    "LABEL_ROLE",
    "LABEL_WORKER",
    "LABEL_WORKER_WORLD",
    "WORKER_ACTOR_TYPE",
    "ControllerCommand",
    "ControllerTimeouts",
    "WaitState",
    "format_ranks",
    "inspect_worker_world",
    "not_live_text",
    "parse_key_val",
    "poll_delay",
    "proc_labels",
    "startup_failure_text",
    "validate_command",
    "worker_records",
    "world_labels",
]

LABEL_ROLE = "proc.palatine.dev/role"
LABEL_WORKER_WORLD = "proc.palatine.dev/workerWorld"
LABEL_WORKER = "world.palatine.dev/worker"
LABEL_CONTROLLER_ACTOR_ID = "world.palatine.dev/controllerActorId"
_RESERVED_LABEL_PREFIX = "proc.palatine.dev/"

WORKER_ACTOR_TYPE = "palatine.tensor.worker.WorkerActor"
"""Registered type name of the tensor worker actor (step 6)."""

_FAILED_HEALTH = ("Exited", "Expired", "ConnectionFailure")


class ControllerCommand(ControllerOptions, kw_only=True, forbid_unknown_fields=True):
    """The flags of ``palatine controller`` and the fields of a serve ``Run.Controller``
    request, with their defaults: the options of `ControllerOptions` (declared there,
    with their flags and bounds) and where the controller runs and what it creates."""

    worker_world: str
    system_addr: str
    controller_actor_id: str = "controller[0].root"
    world_size: int
    num_procs_per_host: int = 8
    worker_name: str = "worker"
    program: str | None = None
    is_cpu_worker: bool = False
    extra_proc_labels: list[tuple[str, str]] | None = None
    #: The worker world exists already (an actor proc mesh, `spawn_tensor_engine`): the
    #: controller spawns its worker actors there and leaves the world running at its end.
    adopt_world: bool = False


class ControllerTimeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Controller-only bounds from ``PALATINE_*`` variables, in seconds."""

    world_ready_s: float = 300.0
    spawn_s: float = 120.0
    stall_report_s: float = 5.0
    client_liveness_s: float = 30.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ControllerTimeouts:
        """The configured bounds (``environ``: read those variables instead of the
        process's configuration); a malformed value raises `ConfigError` (a usage error)."""
        c = config.get() if environ is None else config.from_env(environ)
        return cls(
            world_ready_s=c.controller_world_ready_timeout_s,
            spawn_s=c.controller_spawn_timeout_s,
            stall_report_s=c.stall_report_timeout_s,
            client_liveness_s=c.client_liveness_timeout_s,
        )


# --------------------------------------------------------------------------- validation


def parse_key_val(text: str) -> tuple[str, str]:
    """Split ``KEY=VALUE`` at the first ``=`` (``k=v=3`` → ``("k", "v=3")``).

    Raises `ValueError` naming the text when there is no ``=``.
    """
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"invalid KEY=value: no '=' found in '{text}'")
    return key, value


def validate_command(cmd: ControllerCommand) -> ChannelAddr:
    """Check every input before anything starts; the system's address, parsed (the
    command is where it enters as text); raise `ConfigError`.

    Beyond the flags' own syntax: the controller actor id must be ``X[0].name`` with ``X`` neither the
    worker world nor a host or reserved world and ``name`` not a reserved agent name;
    extra labels may not use the reserved ``proc.palatine.dev/`` keys; the options keep
    the bounds `ControllerOptions` declares.
    """
    try:
        addr = ChannelAddr.parse(cmd.system_addr)
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
        raise ConfigError(
            f"invalid --controller-actor-id {cmd.controller_actor_id!r}: {e}"
        ) from None
    bad = f"invalid --controller-actor-id {cmd.controller_actor_id!r}"
    if actor.proc.rank != 0 or actor.pid != 0:
        raise ConfigError(
            f"{bad}: it must name pid 0 on rank 0 of its world (like controller[0].root)"
        )
    if actor.world == worker:
        raise ConfigError(f"{bad}: its world must differ from the worker world {worker}")
    if is_host_world(actor.world) or is_reserved_world(actor.world):
        raise ConfigError(f"{bad}: world {actor.world} is reserved")
    if actor.name in RESERVED_ACTOR_NAMES:
        raise ConfigError(f"{bad}: actor name {actor.name!r} is reserved for the runtime")
    if not 1 <= cmd.world_size <= MAX_WORLD_PROCS:
        raise ConfigError(f"--world-size must be in [1, {MAX_WORLD_PROCS:,}], got {cmd.world_size}")
    if not 1 <= cmd.num_procs_per_host <= MAX_PROCS_PER_HOST:
        raise ConfigError(
            f"--num-procs-per-host must be in [1, {MAX_PROCS_PER_HOST:,}], got {cmd.num_procs_per_host}"
        )
    if not cmd.worker_name.isidentifier() or cmd.worker_name in RESERVED_ACTOR_NAMES:
        raise ConfigError(
            f"invalid --worker-name {cmd.worker_name!r}: an identifier, not proc or comm"
        )
    try:
        roles.check(cmd)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
    return addr


def proc_labels(cmd: ControllerCommand) -> dict[str, str]:
    """Labels of the controller proc: role, worker world, then the extra labels."""
    labels = {LABEL_ROLE: "controller", LABEL_WORKER_WORLD: cmd.worker_world}
    for key, value in cmd.extra_proc_labels or ():
        labels[key] = value
    return labels


def world_labels(cmd: ControllerCommand) -> dict[str, str]:
    """Labels of the worker world."""
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


def startup_failure_text(
    proc: str,
    health: str,
    exit_code: int | None,
    exit_signal: int | None,
    reason: str | None,
    host: str,
    pid: int | None,
) -> str:
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
    """The verdict of one step-3 snapshot; the lowest failed rank wins."""
    if snap is None:
        return WaitState(
            present=False, live=False, joined=0, missing=list(range(size)), host_procs=[]
        )
    joined = 0
    missing: list[int] = []
    for rank in range(size):
        name = f"{world}[{rank}]"
        entry = snap.procs.get(name)
        if entry is not None and entry.health in _FAILED_HEALTH:
            text = startup_failure_text(
                name,
                entry.health,
                entry.exit_code,
                entry.exit_signal,
                entry.reason,
                entry.host,
                entry.pid,
            )
            return WaitState(
                present=True,
                live=False,
                joined=joined,
                missing=missing,
                host_procs=list(snap.host_procs),
                failure=text,
                failed_rank=rank,
            )
        if entry is not None and entry.addr:
            joined += 1
        else:
            missing.append(rank)
    return WaitState(
        present=True,
        live=snap.status == "Live",
        joined=joined,
        missing=missing,
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
    """The actionable timeout message, with a hint on one line."""
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


def worker_records(world: str, size: int, snap: WorldSnapshot | None) -> list[WorkerProcRecord]:
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
                rank=rank,
                proc_id=WorldId(world).proc(rank),
                pid=entry.pid,
                host=entry.host,
                addr=entry.addr,
                host_proc=host_proc,
            )
        )
    return out
