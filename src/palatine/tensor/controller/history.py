"""The controller's invocation History: dependencies, results, refs.

The client numbers its invocations (``seq``, strictly increasing) and names worker-side
values with ``ref`` integers. For every accepted ``Node`` the History records which refs
the invocation uses and defines, links it to the live invocations it depends on, and
guarantees **exactly one** Result per accepted Node:

* an *eager* error, as soon as a failure (``RemoteFunctionFailed``) reaches it or it uses
  a ref that is already ``Errored``;
* otherwise a *completion* report (``None``, ``Ok(value)`` or a not-yet-reported error)
  once every rank of the worker world has passed its seq (client ``Status``).

It is sans-IO and synchronous: the ControllerActor calls one method per inbound message
and sends the returned reports, in order, as ``Result{seq, result}`` messages. Time is
passed in (``now``) where needed. Every operation is O(1) amortized per invocation (a
Status may purge many invocations at once, each exactly once; ``min_frontier`` and
``min_progress`` are kept with a counted min-heap, O(log N) per Status).

Wire invariants (the structs below travel inside ``Result`` / ``FetchResult``):

* ``Result.result`` is ``None`` (done, no value), ``Ok(value)`` (the worker's pickle plus
  out-of-band buffers, never decoded here) or ``Err(Error)``; ``Ok``/``Err`` are a
  tagged union (array-like: ``["Ok", value]`` / ``["Err", error]``).
* ``Error{seq, caused_by, error}``: ``seq`` is the invocation the error is attached to,
  ``caused_by`` the root failing seq, ``error`` the root's ``WorkerError``
 . A root error has ``seq == caused_by``.
* ``FetchResult.value`` is ``Ok(value)`` or ``Err(WorkerError)``.

The payload types (the pickled value, ``WorkerError``) are opaque to the History; the
structs are generic so the message modules can parametrise them for decoding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any, TypeAlias

import msgspec

from palatine.protocol.controller import Deadline, Error, HistorySnapshot
from palatine.protocol.worker import Err, Ok
from palatine.tensor.controller.min_tracker import MinTracker

__all__ = [
    "Errored",
    "History",
    "Invocation",
    "Invoked",
    "Outcome",
    "Ref",
    "RefState",
    "Report",
    "Seq",
]

Seq: TypeAlias = int
"""An invocation number chosen by the client, strictly increasing (printed ``s17``)."""

Ref: TypeAlias = int
"""An integer naming a worker-side value, chosen by the client (printed ``r5``)."""

Outcome: TypeAlias = Ok[Any] | Err[Error[Any]] | None
"""What a ``Result`` says about one seq: done (``None``), a value, or an error."""

Report: TypeAlias = tuple[int, Outcome]
"""``(seq, outcome)``: one Result the controller must send to the client."""


class Invoked(msgspec.Struct, frozen=True):
    """Ref state: the latest invocation that defines the ref is ``seq``."""

    seq: int


class Errored(msgspec.Struct, frozen=True):
    """Ref state: the ref's producer failed; ``error`` is the root `Error`."""

    error: Error[Any]


RefState: TypeAlias = Invoked | Errored


class Invocation(msgspec.Struct, gc=False):
    """One live invocation (accepted Node not yet purged).

    ``result`` is ``None``, ``Ok(value)`` or ``Err(Error)``; ``users`` lists, ascending
    and without duplicates, the seqs of later invocations that used one of its defs while
    it was live (``None`` until the first one); ``reported`` is true once its Result was
    sent (only ever for errors before the purge).
    """

    seq: int
    defs: Sequence[int]
    uses: Sequence[int]
    label: str
    result: Ok[Any] | Err[Error[Any]] | None = None
    users: list[int] | None = None
    reported: bool = False


# Returned when there is nothing to report, so the common path allocates nothing.
_NO_REPORTS: tuple[Report, ...] = ()
_by_seq = itemgetter(0)


