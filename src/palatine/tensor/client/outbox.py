"""The session's outbox: how issued Nodes and commands leave for the controller.

Each remote call queues its ``Node`` and commands here; they leave as one `Batch`
(Nodes, per-rank `Send`s, and the drops queued since) in one of two ways:

* with a **direct session** to the controller's proc (`DirectTx`, the usual case on one
  machine), from the calling thread: at once when the call is a fetch (someone will
  wait) or once `DIRECT_BATCH` calls are queued; calls nobody fetches are swept out by
  the loop within `SWEEP_S`;
* otherwise by posting one flush to the runtime loop, which sends everything queued until
  then as one `Batch` through the mailbox.

One message per flush instead of several per call is what lets one controller handle
tens of thousands of invocations per second. Batches and other messages (`Outbox.tell`)
leave in the order they were taken: on the direct session they are written under the
outbox's lock, and through the mailbox they are sent from the loop in posting order.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Final

from palatine.core import runtime
from palatine.core.mailbox import Mailbox
from palatine.fastpath.direct_tx import DirectTx
from palatine.ids import ActorId
from palatine.protocol.controller import Batch, Node, Send, Serialized
from palatine.protocol.worker import CommandGroup, Slice
from palatine.tensor.client.drops import Drops, slice_key
from palatine.tensor.client.state import SessionState
from palatine.wire.codec import Message

__all__ = ["DIRECT_BATCH", "SWEEP_S", "Outbox", "group_sends"]

SWEEP_S: Final = 0.002  # calls not followed by a fetch leave on the direct session within this
DIRECT_BATCH: Final = 256  # ... or once this many are queued
_PER_RANK_LIMIT = 4096  # world size × commands up to which a flush is grouped per rank


class Outbox:
    """The Nodes and commands queued for the controller, and how they leave.

    Its lock is taken after the session's (`Session.lock`, held by `put`'s caller) and
    before the drop queue's; the loop thread takes only this one (`_flush`, `_sweep`).
    """

    def __init__(
        self,
        state: SessionState,
        mailbox: Mailbox,
        controller: ActorId,
        loop: asyncio.AbstractEventLoop,
        drops: Drops,
    ) -> None:
        self._state = state
        self._mailbox = mailbox
        self._controller = controller
        self._loop = loop
        self._drops = drops
        #: The session to the controller's proc, if local (set once, when attaching).
        self.direct: DirectTx | None = None
        # Guards everything below and the order batches are written on `direct`; never
        # held while waiting (the loop takes it too), nor while posting to the loop.
        self._lock = threading.Lock()
        self._nodes: list[Node] = []
        self._cmds: list[tuple[Slice, Message]] = []
        self._flush_posted = False
        self._sweep_armed = False
        self._deferred = 0  # calls left for the sweep so far (only compared between sweeps)
        self._deferred_at_sweep = 0
        #: Open ``palatine.coalescing()`` blocks: while any is, calls stay queued until
        #: the outermost ends (a fetch and an explicit `send` still send).
        self._held = 0

    def hold(self) -> None:
        """A coalescing block begins: queue calls without sending them."""
        with self._lock:
            self._held += 1

    def release(self) -> None:
        """A coalescing block ends; the outermost sends what the blocks queued."""
        with self._lock:
            self._held -= 1
            if self._held:
                return
        self.send()

    def put(self, node: Node, cmds: list[tuple[Slice, Message]], fetch: bool) -> None:
        """Queue one seq's Node and its commands (any thread; the session's lock held, so
        seq order is queue order). ``fetch``: somebody will wait for it, so it goes out
        now, with the calls before it; plain calls wait for one, for the sweep, or for a
        full batch."""
        with self._lock:
            self._nodes.append(node)
            self._cmds += cmds
            if self._held and not fetch:
                return  # `release` sends it
            if self.direct is not None:
                if fetch or len(self._nodes) >= DIRECT_BATCH:
                    self._send_direct()
                    return
                self._deferred += 1
                if self._sweep_armed:
                    return
                self._sweep_armed = True
                post = False
            else:
                post = self._claim_flush()
        if post:
            runtime.post(self._flush)
        elif self.direct is not None:
            try:
                self._loop.call_soon_threadsafe(self._loop.call_later, SWEEP_S, self._sweep)
            except RuntimeError:  # the loop is closed: nothing will sweep
                with self._lock:
                    self._sweep_armed = False
                raise

    def send(self, commands: list[tuple[Slice, Message]] | None = None) -> None:
        """Send the outbox now, with ``commands`` (commands without a seq of their own:
        CreateStream, DeleteRefs, Exit) after what is queued (any thread)."""
        with self._lock:
            if commands:
                self._cmds += commands
            post = self._send_or_claim()
        if post:
            runtime.post(self._flush)

    def flush_drops(self) -> None:
        """Send the queued drops now (idle keep-alive, shutdown)."""
        if self._state.closed or self._state.failure is not None:
            return
        if self._drops.empty():
            return
        self.send()

    def tell(self, msg: Any) -> None:
        """A message for the controller after every Batch sent so far (any thread)."""
        if self.direct is not None:
            with self._lock:
                self._send_direct()
                self.direct.send([self._mailbox.envelope(self._controller, msg)])
            return
        runtime.post(lambda: self._mailbox.tell(self._controller, msg))

    def _send_or_claim(self) -> bool:
        """Send the outbox now: on the direct session from this thread, else by claiming
        the loop's flush (True: the caller posts it; see `_claim_flush`). Lock held."""
        if self.direct is not None:
            self._send_direct()
            return False
        return self._claim_flush()

    def _send_direct(self) -> None:
        """Send the outbox as one `Batch` on the direct session, from this thread (lock
        held: batches leave in the order they were taken)."""
        batch = self._take_batch()
        if batch is not None:
            assert self.direct is not None
            self.direct.send([self._mailbox.envelope(self._controller, batch)])

    def _sweep(self) -> None:
        """Send calls nobody fetched yet (loop thread, every `SWEEP_S` while calls come)."""
        with self._lock:
            if self.direct is None or self._state.closed or self._held:
                self._sweep_armed = False
                return
            self._send_direct()
            busy = self._deferred != self._deferred_at_sweep
            self._deferred_at_sweep = self._deferred
            if not busy:
                self._sweep_armed = False
                return
        self._loop.call_later(SWEEP_S, self._sweep)

    def _claim_flush(self) -> bool:
        """Whether the caller must post the flush (lock held; post after releasing it: on
        the loop thread `runtime.post` runs the flush at once). One loop wake-up sends
        everything queued until then as one `Batch`."""
        if self._flush_posted:
            return False
        self._flush_posted = True
        return True

    def _flush(self) -> None:
        """Send the queued Nodes, commands and drops as one `Batch` (loop thread).

        Only the outbox's lock is taken here: a user thread may hold the session's lock
        while it waits for the loop (`ensure_collectives`).
        """
        with self._lock:
            self._flush_posted = False
            if self._held:
                return  # `release` sends it
            if self.direct is not None:
                self._send_direct()
                return
            batch = self._take_batch()
        if batch is not None:
            self._mailbox.tell(self._controller, batch)

    def _take_batch(self) -> Batch | None:
        """The queued Nodes, commands and drops as one `Batch` (lock held). Drops stay
        queued while the session is failed or ended."""
        nodes, self._nodes = self._nodes, []
        cmds, self._cmds = self._cmds, []
        drop_refs: list[int] = []
        if not (self._state.closed or self._state.failure is not None):
            drop_cmds, drop_refs = self._drops.take()
            cmds += drop_cmds
        if not (nodes or cmds or drop_refs):
            return None
        return Batch(nodes=nodes, sends=group_sends(cmds), drop_refs=drop_refs)


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


def group_sends(cmds: list[tuple[Slice, Message]]) -> list[Send]:
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
        key = slice_key(sl)
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
