"""The client session: one attachment to a controller.

The session is a *program generator*: each remote call takes the next seq and fresh
refs under one lock (so seq order is send order across user threads), and hands
``Node`` + ``Send`` to the runtime loop, which sends them to the controller in order.
Results come back to the `ClientActor` (``user[R].client_actor[0]``): each ``Result``
completes its seq's future; ``Log`` goes to the ``palatine`` logger; the first
``Failure`` marks the session failed — pending futures and every later call raise it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import itertools
import linecache
import logging
import os
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final, Protocol

from palatine import config
from palatine.core import runtime
from palatine.core.actor import Actor, handler
from palatine.core.future import Future
from palatine.errors import (
    DeliveryError,
    DeviceException,
    LostValue,
    RecoveryError,
    RemoteException,
    StuckWorkersException,
)
from palatine.fastpath.blocking import LinkLost
from palatine.fastpath.direct_tx import DirectTx
from palatine.ids import ActorId, ProcId
from palatine.protocol.controller import (
    Batch,
    Detach,
    Error,
    Failure,
    KeepAlive,
    Log,
    Node,
    Recover,
    Result,
    Results,
    Send,
    Serialized,
)
from palatine.protocol.worker import (
    DIRECT,
    BorrowDrop,
    BorrowLastUse,
    CommandGroup,
    CreateDeviceMesh,
    CreateStream,
    DeleteRefs,
    Err,
    Exit,
    FetchedValue,
    Ok,
    Pickled,
    RequestStatus,
    Slice,
    WorkerError,
)
from palatine.wire.codec import Message, loads

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "ClientActor",
    "Handle",
    "IssueSite",
    "LocalRoles",
    "MeshView",
    "Session",
    "Stream",
    "current_stream",
    "device_exception",
    "shutdown_session",
]

log = logging.getLogger("palatine")


class IssueSite:
    """Where a call was issued: up to 10 user frames (file, line, function)."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[tuple[str, int, str]]) -> None:
        self.frames = frames

    def format(self) -> str:
        out = []
        for filename, lineno, name in self.frames:
            out.append(f'  File "{filename}", line {lineno}, in {name}')
            line = linecache.getline(filename, lineno).strip()
            if line:
                out.append(f"    {line}")
        return "\n".join(out)

    def short(self) -> str:
        if not self.frames:
            return "?"
        filename, lineno, _ = self.frames[-1]
        return f"{os.path.basename(filename)}:{lineno}"


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
    """A named stream of the session: one worker thread per rank, FIFO."""

    def __init__(self, session: Session, name: str, sid: int) -> None:
        self.session = session
        self.name = name
        self.id = sid

    def __repr__(self) -> str:
        return f"<Stream {self.name}>"

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
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


class LocalRoles(Protocol):
    """The processes a local mesh started (system, hosts, controller), which the end of its
    session stops. `palatine.tensor.client.local.LocalCluster` is the one implementation."""

    def stop(self, grace_s: float = 5.0, *, clean: bool = True) -> None:
        """Stop every role; keep the logs unless ``clean``."""


