"""The elastic launcher behind ``palatine torchrun``: a program on every proc of a mesh,
the whole group started again when a rank fails, as torchrun's agent does.

Each attempt spawns a fresh proc mesh (forked from the host's warm fork server, not cold
interpreters), an `SPMDActor` on each proc, and starts the program on every rank with
``TORCHELASTIC_RESTART_COUNT`` set to the attempt. It then waits for one of:

* every rank's `RankExited` with status 0: the run succeeded;
* a rank's `RankExited` with another status (an exit code, an exception), or the death of
  a rank's proc (palatine's supervision names it, with world, rank, host, pid and signal,
  milliseconds after it happened, as a `palatine.errors.MeshFailure`).

On a failure the launcher says so at once, gathers what else fails in the next moments
(a rank's death makes its peers' collectives fail: the death, not those, is the root
cause), shows where the ranks still running are, stops the group (a process group cannot
lose a member) and starts the next attempt while the old group stops, up to
``max_restarts`` restarts; the failures of the last one are its result.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from palatine import config
from palatine.core.future import Future
from palatine.core.ports import Channel, Port, PortReceiver
from palatine.core.shape import Extent
from palatine.core.supervision_hook import set_unhandled_fault_hook
from palatine.errors import MeshFailure
from palatine.ids import ProcId
from palatine.job.procmesh import ProcMesh
from palatine.mesh.actor_mesh import ActorMesh
from palatine.spmd.actor import RankExited, SPMDActor
from palatine.spmd.script import ScriptFailed, describe

__all__ = [
    "ElasticResult",
    "GroupOutcome",
    "HostsLike",
    "Interrupted",
    "Launch",
    "RankFailure",
    "launch",
]

log = logging.getLogger(__name__)

#: How long, after a group's first failure that is not a death, further failures of it
#: are gathered before it is stopped (the root cause is then a death reported just after,
#: not its peers' broken collectives).
GATHER_S = 0.25
#: How long rank 0 may take to host the rendezvous store (importing torch, when its fork
#: server had not).
STORE_S = 120.0
#: How long a running rank has to tell its program's stack.
STACK_S = 5.0
#: How often the wait for the ranks wakes up (to notice Ctrl-C).
POLL_S = 0.5

_SIGNAL = re.compile(r"killed by signal (\d+)")
_CODE = re.compile(r"exited with code (-?\d+)")


class HostsLike(Protocol):
    """Where the procs come from: ``this_host()`` or a job's ``host_mesh()``."""

    def spawn_procs(self, per_host: dict[str, int] | None = None) -> ProcMesh: ...


@dataclass
class RankFailure:
    """One rank's failure, in torchrun's terms: ``exit_code`` is negative for a signal
    (``-9``), ``error`` is the first line of what went wrong."""

    rank: int
    local_rank: int
    host: str
    pid: int
    exit_code: int
    error: str
    traceback: str = ""
    proc: str = ""  # the palatine proc (``mesh0[2]``)
    died: bool = False  # its process ended (a signal, an exit): not the program's return
    at: float = field(default_factory=time.time)

    @property
    def signal_name(self) -> str | None:
        if self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return None

    def describe(self) -> str:
        """``rank 2 (mesh0[2], pid 1234 on node1): killed by signal 9 (SIGKILL)``."""
        where = ", ".join(p for p in (self.proc, f"pid {self.pid}", f"on {self.host}") if p)
        return f"rank {self.rank} ({where}): {self.error}"


@dataclass
class ElasticResult:
    """How a launch ended: ``status`` 0 when every rank succeeded, else 1 (torchrun's);
    ``failures`` of the last attempt, root cause first; ``restarts`` made."""

    status: int
    failures: list[RankFailure]
    restarts: int
    program: str


@dataclass
class Launch:
    """What to run, where, and how to report: `launch`'s arguments (see there)."""

    program: list[str]
    hosts: HostsLike
    per_host: dict[str, int]
    max_restarts: int = 0
    say: Callable[[str], None] = print
    extra_env: dict[str, str] | None = None
    master: tuple[str | None, int | None] = (None, None)
    on_stuck: Callable[[dict[str, str]], None] | None = None
    on_start: Callable[[str], None] | None = None
    interrupted: Callable[[], bool] = lambda: False


class Interrupted(Exception):
    """The launch was interrupted (``interrupted()`` turned true): its group was stopped."""


