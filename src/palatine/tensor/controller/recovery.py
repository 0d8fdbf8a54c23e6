"""Recovering lost worker ranks: the I/O half of `Recover`

`recover_ranks` brings lost ranks back: it picks them (the named ones, else the dead
ranks and the culprits of a ``stuck`` Failure), has each one's host SIGKILL what is left
of it (`KillProc`), asks the system to start its proc again (`RespawnProcs`), waits until
the new incarnations have joined, and spawns a worker actor on each. It returns the new
procs' records; the ControllerActor then counts the ranks as having passed every seq so
far and has its cores watch them again (`SupervisionMonitor.revive`,
`ProgressMonitor.revive`).

It takes what it needs explicitly: the actor's mailbox and proc, the controller's
params, the `SupervisionMonitor` (it reads the dead ranks and records, and marks the ranks
the system has as ended) and the ranks a ``stuck`` Failure named. Every wait is bounded by
the spawn timeout; a failure raises, with a text that names the rank's proc, pid and host.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Set

import msgspec

from palatine.core.mailbox import Mailbox
from palatine.core.proc import Proc
from palatine.errors import error_text
from palatine.ids import SYSTEM_ACTOR, ActorId, ProcId
from palatine.protocol.agent import KillProc, Spawn
from palatine.protocol.controller import ControllerParams, WorkerProcRecord
from palatine.protocol.system import ProcEntry, Rejected, RespawnProcs, Snapshot, SnapshotFilter
from palatine.protocol.worker import WorkerParams
from palatine.tensor.controller.supervision import SupervisionMonitor

__all__ = ["RECOVER_GRACE_S", "recover_ranks"]

log = logging.getLogger(__name__)

#: How long a recovery waits for a rank it was asked to bring back, and that the system
#: still has alive, to be known as ended (a signal in flight, a lost host's procs).
RECOVER_GRACE_S = 5.0


def _now() -> float:
    return asyncio.get_running_loop().time()


async def recover_ranks(
    mailbox: Mailbox,
    proc: Proc,
    params: ControllerParams,
    controller: ActorId,
    supervision: SupervisionMonitor,
    *,
    ranks: Iterable[int] | None,
    stuck: Set[int],
    culprits: Iterable[int],
) -> dict[int, WorkerProcRecord]:
    """Bring lost ranks back: respawn their procs through the system, spawn a worker
    actor (`WorkerParams` naming ``controller``) on each; the new procs' records, by rank
    in rank order (empty: nothing to recover).

    Without ``ranks``: the dead ranks, and ``culprits`` (those of a ``stuck`` Failure,
    `palatine.tensor.controller.progress.culprits`). What is left of each rank is killed
    first by its host (`_end_procs`: a rank in ``stuck`` is alive). A named rank the
    system still has alive is waited for (`RECOVER_GRACE_S`: its death may be on its
    way, as for a lost host's procs), then refused unless in ``stuck``. Every step is
    bounded by the spawn timeout; a failure raises (the client's recovery fails with the
    reason)."""
    p = params
    deadline = _now() + p.spawn_timeout_s
    # The system may know of deaths not reported here yet (a lost host's procs come
    # one by one): count them as dead (their late reports name an old pid: ignored).
    supervision.mark_ended(await _await_ended(mailbox, p, (), deadline))
    if ranks is not None:
        wanted = set(ranks)
    else:
        wanted = supervision.dead_ranks | set(culprits)
    chosen = sorted(wanted)
    if not chosen:
        return {}
    for r in chosen:
        if not 0 <= r < p.world_size:
            raise ValueError(f"rank {r} is not in the worker world of {p.world_size}")
    named = [r for r in chosen if r not in supervision.dead_ranks and r not in stuck]
    if named:
        until = min(deadline, _now() + RECOVER_GRACE_S)
        supervision.mark_ended(await _await_ended(mailbox, p, named, until))
        for r in named:
            if r not in supervision.dead_ranks:
                rec = supervision.record(r)
                where = f" (pid {rec.pid}, host {rec.host})" if rec is not None else ""
                raise ValueError(
                    f"rank {r} of {p.worker_world}{where} is alive and not declared "
                    "stuck: only a lost or stuck rank is recovered"
                )
    alive = [r for r in chosen if r not in supervision.dead_ranks]
    unreachable = await _end_procs(mailbox, p, supervision, chosen, alive, deadline)
    if ranks is None and unreachable:
        # A host that cannot be reached (cut off, gone) takes its other ranks with it;
        # the system declares them one by one as it learns: wait for them (bounded) and
        # bring them back in this call too, instead of leaving them to the next failure.
        siblings = [
            r
            for r in range(p.world_size)
            if r not in chosen
            and (rec := supervision.record(r)) is not None
            and rec.host_proc in unreachable
        ]
        if siblings:
            until = min(deadline, _now() + RECOVER_GRACE_S)
            ended = await _await_ended(mailbox, p, siblings, until)
            supervision.mark_ended(ended)
            chosen = sorted(set(chosen) | (ended & set(siblings)))
    reply = await mailbox.ask(
        SYSTEM_ACTOR, RespawnProcs(world_id=p.worker_world, ranks=chosen), p.spawn_timeout_s
    )
    if isinstance(reply, Rejected):
        raise reply.to_error()
    procs = {r: p.worker_world.proc(r) for r in chosen}
    records = await _await_joined(mailbox, p, procs, deadline)
    for pid in procs.values():
        proc.peer_back(pid)
    worker_params = {
        r: WorkerParams(
            world_size=p.world_size,
            rank=r,
            device_index=p.worker_device_index,
            controller_actor=controller,
        )
        for r in chosen
    }
    spawned = await asyncio.gather(
        *(
            mailbox.ask(
                procs[r].actor("proc"),
                Spawn(
                    actor_type=p.worker_actor_type,
                    actor_name=p.worker_name,
                    params=msgspec.msgpack.encode(worker_params[r]),
                ),
                max(0.1, deadline - _now()),
            )
            for r in chosen
        ),
        return_exceptions=True,
    )
    for r, res in zip(chosen, spawned, strict=True):
        if isinstance(res, BaseException):
            raise RuntimeError(f"the worker actor of rank {r} did not start: {res}") from res
    if ranks is None:
        # Ranks declared lost while this ran (the other procs of a cut-off host, which
        # the system declares one by one as it learns) are taken in by the same call.
        later = await _await_ended(mailbox, p, (), deadline)
        more = sorted(later - set(chosen) - set(records))
        if more:
            log.info("recovery: ranks %s were lost while it ran; recovering them too", more)
            records.update(
                await recover_ranks(
                    mailbox,
                    proc,
                    params,
                    controller,
                    supervision,
                    ranks=more,
                    stuck=set(),
                    culprits=(),
                )
            )
    return dict(sorted(records.items()))


async def _worker_entries(
    mailbox: Mailbox, params: ControllerParams, until: float
) -> dict[int, ProcEntry | None] | None:
    """The system's entry of each worker rank's proc (None: no record); None when
    the worker world is gone. Asked within ``until``."""
    world = params.worker_world
    snap = await mailbox.ask(
        SYSTEM_ACTOR,
        Snapshot(filter=SnapshotFilter(worlds=[world])),
        max(0.1, until - _now()),
    )
    w = snap.worlds.get(world.name)
    if w is None:
        return None
    return {r: w.procs.get(str(world.proc(r))) for r in range(params.world_size)}


async def _await_ended(
    mailbox: Mailbox, params: ControllerParams, ranks: Iterable[int], until: float
) -> set[int]:
    """The worker ranks whose procs the system has as ended (or has no record of),
    once every one of ``ranks`` is among them or at ``until``, whichever is first."""
    while True:
        entries = await _worker_entries(mailbox, params, until)
        if entries is None:
            return set()
        ended = {r for r, e in entries.items() if e is None or e.health != "Alive"}
        if ended.issuperset(ranks) or _now() >= until:
            return ended
        await asyncio.sleep(0.01)


async def _end_procs(
    mailbox: Mailbox,
    params: ControllerParams,
    supervision: SupervisionMonitor,
    ranks: list[int],
    stuck: list[int],
    deadline: float,
) -> set[ProcId]:
    """Make sure no process of ``ranks`` still runs before they are respawned: each
    one's host is asked to SIGKILL it (`KillProc`, that pid). That ends a ``stuck``
    rank, and a rank declared dead whose process is still there (expired: stopped, or
    cut off); a host that cannot be reached is logged (its procs are gone with it, or
    cut off with it). Then wait (until ``deadline``) until the system has the stuck
    ones ended. Errors name the rank's proc, pid and host. The hosts that could not be
    reached."""
    procs = {r: params.worker_world.proc(r) for r in ranks}
    unreachable: set[ProcId] = set()

    def who(r: int) -> str:
        rec = supervision.record(r)
        where = f"pid {rec.pid}, host {rec.host or '?'}" if rec is not None else "unknown"
        return f"{procs[r]} (rank {r}, {where})"

    async def end(r: int) -> None:
        record = supervision.record(r)
        if record is None or record.host_proc is None:
            if r in stuck:
                raise RuntimeError(f"{who(r)} is stuck and its host is not known")
            return
        why = "declared stuck" if r in stuck else "declared dead"
        kill = KillProc(proc_id=procs[r], pid=record.pid, reason=f"{why}; for a recovery")
        bound = max(0.1, min(deadline, _now() + RECOVER_GRACE_S) - _now())
        try:
            killed = await mailbox.ask(record.host_proc.actor("proc"), kill, bound)
        except Exception as e:  # noqa: BLE001 - reported below, or fatal when stuck
            if r in stuck:
                raise RuntimeError(f"cannot kill {who(r)}: {error_text(e)}") from e
            log.warning("recovery: could not reach the host of %s: %s", who(r), error_text(e))
            unreachable.add(record.host_proc)
            return
        if killed.proc_ids:
            log.warning("recovery: killed %s (%s)", who(r), why)

    results = await asyncio.gather(*(end(r) for r in ranks), return_exceptions=True)
    for res in results:
        if isinstance(res, BaseException):
            raise res
    if not stuck:
        return unreachable
    ended = await _await_ended(mailbox, params, stuck, deadline)
    if not ended.issuperset(stuck):
        left = ", ".join(who(r) for r in stuck if r not in ended)
        raise TimeoutError(f"{left}: still running at the recovery's deadline after SIGKILL")
    supervision.mark_ended(stuck)
    return unreachable


async def _await_joined(
    mailbox: Mailbox, params: ControllerParams, procs: dict[int, ProcId], deadline: float
) -> dict[int, WorkerProcRecord]:
    """Wait (until ``deadline``) until every respawned proc has joined alive; their
    records. A proc that fails while starting fails the wait, naming it."""
    while True:
        known = await _worker_entries(mailbox, params, deadline) or {}
        entries = {r: known.get(r) for r in procs}
        if all(e is not None and e.health == "Alive" for e in entries.values()):
            return {
                r: WorkerProcRecord(
                    rank=r,
                    proc_id=procs[r],
                    pid=e.pid,
                    host=e.host,
                    addr=e.addr,
                    host_proc=ProcId.parse(e.host_proc) if e.host_proc else None,
                )
                for r, e in entries.items()
                if e is not None
            }
        for r, e in entries.items():
            if e is not None and e.health != "Alive":
                raise RuntimeError(
                    f"{procs[r]} failed while starting again: {e.reason or e.health}"
                )
        if _now() > deadline:
            waiting = [str(procs[r]) for r, e in entries.items() if e is None]
            raise TimeoutError(
                f"{', '.join(waiting)} did not start again within {params.spawn_timeout_s:g} s"
            )
        await asyncio.sleep(0.01)