_LEVELS = {"info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def device_exception(failure: Any) -> DeviceException:
    """The user-facing exception for a controller ``DeviceFailure``."""
    details = {
        k: getattr(failure, k)
        for k in (
            "world",
            "rank",
            "proc_id",
            "host",
            "addr",
            "pid",
            "exit_code",
            "exit_signal",
            "reason",
            "actor_id",
            "actor_error",
            "ranks",
            "expected_seq",
            "ops",
            "stacks",
        )
    }
    cls = StuckWorkersException if failure.kind == "stuck" else DeviceException
    exc = cls(failure.message, failure.kind, **details)
    for k, v in details.items():
        setattr(exc, k, v)
    return exc


class ClientActor(Actor):
    """Receives the controller's ``Result``, ``Log`` and ``Failure`` for the session."""

    __palatine_name__ = "palatine.tensor.client.ClientActor"

    def __init__(self) -> None:
        self.session: Session | None = None

    @handler
    def on_result(self, msg: Result) -> None:
        if self.session is not None:
            self.session.on_result(msg)

    @handler
    def on_results(self, msg: Results) -> None:
        if self.session is not None:
            for r in msg.results:
                self.session.on_result(r)

    @handler
    def on_fetched_value(self, msg: FetchedValue) -> None:
        if self.session is not None:
            self.session.on_fetched_value(msg)

    @handler
    def on_log(self, msg: Log) -> None:
        log.log(
            _LEVELS.get(msg.level, logging.INFO), "%s", msg.message, extra={"details": msg.details}
        )

    @handler
    def on_failure(self, msg: Failure) -> None:
        if self.session is not None:
            self.session.fail(device_exception(msg.failure))

    def handle_undeliverable(self, returned: Any) -> None:
        s = self.session
        if s is not None and (s.detached or s.closed or s.failure is not None):
            return  # the controller going away after Detach (or a failure) is expected
        super().handle_undeliverable(returned)


def _slice_key(sl: Slice) -> tuple[Any, ...]:
    return (sl.offset, tuple(sl.sizes), tuple(sl.strides))


_UNFETCHED_KEPT: Final = 1000  # root errors waiting for a fetch before the oldest is warned of
SWEEP_S: Final = 0.002  # calls not followed by a fetch leave on the direct session within this
DIRECT_BATCH: Final = 256  # ... or once this many are queued
_PER_RANK_LIMIT = 4096  # world size × commands up to which a flush is grouped per rank


def _encoded(cmds: list[Message]) -> Serialized:
    return Serialized.of(cmds[0] if len(cmds) == 1 else CommandGroup(commands=cmds))  # type: ignore[arg-type]


def _rank_slices(ranks: list[int]) -> list[Slice]:
    """Sorted distinct ranks as contiguous slices."""
    out: list[Slice] = []
    start = prev = ranks[0]
    for r in ranks[1:]:
        if r != prev + 1:
            out.append(Slice(offset=start, sizes=[prev - start + 1], strides=[1]))
            start = r
        prev = r
    out.append(Slice(offset=start, sizes=[prev - start + 1], strides=[1]))
    return out


def _group_sends(cmds: list[tuple[Slice, Message]]) -> list[Send]:
    """The `Send`s for one flush's commands, each command encoded once, here.

    Consecutive commands for the same slice become one `CommandGroup`. When the flush
    addresses several slices (a call, then a fetch from one rank and a barrier on all),
    the commands are regrouped per rank instead, so each worker gets exactly one
    envelope: ranks with the same command list share one Send. Per-rank order is kept;
    different Sends reach disjoint ranks, so their relative order does not matter.
    """
    runs: list[tuple[Slice, list[Message]]] = []
    last_key: tuple[Any, ...] | None = None
    for sl, cmd in cmds:
        key = _slice_key(sl)
        if runs and key == last_key:
            runs[-1][1].append(cmd)
        else:
            runs.append((sl, [cmd]))
            last_key = key
    if len(runs) > 1:
        try:
            rank_sets = [sorted(set(sl.ranks())) for sl, _ in runs]
        except ValueError:  # a malformed slice: the controller reports it
            rank_sets = []
        total = sum(len(rs) for rs in rank_sets) * len(runs)
        if rank_sets and total <= _PER_RANK_LIMIT:
            per_rank: dict[int, list[int]] = {}
            for i, rs in enumerate(rank_sets):
                for r in rs:
                    per_rank.setdefault(r, []).append(i)
            groups: dict[tuple[int, ...], list[int]] = {}
            for r in sorted(per_rank):
                groups.setdefault(tuple(per_rank[r]), []).append(r)
            return [
                Send(
                    ranks=_rank_slices(ranks),
                    message=_encoded([c for i in idxs for c in runs[i][1]]),
                )
                for idxs, ranks in groups.items()
            ]
    return [Send(ranks=[sl], message=_encoded(cs)) for sl, cs in runs]


class _Pending:
    __slots__ = ("future", "site", "label")

    def __init__(self, future: Future[Any] | None, site: IssueSite | None, label: str) -> None:
        self.future = future
        self.site = site
        self.label = label


class Session:
    """One client's attachment: seqs, refs, pending results, failure state."""

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
        self.lock = threading.RLock()
        self._seq = itertools.count(1)
        self._ref = itertools.count(1)
        self._stream_ids = itertools.count(1)
        self._borrow_ids = itertools.count(1)
        self.streams: dict[str, int] = {}
        self.pending: dict[int, _Pending] = {}
        # Fetched values a worker sent here directly (`FetchedValue`), by seq: those
        # that came before their Result (`arrived`), and the seqs whose Result came
        # first (`awaited`: still pending until the value is here).
        self.arrived: dict[int, Pickled] = {}
        self.awaited: set[int] = set()
        self.root_sites: OrderedDict[int, tuple[IssueSite | None, str]] = OrderedDict()
        # Root errors no fetch has raised yet, with their warning text: a fetch of this
        # value (or of one computed from it) usually follows its Result, so the warning
        # waits for the end of the session (or for the oldest to leave a full table).
        self.unfetched: OrderedDict[int, str] = OrderedDict()
        #: Where the controller's own output goes, when this process started it (local_mesh).
        self.controller_log: str | None = None
        self.failure: DeviceException | None = None
        self.closed = False
        self.detached = False
        self._drops: list[tuple[int, Slice, int | None]] = []
        self._out_nodes: list[Node] = []
        self._out_cmds: list[tuple[Slice, Message]] = []
        self._flush_posted = False
        self._out_lock = threading.Lock()  # the outbox above; never held while waiting
        self.direct: DirectTx | None = None  # the session to the controller's proc, if local
        self._sweep_armed = False
        self._deferred = 0  # calls left for the sweep so far (only compared between sweeps)
        self._deferred_at_sweep = 0
        self._drop_lock = threading.Lock()
        self.collective_ref: int | None = None
        # Recoveries (`recover`): how many, the refs each one lost on which ranks (every
        # ref below the bound, on those ranks), the seqs it abandoned (their late Results
        # are dropped quietly), and what a new incarnation must be given again.
        self.generation = 0
        self.lost: list[tuple[int, frozenset[int]]] = []
        self.restored: dict[int, int] = {}  # ref -> the generation it was restored in
        self.abandoned_below = 0
        self.device_meshes: list[tuple[int, list[str], Slice]] = []
        #: The whole mesh of the session (set by `connect`): collectives start on its rank 0.
        self.root_mesh: MeshView | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._result_event = threading.Condition()
        self._drain_waiters = 0  # threads in `wait_drained` (only they need a Result's notify)
        client_actor.session = self

    # ------------------------------------------------------------ allocation
    def new_ref(self) -> int:
        return next(self._ref)

    def new_borrow(self) -> int:
        return next(self._borrow_ids)

    def check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("mesh was shut down")
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------ recovery
    def lost_ranks(self, ref: int) -> frozenset[int]:
        """The ranks value ``ref`` was lost on by recoveries (and not restored since)."""
        out: frozenset[int] = frozenset()
        since = self.restored.get(ref, 0)
        for i, (bound, ranks) in enumerate(self.lost):
            if ref < bound and i >= since:
                out |= ranks
        return out

    def check_not_lost(self, value: Any, ranks: set[int]) -> None:
        """Raise `LostValue` when ``value`` is needed on a rank where a recovery lost it."""
        if not self.lost:
            return
        gone = self.lost_ranks(value.ref) & ranks
        if gone:
            where = ", ".join(str(r) for r in sorted(gone))
            raise LostValue(
                f"{value!r} was lost with rank {where}: the rank died and was started again "
                "by a recovery; it is still valid on the other ranks (value.restore(fn) "
                "makes it again on the lost ranks)",
                gone,
            )

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
                self.lost.append((self.new_ref(), frozenset(back)))
                self.abandoned_below = next(self._seq)
                self.generation += 1
                self.collective_ref = None
                cmds: list[tuple[Slice, Message]] = []
                for r in back:
                    one = Slice(offset=r, sizes=[1], strides=[1])
                    for name, sid in self.streams.items():
                        cmds.append((one, CreateStream(id=sid, name=name, default=name == "main")))
                    for ref, names, spec in self.device_meshes:
                        if r in spec.ranks():
                            cmds.append(
                                (one, CreateDeviceMesh(result=ref, names=names, ranks=spec))
                            )
                self.failure = None
                self.system_client.client.quiet_returns = False
                self.send_commands(cmds)
        return back

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
        with self.lock:
            self.check_usable()
            seq = next(self._seq)
            cmds = make_commands(seq) if make_commands is not None else commands
            self.pending[seq] = _Pending(future, site, label)
            with self._out_lock:
                self._out_nodes.append(Node(seq=seq, defs=defs, uses=uses, label=label))
                self._out_cmds += cmds
                if self.direct is not None:
                    # A fetch (somebody will wait) goes out now, with the calls before it;
                    # plain calls wait for one, for the sweep, or for a full batch.
                    if future is not None or len(self._out_nodes) >= DIRECT_BATCH:
                        self._send_direct()
                        return seq
                    self._deferred += 1
                    if self._sweep_armed:
                        return seq
                    self._sweep_armed = True
                    post = False
                else:
                    post = self._claim_flush()
            if post:
                runtime.post(self._flush)
            elif self.direct is not None:
                try:
                    self.loop.call_soon_threadsafe(self.loop.call_later, SWEEP_S, self._sweep)
                except RuntimeError:  # the loop is closed: nothing will sweep
                    with self._out_lock:
                        self._sweep_armed = False
                    raise
            return seq

    def send_commands(self, commands: list[tuple[Slice, Message]]) -> None:
        """Commands without a seq of their own (CreateStream, DeleteRefs, Exit): sent now."""
        with self.lock:
            with self._out_lock:
                self._out_cmds += commands
                post = self._send_or_claim()
            if post:
                runtime.post(self._flush)

    def _send_or_claim(self) -> bool:
        """Send the outbox now: on the direct session from this thread, else by claiming
        the loop's flush (True: the caller posts it; see `_claim_flush`). ``_out_lock``
        held."""
        if self.direct is not None:
            self._send_direct()
            return False
        return self._claim_flush()

    def _send_direct(self) -> None:
        """Send the outbox as one `Batch` on the direct session, from this thread
        (``_out_lock`` held: batches leave in the order they were taken)."""
        batch = self._take_batch()
        if batch is not None:
            assert self.direct is not None
            self.direct.send([self.mailbox.envelope(self.controller, batch)])

    def _sweep(self) -> None:
        """Send calls nobody fetched yet (loop thread, every `SWEEP_S` while calls come)."""
        with self._out_lock:
            if self.direct is None or self.closed:
                self._sweep_armed = False
                return
            self._send_direct()
            busy = self._deferred != self._deferred_at_sweep
            self._deferred_at_sweep = self._deferred
            if not busy:
                self._sweep_armed = False
                return
        self.loop.call_later(SWEEP_S, self._sweep)

    def _claim_flush(self) -> bool:
        """Whether the caller must post the flush (``_out_lock`` held; post after
        releasing it: on the loop thread `runtime.post` runs the flush at once).
        One loop wake-up sends everything queued until then as one `Batch`."""
        if self._flush_posted:
            return False
        self._flush_posted = True
        return True

    def _flush(self) -> None:
        """Send the queued Nodes, commands and drops as one `Batch` (loop thread).

        Consecutive commands for the same ranks travel as one `CommandGroup`, so each
        worker gets one envelope per flush instead of one per command. Only the outbox
        lock is taken here: a user thread may hold ``self.lock`` while it waits for the
        loop (`ensure_collectives`).
        """
        with self._out_lock:
            self._flush_posted = False
            if self.direct is not None:
                self._send_direct()
                return
            batch = self._take_batch()
        if batch is not None:
            self.mailbox.tell(self.controller, batch)

    def _take_batch(self) -> Batch | None:
        """The queued Nodes, commands and drops as one `Batch` (``_out_lock`` held)."""
        nodes, self._out_nodes = self._out_nodes, []
        cmds, self._out_cmds = self._out_cmds, []
        drops = self._take_drops() if not (self.closed or self.failure is not None) else []
        drop_refs: list[int] = []
        if drops:
            cmds += self._drop_commands(drops)
            drop_refs = [r for r, _, _ in drops]
        if not (nodes or cmds or drop_refs):
            return None
        return Batch(nodes=nodes, sends=_group_sends(cmds), drop_refs=drop_refs)

    def tell(self, msg: Any) -> None:
        """A message for the controller after every Batch sent so far (any thread)."""
        if self.direct is not None:
            with self._out_lock:
                self._send_direct()
                self.direct.send([self.mailbox.envelope(self.controller, msg)])
            return
        runtime.post(lambda: self.mailbox.tell(self.controller, msg))

    # ------------------------------------------------------------ refs lifetime
    def drop_later(self, ref: int, ranks: Slice, borrow: int | None = None) -> None:
        """Called from finalizers: no I/O here, just queue (sent with the next flush).

        ``borrow`` (a borrowed handle's borrow id) releases the borrow instead of
        deleting the ref: ``BorrowLastUse`` then ``BorrowDrop``.
        """
        with self._drop_lock:
            self._drops.append((ref, ranks, borrow))

    def _take_drops(self) -> list[tuple[int, Slice, int | None]]:
        with self._drop_lock:
            drops, self._drops = self._drops, []
        return drops

    @staticmethod
    def _drop_commands(drops: list[tuple[int, Slice, int | None]]) -> list[tuple[Slice, Message]]:
        """One ``DeleteRefs`` per slice for the dropped refs; borrows are released instead."""
        by_slice: dict[tuple[Any, ...], tuple[Slice, list[int]]] = {}
        out: list[tuple[Slice, Message]] = []
        for ref, sl, borrow in drops:
            if borrow is not None:
                # the worker unbinds the borrowed ref itself (BorrowLastUse): no DeleteRefs
                out.append((sl, BorrowLastUse(borrow=borrow)))
                out.append((sl, BorrowDrop(borrow=borrow)))
                continue
            by_slice.setdefault(_slice_key(sl), (sl, []))[1].append(ref)
        for sl, refs in by_slice.values():
            out.append((sl, DeleteRefs(refs=refs)))
        return out

    def flush_drops(self) -> None:
        """Send the queued drops now (idle keep-alive, shutdown)."""
        if self.closed or self.failure is not None:
            return
        with self._drop_lock:
            if not self._drops:
                return
        with self._out_lock:
            post = self._send_or_claim()
        if post:
            runtime.post(self._flush)

    # ------------------------------------------------------------ results (loop thread)
    def on_result(self, msg: Result) -> None:
        res = msg.result
        if (
            isinstance(res, Ok)
            and res.value == DIRECT
            and msg.seq not in self.arrived
            and msg.seq in self.pending
        ):
            # The value comes from the worker itself: pending until it is here, bounded.
            self.awaited.add(msg.seq)
            bound = config.get().message_delivery_timeout_s + 10.0
            self.loop.call_later(bound, self._direct_overdue, msg.seq, bound)
            return
        entry = self._complete(msg.seq)
        if entry is None:
            if msg.seq >= self.abandoned_below and self.failure is None:
                # (else a seq the session's failure abandoned: its Result is expected)
                log.warning("protocol error: Result for unknown seq s%d", msg.seq)
            return
        if isinstance(res, Err):
            self.arrived.pop(msg.seq, None)
            err: Error[WorkerError] = res.error
            if err.caused_by == msg.seq:
                self.root_sites[msg.seq] = (entry.site, entry.label)
                while len(self.root_sites) > 1000:
                    self.root_sites.popitem(last=False)
            exc = self.remote_exception(msg.seq, err, entry)
            if entry.future is not None:
                self.unfetched.pop(err.caused_by, None)
                entry.future.set_exception(exc)
            elif err.caused_by == msg.seq:
                w = err.error
                self.unfetched[msg.seq] = (
                    f"remote function {w.function} failed at s{msg.seq} on rank {w.rank} "
                    f"(not fetched): {w.exc_type.rsplit('.', 1)[-1]}: {w.message}"
                )
                while len(self.unfetched) > _UNFETCHED_KEPT:
                    log.warning("%s", self.unfetched.popitem(last=False)[1])
            return
        if entry.future is None:
            return
        if isinstance(res, Ok):
            pickled = res.value
            if pickled == DIRECT:  # the value came from the worker itself, first
                pickled = self.arrived.pop(msg.seq)
            self._deliver(entry, pickled)
        else:
            entry.future.set_result(None)

    def _deliver(self, entry: _Pending, pickled: Pickled) -> None:
        assert entry.future is not None
        try:
            value = loads(pickled.data, list(pickled.buffers))
        except Exception as e:  # noqa: BLE001 - surfaced to the waiter
            entry.future.set_exception(e)
            return
        entry.future.set_result(value)

    def on_fetched_value(self, msg: FetchedValue) -> None:
        """A worker's direct `FetchedValue`: its fetch completes with it once the
        controller's Result for it has come too (in either order)."""
        if msg.seq in self.awaited:
            self.awaited.discard(msg.seq)
            entry = self._complete(msg.seq)
            if entry is not None and entry.future is not None:
                self._deliver(entry, msg.value)
            return
        if msg.seq not in self.pending or self.failure is not None or self.closed:
            return  # nobody will ask for it (its fetch failed, or was abandoned)
        self.arrived[msg.seq] = msg.value

    def _direct_overdue(self, seq: int, bound: float) -> None:
        """The controller said the value of ``seq`` went directly, and it never came."""
        if seq not in self.awaited:
            return
        self.awaited.discard(seq)
        entry = self._complete(seq)
        if entry is not None and entry.future is not None:
            entry.future.set_exception(
                DeliveryError(
                    f"the value of fetch s{seq} ({entry.label}) did not reach this client "
                    f"within {bound:g} s of its worker sending it"
                )
            )

    def _complete(self, seq: int) -> _Pending | None:
        """Take ``seq``'s pending entry, telling drain waiters."""
        entry = self.pending.pop(seq, None)
        if self._drain_waiters:  # read after the pop: a waiter that counts itself later sees it
            with self._result_event:
                self._result_event.notify_all()
        return entry

    def remote_exception(
        self, seq: int, err: Error[WorkerError], entry: _Pending
    ) -> RemoteException:
        w = err.error
        root_site, _root_label = self.root_sites.get(err.caused_by, (entry.site, entry.label))
        head = (
            f"remote function '{w.function}' failed at s{err.caused_by} on rank {w.rank} of "
            f"world {w.world} ({w.proc_id}, pid {w.pid}, host {w.host})"
        )
        original: BaseException | None = None
        if w.exception:
            try:
                original = loads(w.exception)
            except Exception:  # noqa: BLE001 - the text is enough
                original = None
        exc = RemoteException(
            w.exc_type,
            w.message,
            w.traceback,
            f"{w.proc_id}.{self.worker_name}[0]",
            root_site.format() if root_site is not None else "",
            headline=head,
        )
        exc.seq = seq
        exc.caused_by = err.caused_by
        exc.function = w.function
        exc.rank = w.rank
        exc.world = w.world
        exc.proc_id = w.proc_id
        exc.host = w.host
        exc.pid = w.pid
        exc.exc_type = w.exc_type
        exc.original = original
        if original is not None:
            exc.__cause__ = original
        if err.caused_by != seq:
            where = f" (issued at {entry.site.short()})" if entry.site is not None else ""
            exc.add_note(f"while fetching s{seq}{where}, which depends on s{err.caused_by}")
        return exc

    def fail(self, exc: DeviceException) -> None:
        """The first Failure marks the session failed: every pending future raises it."""
        if self.failure is None:
            self.failure = exc
            log.error("%s", exc)
            # What the session sends from now on may come back: expected, not news.
            self.system_client.client.quiet_returns = True
        for entry in list(self.pending.values()):
            if entry.future is not None:
                entry.future.set_exception(self.failure)
        self.pending.clear()
        self.arrived.clear()
        self.awaited.clear()
        with self._result_event:
            self._result_event.notify_all()

    # ------------------------------------------------------------ liveness (loop thread)
    def start_keepalive(self) -> None:
        interval = min(5.0, self.liveness_timeout_s / 3)

        def beat() -> None:
            if self.closed or self.detached:
                return
            self.flush_drops()
            self.tell(KeepAlive())
            self._keepalive = self.loop.call_later(interval, beat)

        self._keepalive = self.loop.call_later(interval, beat)

    def watch_controller(self, proc: Any, controller_proc: ProcId) -> None:
        fut = proc.watch(controller_proc)

        def gone(f: asyncio.Future[Any]) -> None:
            if f.cancelled() or self.detached or self.closed:
                return
            notice = f.result()
            where = f" (its log: {self.controller_log})" if self.controller_log else ""
            self.fail(
                DeviceException(
                    f"controller {self.controller} ({controller_proc}) is gone: {notice.reason}{where}",
                    "controller_lost",
                    proc_id=str(controller_proc),
                    reason=notice.reason,
                    pid=notice.pid,
                    host=notice.host,
                )
            )

        fut.add_done_callback(gone)

    def detach(self) -> None:
        self.detached = True
        keepalive = self._keepalive
        if keepalive is not None:
            self.loop.call_soon_threadsafe(keepalive.cancel)  # a loop timer: cancel it there
        self.tell(Detach())

    def wait_drained(self, timeout_s: float) -> int:
        """Wait until no seq is pending (the timeout restarts on each Result)."""
        with self._out_lock:
            post = self._send_or_claim()  # calls still waiting for the sweep
        if post:
            runtime.post(self._flush)
        with self._result_event:
            self._drain_waiters += 1
            try:
                last = len(self.pending)
                while self.pending and self.failure is None:
                    if not self._result_event.wait(timeout_s) and len(self.pending) == last:
                        return len(self.pending)
                    last = len(self.pending)
            finally:
                self._drain_waiters -= 1
        return 0

    def warn_unfetched(self) -> None:
        """One WARNING per root error that no fetch raised during the session."""
        while self.unfetched:
            log.warning("%s", self.unfetched.popitem(last=False)[1])

    def shutdown_pending(self) -> None:
        exc = DeviceException("mesh was shut down with this operation pending", "shutdown")
        for entry in list(self.pending.values()):
            if entry.future is not None:
                entry.future.set_exception(exc)
        self.pending.clear()


_sessions: weakref.WeakSet[Session] = weakref.WeakSet()


def shutdown_session(
    session: Session, local: LocalRoles | None, timeout: float, error: BaseException | None = None
) -> None:
    """Drain, Exit, Detach, stop the worlds (and a local mesh's processes).

    Leaving on an interrupt (``error`` a KeyboardInterrupt or SystemExit) drains nothing
    and waits less: the user asked to stop now, so everything is torn down within about
    two seconds whatever is still running."""
    if session.closed:
        return
    interrupted = error is not None and not isinstance(error, Exception)
    system_gone = getattr(session.failure, "kind", None) == "system_lost"
    healthy = session.failure is None and not interrupted
    # Interrupted, or with no system to leave: nothing stops gracefully, so no long waits.
    stop_s, gone_s = (0.5, 0.5) if interrupted or system_gone else (5.0, 10.0)
    whole = Slice(offset=0, sizes=[session.world_size], strides=[1])
    try:
        if healthy:
            session.flush_drops()
            with session.lock:
                last = max(session.pending) if session.pending else None
            if last is not None:
                session.send_commands([(whole, RequestStatus(seq=last, controller=False))])
                left = session.wait_drained(timeout)
                if left:
                    log.warning(
                        "shutdown: %d operations still pending after %g s; stopping anyway",
                        left,
                        timeout,
                    )
            session.send_commands([(whole, Exit(error=str(error) if error is not None else None))])
        session.detach()
        client = session.system_client
        client.client.quiet_returns = True

        async def stop_worlds() -> None:
            worlds = [session.worker_world, session.controller.proc.world.name]
            direct = session.direct
            if direct is not None:  # Detach and all before it are written: let it go
                try:
                    await direct.aclose(2.0)
                except LinkLost as e:
                    log.warning("shutdown: %s", e.reason)
            if system_gone:  # nobody is left to ask: the hosts stop their procs themselves
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(stop_s):
                        await client.close()
                return
            try:
                await client.stop(worlds, stop_s)
                end = asyncio.get_running_loop().time() + gone_s
                while asyncio.get_running_loop().time() < end:
                    snap = await client.snapshot(worlds=worlds)
                    if not any(w in snap.worlds and snap.worlds[w].procs for w in worlds):
                        break
                    await asyncio.sleep(0.05)
            except Exception as e:  # noqa: BLE001 - best effort
                log.debug("stopping worlds: %s", e)
            if local is not None:
                try:
                    await client.stop(None, min(2.0, stop_s))
                except Exception:  # noqa: BLE001
                    pass
            try:
                await client.close()
            except Exception:  # noqa: BLE001
                pass

        try:
            runtime.submit(stop_worlds).get(30)
        except Exception as e:  # noqa: BLE001
            log.debug("shutdown: %s", e)
    finally:
        session.closed = True
        session.shutdown_pending()
        session.warn_unfetched()
        if local is not None:
            local.stop(stop_s, clean=healthy and error is None)