def launch(
    program: list[str],
    hosts: HostsLike,
    per_host: dict[str, int],
    max_restarts: int = 0,
    say: Callable[[str], None] = print,
    extra_env: dict[str, str] | None = None,
    master: tuple[str | None, int | None] = (None, None),
    on_stuck: Callable[[dict[str, str]], None] | None = None,
    on_start: Callable[[str], None] | None = None,
    interrupted: Callable[[], bool] = lambda: False,
) -> ElasticResult:
    """Run ``program`` on ``hosts.spawn_procs(per_host)`` (the last dimension is a node's
    ranks), restarting the group up to ``max_restarts`` times; ``say`` gets the lines
    for the user (a failure, a restart). ``extra_env`` is set on every rank besides
    torchrun's variables. ``master``: ``MASTER_ADDR`` and ``MASTER_PORT`` when given
    (else rank 0's machine and a port free there). ``on_stuck`` gets the stacks of the
    ranks still running when a group is stopped for a failure (by proc: ``{"mesh0[2]":
    text}``), which are most often waiting in a collective for the failed rank.
    ``on_start`` gets the address of the procs' system when the first group starts.
    ``interrupted`` is asked every `POLL_S` while a group runs: once it is true, the group
    is stopped and `Interrupted` raised (a launcher's Ctrl-C or SIGTERM)."""
    plan = Launch(
        program,
        hosts,
        per_host,
        max_restarts,
        say,
        extra_env,
        master,
        on_stuck,
        on_start,
        interrupted,
    )
    failures: list[RankFailure] = []
    stopping: Future[None] | None = None  # the last group's stop, overlapping the next
    try:
        for attempt in range(max_restarts + 1):
            failures, stopping = _attempt(plan, attempt, stopping)
            if not failures:
                return ElasticResult(0, [], attempt, describe(program))
            if attempt < max_restarts:
                say(
                    f"restarting the group ({attempt + 1} of {max_restarts} restarts; "
                    f"TORCHELASTIC_RESTART_COUNT={attempt + 1})"
                )
        return ElasticResult(1, failures, max_restarts, describe(program))
    finally:
        if stopping is not None:
            stopping.get(_stop_s())


def _stop_s() -> float:
    """The bound of a group's stop (its procs' stop timeout, and the world's removal)."""
    return config.get().proc_stop_timeout_s + 30


class GroupOutcome:
    """What a running group's ranks have told the launcher (sans-IO): which succeeded,
    which failed, and how long to wait for more (`wait_s`).

    The group's end is decided here: every rank succeeded, or a failure was gathered. A
    death is the root cause, and ends the wait at once, also when its peers' failed
    collectives were reported first (they often are: a peer's connection breaks before the
    supervision of the dead proc names it). Any other failure may be a death's
    consequence, so further failures are gathered for `GATHER_S` after the first.
    """

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.ok: set[int] = set()
        #: In the order reported; at most one per rank (the first said of it).
        self.failures: list[RankFailure] = []
        #: When the gathering ends (monotonic); None while nothing failed.
        self.gather_until: float | None = None

    def succeeded(self, rank: int) -> None:
        self.ok.add(rank)

    def failed(self, failure: RankFailure, now: float) -> bool:
        """Record ``failure`` at ``now``; False when its rank's failure was known already."""
        if failure.rank in {f.rank for f in self.failures}:
            return False
        self.failures.append(failure)
        if failure.died:
            self.gather_until = now
        elif self.gather_until is None:
            self.gather_until = now + GATHER_S
        return True

    def wait_s(self, now: float) -> float | None:
        """How long to wait for the next report; None when the group's run has ended."""
        if len(self.ok) >= self.ranks:
            return None
        if self.gather_until is None:
            return POLL_S
        left = self.gather_until - now
        return left if left > 0 else None

    def running(self) -> list[int]:
        """The ranks that neither succeeded nor failed."""
        done = self.ok | {f.rank for f in self.failures}
        return [r for r in range(self.ranks) if r not in done]


def _attempt(
    plan: Launch, attempt: int, previous: Future[None] | None
) -> tuple[list[RankFailure], Future[None]]:
    """One group: spawn it, run the program until it ended or failed; its failures and
    its stop, begun (a failed group stops while the next one starts: ``previous`` is
    waited for once this group runs)."""
    try:
        procs = plan.hosts.spawn_procs(per_host=plan.per_host)
    except BaseException:
        if previous is not None:
            previous.get(_stop_s())
        raise
    try:
        failures = _run_group(plan, attempt, procs, previous)
    except BaseException:
        procs.stop().get(_stop_s())
        raise
    return failures, procs.stop()