class History:
    """Invocation history of one controller: dependencies, results, refs, progress.

    Call, for each inbound message:

    * ``Node`` → `add_invocation` (raises `ValueError` with the ``Log(error)`` text when
      the seq does not increase); send its reports;
    * ``RemoteFunctionFailed`` → `propagate_exception`; send its reports;
    * ``Status{controller: false}`` → `rank_completed`; send its reports;
    * ``Status{controller: true}`` → `update_deadline_tracking` only (never completes);
    * ``FetchResult`` → `set_result` (nothing is sent now);
    * ``DropRefs`` → `delete_invocations_for_refs`.

    Reports are ``(seq, outcome)`` pairs in seq order, each to be sent as
    ``Result{seq, result=outcome}``; exactly one is ever produced per accepted Node.
    Ranks must lie in ``0..world_size-1`` (the actor drops others before calling).
    """

    __slots__ = (
        "_deadline",
        "_frontier",
        "_live",
        "_max_seq",
        "_n",
        "_order",
        "_pending_drop",
        "_pending_ref",
        "_progress",
        "_ref_status",
    )

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._n = world_size
        self._frontier = MinTracker(world_size)
        self._progress = MinTracker(world_size)
        # Live invocations by seq, and the same objects in seq order for the purge.
        self._live: dict[int, Invocation] = {}
        self._order: deque[Invocation] = deque()
        # ref -> seq of its latest definer (Invoked) or the root Error (Errored).
        self._ref_status: dict[int, int | Error[Any]] = {}
        # Dropped refs waiting for a live producer: per producer (for the purge), and
        # ref -> the producer its drop waits for. A drop names the ref's binding when it
        # was sent: redefining the ref, or removing its status, cancels the wait, so the
        # per-producer lists may hold stale entries; the purge skips those that no longer
        # match ``_pending_ref``.
        self._pending_drop: dict[int, list[int]] = {}
        self._pending_ref: dict[int, int] = {}
        self._max_seq: int | None = None
        self._deadline: Deadline | None = None

    # ----------------------------------------------------------------- inspection

    @property
    def world_size(self) -> int:
        """Number of ranks whose progress the History tracks."""
        return self._n

    @property
    def max_seq(self) -> int | None:
        """Seq of the last accepted Node, or ``None`` before the first."""
        return self._max_seq

    @property
    def min_frontier(self) -> int:
        """Smallest client-view frontier: every seq below it is complete on every rank."""
        return self._frontier.min

    @property
    def min_progress(self) -> int:
        """Smallest controller-view progress (any Status) over all ranks."""
        return self._progress.min

    @property
    def deadline(self) -> Deadline | None:
        """The current stall deadline, or ``None``."""
        return self._deadline

    @property
    def live_count(self) -> int:
        """Number of live (not yet purged) invocations."""
        return len(self._live)

    @property
    def ref_count(self) -> int:
        """Number of refs with a status (the ref map's size)."""
        return len(self._ref_status)

    @property
    def pending_drop_count(self) -> int:
        """Number of dropped refs waiting for their live producer to be purged."""
        return len(self._pending_ref)

    def frontier(self, rank: int) -> int:
        """Client-view first incomplete seq of ``rank``."""
        return self._frontier.values[rank]

    def progress(self, rank: int) -> int:
        """Controller-view progress of ``rank``: the largest seq learned from any Status."""
        return self._progress.values[rank]

    def invocation(self, seq: int) -> Invocation | None:
        """The live invocation ``seq`` (do not mutate it), or ``None``."""
        return self._live.get(seq)

    def ref_state(self, ref: int) -> Invoked | Errored | None:
        """``Invoked(seq)``, ``Errored(root)`` or ``None`` when the ref is unknown."""
        st = self._ref_status.get(ref)
        if st is None:
            return None
        if type(st) is int:
            return Invoked(st)
        assert isinstance(st, Error)
        return Errored(st)

    def is_pending_drop(self, ref: int) -> bool:
        """Whether ``ref`` was dropped and waits for its producer's purge."""
        return ref in self._pending_ref

    def op_at_or_after(self, seq: int) -> tuple[int, str] | None:
        """``(seq, label)`` of the first live invocation at or after ``seq``, or ``None``.

        Used to name the op a rank has not completed in stall and failure messages (the
        rank's progress is a first-incomplete seq, which may fall between sparse seqs).
        Linear in the live invocations before it; only called on reports.
        """
        for inv in self._order:
            if inv.seq >= seq:
                return inv.seq, inv.label
        return None

    def snapshot(self) -> HistorySnapshot:
        """A copy of the counters the controller's ``Introspect`` reply carries."""
        d = self._deadline
        return HistorySnapshot(
            max_seq=self._max_seq,
            frontiers=list(self._frontier.values),
            progress=list(self._progress.values),
            min_frontier=self._frontier.min,
            min_progress=self._progress.min,
            live_invocations=len(self._live),
            ref_map_size=len(self._ref_status),
            pending_drops=self.pending_drop_count,
            deadline=None if d is None else Deadline(d.expected, d.due, d.reported),
        )

    # ----------------------------------------------------------------- algorithms

    def add_invocation(
        self, seq: int, uses: Sequence[int], defs: Sequence[int], label: str = ""
    ) -> Sequence[Report]:
        """Record Node ``seq``; return its eager error report, if any.

        A use whose ref is ``Errored`` fails the new invocation at once (the first such
        use wins); a use whose producer is live makes this seq one of its users; any
        other use is already complete and adds no dependency. Each def then maps to this
        invocation (or to the root error if it failed); a pending drop of a def is
        cancelled, since it named the previous binding, not this new value.
        ``uses``/``defs`` are kept by reference, not copied.

        Raises `ValueError` (with the ``Log(error)`` text, nothing recorded) when ``seq``
        does not exceed the last accepted seq.
        """
        last = self._max_seq
        if last is not None and seq <= last:
            raise ValueError(f"Node s{seq} rejected: seqs must increase (last was s{last})")
        self._max_seq = seq
        inv = Invocation(seq, defs, uses, label)
        rs = self._ref_status
        live = self._live
        root: Error[Any] | None = None
        for ref in uses:
            st = rs.get(ref)
            if st is None:
                continue
            if type(st) is int:
                producer = live.get(st)
                if producer is not None:
                    users = producer.users
                    if users is None:
                        producer.users = [seq]
                    elif users[-1] != seq:
                        users.append(seq)
            elif root is None:
                assert isinstance(st, Error)
                root = st
        pending_ref = self._pending_ref
        if root is None:
            for ref in defs:
                rs[ref] = seq
            if pending_ref:
                for ref in defs:
                    pending_ref.pop(ref, None)
            live[seq] = inv
            self._order.append(inv)
            if seq < self._frontier.min:
                # Every rank already claims to have passed it (a client protocol error):
                # complete it at once rather than hold it until some later Status.
                return self._purge()
            return _NO_REPORTS
        result: Err[Error[Any]] = Err(Error(seq, root.caused_by, root.error))
        inv.result = result
        inv.reported = True
        for ref in defs:
            rs[ref] = root
        if pending_ref:
            for ref in defs:
                pending_ref.pop(ref, None)
        live[seq] = inv
        self._order.append(inv)
        if seq < self._frontier.min:
            self._purge()  # reported already; nothing more to say
        return [(seq, result)]

    def propagate_exception(self, seq: int, error: Any) -> Sequence[Report]:
        """Fail ``seq`` with root ``error`` and every live dependent (RemoteFunctionFailed).

        Walks ``users`` depth-first, each seq once, skipping seqs that are no longer
        live. Each visited invocation's defs still mapped to it become ``Errored(root)``;
        its result becomes ``Err(Error(i, seq, error))`` unless it already holds an error
        (first error wins; an ``Ok`` is replaced). Every visited, not yet reported
        invocation is reported now, in seq order. An unknown or purged ``seq`` changes
        nothing. The frontier is not moved (a failure on one stream says nothing about
        the rank's other streams).
        """
        live = self._live
        start = live.get(seq)
        if start is None:
            return _NO_REPORTS
        root: Error[Any] = Error(seq, seq, error)
        rs = self._ref_status
        reports: list[Report] = []
        seen = {seq}
        stack = [start]
        while stack:
            inv = stack.pop()
            s = inv.seq
            for ref in inv.defs:
                st = rs.get(ref)
                if type(st) is int and st == s:
                    rs[ref] = root
            result = inv.result
            if not isinstance(result, Err):
                result = Err(root if s == seq else Error(s, seq, error))
                inv.result = result
            if not inv.reported:
                inv.reported = True
                reports.append((s, result))
            users = inv.users
            if users:
                for u in users:
                    if u not in seen:
                        seen.add(u)
                        dependent = live.get(u)
                        if dependent is not None:
                            stack.append(dependent)
        if len(reports) > 1:
            reports.sort(key=_by_seq)
        return reports

    def rank_completed(self, rank: int, seq: int) -> Sequence[Report]:
        """Rank ``rank`` has completed every seq below ``seq`` (client Status).

        Advances the rank's frontier (never backwards) and its progress, then purges, in
        seq order, every live invocation below the minimum frontier, reporting each one
        that was not reported yet: its value (now safe: every rank passed it), its
        error, or ``None``. Refs still ``Invoked`` by a purged invocation stay (stale,
        harmless) until dropped; ``Errored`` refs stay so later users fail at once; refs
        dropped while it was live are removed now.
        """
        if not 0 <= rank < self._n:
            raise ValueError(f"rank {rank} outside worker world of size {self._n}")
        frontier = self._frontier
        if seq > frontier.values[rank]:
            frontier.raise_to(rank, seq)
        f = frontier.values[rank]
        progress = self._progress
        if f > progress.values[rank]:
            progress.raise_to(rank, f)
        order = self._order
        if not order or order[0].seq >= frontier.min:
            return _NO_REPORTS
        return self._purge()

    def set_result(self, seq: int, value: Ok[Any] | Err[Any]) -> None:
        """Store a fetched value or fetch error for ``seq`` (FetchResult); report nothing.

        ``Ok`` is kept only if no result is there yet; ``Err(worker_error)`` is stored as
        ``Error(seq, seq, worker_error)`` unless an error is already there. Never
        propagated (the worker reports root errors through RemoteFunctionFailed). An
        unknown or purged ``seq`` is ignored.
        """
        inv = self._live.get(seq)
        if inv is None:
            return
        if isinstance(value, Ok):
            if inv.result is None:
                inv.result = value
        elif isinstance(value, Err):
            if not isinstance(inv.result, Err):
                inv.result = Err(Error(seq, seq, value.error))
        else:
            raise TypeError(f"set_result expects Ok or Err, got {type(value).__name__}")

    def delete_invocations_for_refs(self, refs: Iterable[int]) -> None:
        """Forget the status of dropped refs (DropRefs).

        An ``Errored`` ref, or one whose producer is no longer live, is removed now (with
        any drop of it still pending); one whose producer is live is removed when that
        producer is purged (the producer's status must survive until then), unless the
        ref is redefined first (the drop named the old binding); an unknown ref is
        ignored.
        """
        rs = self._ref_status
        live = self._live
        pending = self._pending_drop
        pending_ref = self._pending_ref
        for ref in refs:
            st = rs.get(ref)
            if st is None:
                continue
            if type(st) is int and st in live:
                if pending_ref.get(ref) == st:
                    continue  # already waiting for this producer
                pending_ref[ref] = st
                waiting = pending.get(st)
                if waiting is None:
                    pending[st] = [ref]
                else:
                    waiting.append(ref)
            else:
                del rs[ref]
                if pending_ref:
                    pending_ref.pop(ref, None)

    def update_deadline_tracking(self, rank: int, seq: int) -> None:
        """Record that ``rank`` reached ``seq`` in the controller view (any Status).

        ``progress[rank] = max(progress[rank], seq, frontier[rank])``. Completes nothing:
        this is all a controller probe (``Status{controller: true}``) does.
        """
        if not 0 <= rank < self._n:
            raise ValueError(f"rank {rank} outside worker world of size {self._n}")
        f = self._frontier.values[rank]
        seq = max(seq, f)
        progress = self._progress
        if seq > progress.values[rank]:
            progress.raise_to(rank, seq)

    def arm_deadline(self, now: float, k: int, operation_timeout_s: float) -> Deadline | None:
        """Arm the single stall deadline if none is pending; return the current one.

        No Node accepted yet → ``None``. If there is no deadline or the current one was
        met (``min_progress > expected``), a new one expects ``min(min_progress + k,
        max_seq)`` by ``now + operation_timeout_s``; otherwise the current one is kept and
        its clock keeps running.
        """
        max_seq = self._max_seq
        if max_seq is None:
            return None
        d = self._deadline
        min_progress = self._progress.min
        if d is None or min_progress > d.expected:
            d = Deadline(min(min_progress + k, max_seq), now + operation_timeout_s)
            self._deadline = d
        return d

    # ----------------------------------------------------------------- internals

    def _purge(self) -> list[Report]:
        """Remove, in seq order, every live invocation below ``min_frontier``; report it.

        Each is reported unless it already was (an eager error): its value, its error,
        or ``None``. Refs dropped while it was live are removed now.
        """
        min_frontier = self._frontier.min
        order = self._order
        live = self._live
        pending = self._pending_drop
        reports: list[Report] = []
        while order and order[0].seq < min_frontier:
            inv = order.popleft()
            s = inv.seq
            del live[s]
            if not inv.reported:
                reports.append((s, inv.result))
            if pending:
                dropped = pending.pop(s, None)
                if dropped is not None:
                    self._apply_drops(s, dropped)
        return reports

    def _apply_drops(self, seq: int, refs: list[int]) -> None:
        """Remove the refs dropped while ``seq`` (just purged) was their producer.

        Only refs whose drop still waits for ``seq`` are removed: their status is still
        ``seq``'s (``Invoked(seq)``, or ``Errored`` by ``seq``'s failure), because a
        redefinition cancels the drop and a later drop of a redefined ref waits for its
        own producer. So a drop never removes the status of another invocation, live or
        failed.
        """
        rs = self._ref_status
        pending_ref = self._pending_ref
        for ref in refs:
            if pending_ref.get(ref) != seq:
                continue  # stale: redefined, removed or dropped again since
            del pending_ref[ref]
            rs.pop(ref, None)
