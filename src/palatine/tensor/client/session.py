"""The client session: one attachment to a controller, and the handles it gives out.

The session is a *program generator*: each remote call takes fresh refs for what it
defines (its caller does, before `Session.issue`: refs need no order), then, under the
session's lock, takes the next seq and hands its ``Node`` and commands to the outbox, so
seq order is send order across user threads. What comes back is routed per seq, and the
first ``Failure`` marks the session failed: pending futures and every later call raise it.

`Session` is composed of one part per concern, each in its own module:

* `ids` (`palatine.tensor.client.allocation`): seqs, refs, stream and borrow ids;
* `outbox` (`palatine.tensor.client.outbox`): how Nodes and commands leave, as batches;
* `drops` (`palatine.tensor.client.drops`): refs freed when their last handle goes;
* `results` (`palatine.tensor.client.results`): pending seqs, and what completes them;
* `recovery` (`palatine.tensor.client.recovery`): what recoveries lost and reset;
* `keepalive` (`palatine.tensor.client.liveness`): the beat that keeps it attached.

Here too are what names parts of a session on the user's side: `Handle` (a worker-side
ref), `Stream` (a named stream, and the one ``with stream.activate():`` chose), and the
`MeshView` protocol (what the modules below `DeviceMesh` need of a mesh).
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from palatine import config
from palatine.core import runtime
from palatine.core.future import Future
from palatine.errors import DeviceException, RecoveryError
from palatine.fastpath.direct_tx import DirectTx
from palatine.ids import ActorId, ProcId
from palatine.protocol.controller import Detach, Node, Recover
from palatine.protocol.worker import RequestStatus, Slice
from palatine.tensor.client.actor import ClientActor
from palatine.tensor.client.allocation import Ids
from palatine.tensor.client.drops import Drops
from palatine.tensor.client.liveness import Keepalive, watch_controller
from palatine.tensor.client.outbox import Outbox
from palatine.tensor.client.recording import Recorder
from palatine.tensor.client.recovery import RecoveryRecords
from palatine.tensor.client.results import Pending, Results
from palatine.tensor.client.scheduler import slurm_ended, slurm_job_of
from palatine.tensor.client.sites import IssueSite
from palatine.tensor.client.state import job_lost
from palatine.wire.codec import Message

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Handle", "MeshView", "Session", "Stream", "current_stream"]

log = logging.getLogger("palatine")

#: How long a session's first failure waits for Slurm to say whether it ended the job.
JOB_STATE_WAIT_S: Final = 3.0


class Handle:
    """Anything the worker knows by a ref: remote values, device meshes, process groups."""

    __slots__ = ("session", "ref", "__weakref__")

    def __init__(self, session: Session, ref: int) -> None:
        self.session = session
        self.ref = ref

    @property
    def __palatine_ref__(self) -> int:
        """The ref the worker knows this handle by (pickled as ``("ref", n)``)."""
        return self.ref


_active_stream: contextvars.ContextVar[Stream | None] = contextvars.ContextVar(
    "palatine_stream", default=None
)


def current_stream() -> Stream | None:
    """The stream ``with stream.activate():`` chose for this thread or task, if any."""
    return _active_stream.get()


class Stream:
    """A named stream: on every rank, a worker thread that runs its ops in order.

    ``Stream("other")`` names one (as Monarch's ``Stream(name)``): it is made on the
    workers of a session the first time it is used there. ``mesh.stream(name)`` gives
    the session's own object for a name (*bound*: it carries the session and the id the
    workers know it by). ``with stream.activate():`` makes ops, remote calls and
    factories in the block run on it; ``stream.borrow(t)`` lends it a tensor of another
    stream.
    """

    __slots__ = ("name", "session", "_id")

    def __init__(self, name: str, session: Session | None = None, sid: int | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Stream(name) takes a str, not {type(name).__name__}")
        self.name = name
        self.session = session  # None: not bound to a session yet (Stream(name))
        self._id = sid

    @property
    def id(self) -> int:
        """The id the workers know this stream by (a bound stream's only)."""
        if self._id is None:
            raise TypeError(f"{self!r} is not bound to a mesh yet: use mesh.stream(name)")
        return self._id

    def __repr__(self) -> str:
        return f"<Stream {self.name!r}>"

    def __eq__(self, other: object) -> bool:
        """Streams of the same name are the same stream (bound or not)."""
        return isinstance(other, Stream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def borrow(self, t: Any, mutable: bool = False) -> Any:
        """Lend mesh tensor ``t`` (of another stream) to this stream: ``borrowed, borrow
        = stream.borrow(t)``; see `palatine.tensor.client.tensor.Borrow`."""
        if not hasattr(t, "_borrow_onto"):
            raise TypeError(f"stream.borrow() takes a mesh tensor, not {type(t).__name__}")
        return t._borrow_onto(self, mutable)

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
        """Make this the stream of ops, remote calls and factories in the block."""
        token = _active_stream.set(self)
        try:
            yield self
        finally:
            _active_stream.reset(token)


class MeshView(Protocol):
    """What the modules below `palatine.tensor.client.mesh.DeviceMesh` need of a mesh: its
    session, its layout over the worker world, its streams and its worker-side handle.

    `DeviceMesh` is the one implementation; it builds on values, remote calls and
    collectives, which name only this.
    """

    session: Session
    names: list[str]
    sizes: list[int]
    strides: list[int]
    offset: int
    ranks: list[int]
    slice_spec: Slice

    def _dim(self, dim: str) -> int:
        """The index of dimension ``dim`` (ValueError naming the mesh's dims if unknown)."""
        ...

    def slice(self, **dims: int | builtins.slice) -> MeshView:
        """A sub-mesh: an int removes the dim, a Python slice keeps it."""
        ...

    def activate(self) -> contextlib.AbstractContextManager[MeshView]:
        """Make this the mesh remote calls run on, for a ``with`` block."""
        ...

    def stream(self, name: str) -> Stream:
        """The session's stream ``name``."""
        ...

    def handle(self) -> Handle:
        """This mesh's device-mesh ref on its ranks."""
        ...


class Session:
    """One client's attachment: the program it generates, and its failure state.

    Locks, always taken in this order: `lock`, then the outbox's, then the drop queue's;
    the results' condition is taken with none of them held.
    """

    def __init__(
        self,
        *,
        controller: ActorId,
        client_actor: ClientActor,
        world_size: int,
        per_host: int,
        worker_world: str,
        worker_name: str,
        liveness_timeout_s: float,
        system_client: Any,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.controller = controller
        self.actor = client_actor
        self.mailbox = client_actor.cx.mailbox
        self.world_size = world_size
        self.per_host = per_host
        self.worker_world = worker_world
        self.worker_name = worker_name
        self.liveness_timeout_s = liveness_timeout_s
        self.system_client = system_client
        self.loop = loop
        # Guards seq order (a seq is taken and its Node queued under it), `streams`, and
        # the recovery records' changes. It may be held while waiting for the loop
        # (`ensure_collectives`), so the loop thread never takes it.
        self.lock = threading.RLock()
        #: Completions outstanding at which `issue` waits (`_wait_in_flight`).
        self._in_flight_limit = config.get().client_in_flight_limit
        #: The seq at which `issue` next asks every rank for its Status (every quarter
        #: of the limit), so that completions come back even when nothing is fetched.
        self._next_status_mark = self._in_flight_limit // 4
        self._whole = Slice(offset=0, sizes=[world_size], strides=[1])
        self.ids = Ids()
        self.streams: dict[str, int] = {}  # name -> id of every stream made so far
        #: name -> the session's `Stream` object for it (made with `streams`' entry)
        self.bound_streams: dict[str, Stream] = {}
        #: Where the controller's own output goes, when this process started it (local_mesh).
        self.controller_log: str | None = None
        #: The controller's parent is this process and tells its exit (local_mesh).
        self.launcher_watches_controller = False
        #: The Slurm job this client runs in, asked how it ended on the first failure.
        self.slurm_job = slurm_job_of()
        # Failures that came while Slurm is asked about the first (None: not asking).
        self._held: list[DeviceException] | None = None
        self.failure: DeviceException | None = None
        self.closed = False
        self.detached = False
        #: The whole mesh of the session (set by `connect`): collectives start on its rank 0.
        self.root_mesh: MeshView | None = None
        self.drops = Drops()
        self.outbox = Outbox(self, self.mailbox, controller, loop, self.drops)
        self.recovery = RecoveryRecords()
        self.results = Results(self, self.recovery, loop, worker_name)
        self.keepalive = Keepalive(self, self.outbox, loop, liveness_timeout_s)
        #: The call `palatine.compile` is recording (None: none is): `issue` hands it
        #: every seq the recording thread issues.
        self.recorder: Recorder | None = None
        #: Its workers run in the procs of an actor proc mesh (`palatine.job.engine`): a
        #: mesh tensor in an actor call there arrives as the proc's own shard.
        self.actors_colocated = False
        #: The last mesh tensors sent in actor calls, kept alive until the calls after
        #: them (`Tensor.__reduce_ex__`).
        self.sent_to_actors: collections.deque[Any] = collections.deque(maxlen=1024)
        #: Called with the ranks `recover` brought back, after it did, on the caller's
        #: thread: an engine's proc mesh spawns its actors on the new incarnations.
        self.after_recovery: Callable[[list[int]], None] | None = None
        client_actor.session = self

    @property
    def direct(self) -> DirectTx | None:
        """The session to the controller's proc, if local (the outbox sends on it)."""
        return self.outbox.direct

    @direct.setter
    def direct(self, tx: DirectTx | None) -> None:
        self.outbox.direct = tx

    def check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("mesh was shut down")
        if self.failure is not None:
            raise self.failure

    def issue(
        self,
        label: str,
        defs: list[int],
        uses: list[int],
        commands: list[tuple[Slice, Message]],
        *,
        future: Future[Any] | None = None,
        site: IssueSite | None = None,
        make_commands: Any = None,
    ) -> int:
        """Allocate a seq and queue its Node and commands, in seq order (any thread)."""
        if len(self.results.pending) >= self._in_flight_limit:
            self._wait_in_flight()
        with self.lock:
            self.check_usable()
            seq = self.ids.next_seq()
            cmds = make_commands(seq) if make_commands is not None else commands
            rec = self.recorder
            if rec is not None and rec.thread == threading.get_ident():
                rec.capture(label, defs, uses, cmds)
            if seq >= self._next_status_mark:
                # Completions come with Status; a loop that never fetches asks for none.
                cmds = [*cmds, (self._whole, RequestStatus(seq=seq, controller=False))]
                self._next_status_mark = seq + max(1, self._in_flight_limit // 4)
            self.results.pending[seq] = Pending(future, site, label)
            self.outbox.put(
                Node(seq=seq, defs=defs, uses=uses, label=label), cmds, future is not None
            )
            return seq

    def _wait_in_flight(self) -> None:
        """Backpressure (`Config.client_in_flight_limit`): send what is queued and wait,
        off the GIL, until the workers have completed a quarter of the limit (known from
        the Status `issue` asks for every quarter).

        A loop that issues faster than the workers run (a training loop that never
        fetches) would otherwise queue without bound everywhere, and its thread would
        keep the client's own event loop, which answers for the session's liveness, from
        running. Bounded by the session itself: ops that stop completing are a stall the
        controller reports, which fails the session and ends this wait with the failure.
        """
        self.outbox.send()
        resume = self._in_flight_limit * 3 // 4
        pause = 0.0005
        while len(self.results.pending) > resume:
            self.check_usable()
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def send_commands(self, commands: list[tuple[Slice, Message]]) -> None:
        """Commands without a seq of their own (CreateStream, DeleteRefs, Exit): sent now."""
        with self.lock:
            self.outbox.send(commands)

    def recover(self, ranks: list[int] | None, timeout_s: float) -> list[int]:
        """Bring lost ranks back (`DeviceMesh.recover`): the controller respawns them;
        then this session forgets its failure, marks every existing value lost on those
        ranks, starts a new generation of collectives, and gives the new incarnations
        the streams and device meshes the others have. The ranks recovered."""
        if self.closed:
            raise RuntimeError("mesh was shut down")
        if self.failure is not None and self.failure.kind not in ("proc_failed", "stuck"):
            raise RecoveryError(f"this failure cannot be recovered from: {self.failure}")
        fut: Future[Any] = runtime.call(
            lambda: self.mailbox.ask(self.controller, Recover(ranks=ranks), timeout_s)
        )
        try:
            reply = fut.get(timeout_s + 5)
        except Exception as e:
            raise RecoveryError(f"recovery failed: {e}") from e
        back = sorted(reply.ranks)
        with self.lock:
            if back:
                self.recovery.record(back, self.ids.new_ref(), self.ids.next_seq())
                cmds = self.recovery.respawn_commands(back, self.streams)
                self.failure = None
                self.system_client.client.quiet_returns = False
                self.send_commands(cmds)
        if back and self.after_recovery is not None:
            try:
                self.after_recovery(back)
            except Exception as e:
                raise RecoveryError(
                    f"ranks {back} are back, but not what else ran in their procs: {e}"
                ) from e
        return back

    def fail(self, exc: DeviceException) -> None:
        """The first Failure marks the session failed: every pending future raises it.

        The controller or the system lost (`state.JOB_LOST`) replaces any other failure that
        came first (a lost rank): later calls, and `recover`, raise what ended the job,
        not what a recovery could have undone.

        In a Slurm job, the first failure waits (at most `JOB_STATE_WAIT_S`) while Slurm
        is asked, off the loop, whether it ended the job; if it did, the failure says so
        first (``Slurm job 7 was cancelled (scancel): worker rank 1 ... exited: ...``):
        ranks that merely went are then known to have been taken by the scheduler."""
        if self._held is not None:
            self._held.append(exc)
            return
        if self.failure is None and self.slurm_job is not None and exc.kind != "stuck":
            self._held = []
            threading.Thread(
                target=self._ask_slurm, args=(exc,), name="palatine-job-state", daemon=True
            ).start()
            return
        self._fail_now(exc)

    def _ask_slurm(self, exc: DeviceException) -> None:
        """Name how Slurm ended the job on ``exc``, if it did; then fail the session with
        it and with what came meanwhile (on a thread of its own: ``scontrol`` blocks)."""
        assert self.slurm_job is not None
        try:
            why = slurm_ended(self.slurm_job, JOB_STATE_WAIT_S / 2, JOB_STATE_WAIT_S)
        except Exception as e:  # noqa: BLE001 - the failure is raised without the cause
            log.debug("asking Slurm how job %s ended: %s", self.slurm_job, e)
            why = None
        if why is not None:
            exc.message = f"{why}: {exc.message}"
            exc.args = (exc.message,)
            exc.details["ended_by"] = why
            exc.ended_by = why  # type: ignore[attr-defined]

        def land() -> None:
            held, self._held = self._held or [], None
            for e in (exc, *held):
                self._fail_now(e)

        try:
            self.loop.call_soon_threadsafe(land)
        except RuntimeError:  # (its loop has ended: nobody to tell)
            self._held = None

    def _fail_now(self, exc: DeviceException) -> None:
        """Fail the session with ``exc`` (`fail`, once Slurm has been asked)."""
        if self.failure is None or (job_lost(exc) and not job_lost(self.failure)):
            self.failure = exc
            log.error("%s", exc)
            # What the session sends from now on may come back: expected, not news.
            self.system_client.client.quiet_returns = True
        self.results.fail(self.failure)

    def start_keepalive(self) -> None:
        """Keep the session attached while it is idle (loop thread)."""
        self.keepalive.start()

    def watch_controller(self, proc: Any, controller_proc: ProcId) -> None:
        """Fail the session when the controller's proc is declared dead (loop thread)."""
        watch_controller(self, proc, controller_proc)

    def detach(self) -> None:
        """Tell the controller this client is leaving (after everything sent so far)."""
        self.detached = True
        self.keepalive.stop()
        self.outbox.tell(Detach())

    def wait_drained(self, timeout_s: float) -> int:
        """Send what is queued, then wait until no seq is pending (the timeout restarts on
        each Result); how many still are."""
        self.outbox.send()  # calls still waiting for the sweep
        return self.results.wait_drained(timeout_s)