def _run_group(
    plan: Launch, attempt: int, procs: ProcMesh, previous: Future[None] | None
) -> list[RankFailure]:
    report: Port[Any]
    receiver: PortReceiver[Any]
    report, receiver = Channel.open()
    before = set_unhandled_fault_hook(report.send)  # a proc's death arrives with the exits
    try:
        n = len(procs)
        local = list(plan.per_host.values())[-1]
        actors = procs.spawn("spmd", SPMDActor)
        first = actors.slice(**dict.fromkeys(procs.sizes, 0))
        rpc_s = config.get().rpc_timeout_s
        # The rendezvous store is up before any rank's program starts (torchrun's agent
        # store): no rank retries its connection while rank 0's program imports torch.
        env = {**(plan.extra_env or {}), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        store = first.serve_store.call_one(n, plan.master[0], plan.master[1] or 0, env)
        addr, port = store.get(STORE_S)
        if attempt == 0 and plan.on_start is not None:
            plan.on_start(first.system_addr.call_one().get(rpc_s))
        started = actors.start.call(
            addr, port, plan.program, report, attempt, plan.max_restarts, env
        )
        if previous is not None:  # (the last group stopped meanwhile)
            previous.get(_stop_s())
        started.get(rpc_s)
        outcome = GroupOutcome(n)
        while (wait := outcome.wait_s(time.monotonic())) is not None:
            if plan.interrupted():
                raise Interrupted(f"{describe(plan.program)} on {procs.world}")
            try:
                msg = receiver.recv(timeout=wait).get()
            except TimeoutError:
                continue
            if isinstance(msg, RankExited) and msg.attempt == attempt and msg.status == 0:
                outcome.succeeded(msg.rank)
                continue
            failure = _failure_of(msg, procs, local, attempt)
            if failure is not None and outcome.failed(failure, time.monotonic()):
                plan.say(failure.describe())
        failures = outcome.failures
        running = outcome.running()
        died = any(f.died for f in failures)  # (then the others' collectives fail anyway)
        if failures and running and not died and plan.on_stuck is not None:
            plan.on_stuck(_stacks(actors, procs, running))
        return _root_first(failures)
    finally:
        set_unhandled_fault_hook(before)
        receiver.close()


def _stacks(actors: ActorMesh, procs: ProcMesh, ranks: list[int]) -> dict[str, str]:
    """The programs' stacks on ``ranks`` (by proc), each asked within `STACK_S`."""
    extent = Extent.of(list(procs.sizes.items()))
    asked = [(r, actors.slice(**extent.point(r)).stack.call_one()) for r in ranks]
    out = {}
    for r, fut in asked:
        try:
            text = fut.get(STACK_S)
        except Exception as e:  # noqa: BLE001 - a rank that cannot answer is named so
            text = f"(no stack: {e})\n"
        if text:
            out[str(procs.world.proc(r))] = text
    return out


def _failure_of(msg: Any, procs: ProcMesh, local: int, attempt: int) -> RankFailure | None:
    """The failure ``msg`` tells of (None: a success, or news of another group)."""
    if isinstance(msg, RankExited):
        if msg.attempt != attempt or msg.status == 0:
            return None
        status = msg.status
        if isinstance(status, ScriptFailed):
            code, error, tb = 1, status.first_line, status.traceback
        else:
            code, error, tb = status, f"exited with code {status}", ""
        return RankFailure(
            msg.rank,
            msg.local_rank,
            msg.host,
            msg.pid,
            code,
            error,
            tb,
            proc=str(procs.world.proc(msg.rank)),
            at=msg.ended_at,
        )
    if isinstance(msg, MeshFailure):
        try:
            proc = ProcId.parse(msg.actor_id.split(".", 1)[0])
        except ValueError:
            return None
        if proc.world != procs.world:
            return None
        message = msg.message.removeprefix("its proc died: ")
        by_signal, by_code = _SIGNAL.search(message), _CODE.search(message)
        exit_code = (
            -int(by_signal.group(1)) if by_signal else int(by_code.group(1)) if by_code else 1
        )
        return RankFailure(
            proc.rank,
            proc.rank % local,
            msg.host or socket.gethostname(),
            msg.pid,
            exit_code,
            message,
            msg.traceback,
            proc=str(proc),
            died=msg.actor_id == str(proc),
        )
    log.debug("ignoring %r on the launcher's port", msg)
    return None


def _root_first(failures: list[RankFailure]) -> list[RankFailure]:
    """Failures with the root cause first: the first rank whose process died, else the
    first reported (a dead peer makes the others' collectives fail right after)."""
    died = [f for f in failures if f.died]
    root = died[0] if died else (failures[0] if failures else None)
    return [root, *(f for f in failures if f is not root)] if root else []
