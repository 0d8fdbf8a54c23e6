"""Result routing: what comes back for each seq the session issued.

Every issued seq is pending until the controller's ``Result`` for it arrives (on the
loop thread, through the client actor); a fetch's future completes with it. A worker's
error becomes a `palatine.RemoteException` pointing at the call that failed first (its
root, whose issue site is kept) and at the fetch that asked; a root error that no fetch
raises is warned of once, at the end of the session.

Big fetched values skip the controller: the worker sends them here itself
(``FetchedValue``) and the controller's Result says only ``DIRECT``. The two may come in
either order; the fetch completes once both are here, or fails with a `DeliveryError`
when the value does not come within ``message_delivery_timeout`` + 10 s of its Result.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from typing import Any, Final

from palatine import config
from palatine.core.future import Future
from palatine.errors import DeliveryError, DeviceException, RemoteException
from palatine.protocol.controller import Error, Result
from palatine.protocol.worker import DIRECT, Err, FetchedValue, Ok, Pickled, WorkerError
from palatine.tensor.client.recovery import RecoveryRecords
from palatine.tensor.client.sites import IssueSite
from palatine.tensor.client.state import SessionState
from palatine.wire.codec import loads

__all__ = ["Pending", "Results"]

log = logging.getLogger("palatine")

_UNFETCHED_KEPT: Final = 1000  # root errors waiting for a fetch before the oldest is warned of
_ROOT_SITES_KEPT: Final = 1000  # root errors whose issue site later fetches may name


class Pending:
    """An issued seq waiting for its Result: the fetch's future (None for a plain call),
    where it was issued, and its label."""

    __slots__ = ("future", "site", "label")

    def __init__(self, future: Future[Any] | None, site: IssueSite | None, label: str) -> None:
        self.future = future
        self.site = site
        self.label = label


class Results:
    """The session's pending seqs and what completes them (loop thread, but for
    `Session.issue` adding to `pending` and `wait_drained` waiting on it)."""

    def __init__(
        self,
        state: SessionState,
        records: RecoveryRecords,
        loop: asyncio.AbstractEventLoop,
        worker_name: str,
    ) -> None:
        self._state = state
        self._records = records
        self._loop = loop
        self._worker_name = worker_name
        #: seq -> its pending entry, from `Session.issue` until its Result.
        self.pending: dict[int, Pending] = {}
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
        # Notified when seqs leave `pending`; guards `_drain_waiters`. Held only to wait
        # or to notify: never while a future is completed, nor across another lock.
        self._event = threading.Condition()
        self._drain_waiters = 0  # threads in `wait_drained` (only they need a Result's notify)

    def on_result(self, msg: Result) -> None:
        """The controller's Result for one seq (loop thread)."""
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
            self._loop.call_later(bound, self._direct_overdue, msg.seq, bound)
            return
        entry = self._complete(msg.seq)
        if entry is None:
            if msg.seq >= self._records.abandoned_below and self._state.failure is None:
                # (else a seq the session's failure abandoned: its Result is expected)
                log.warning("protocol error: Result for unknown seq s%d", msg.seq)
            return
        if isinstance(res, Err):
            self.arrived.pop(msg.seq, None)
            err: Error[WorkerError] = res.error
            if err.caused_by == msg.seq:
                self.root_sites[msg.seq] = (entry.site, entry.label)
                while len(self.root_sites) > _ROOT_SITES_KEPT:
                    self.root_sites.popitem(last=False)
            exc = self.remote_exception(msg.seq, err, entry)
            if entry.future is not None:
                self.unfetched.pop(err.caused_by, None)
                entry.future.set_exception(exc)
            elif err.caused_by == msg.seq:
                w = err.error
                self.unfetched[msg.seq] = (
                    f"{_what(w.function)} failed at s{msg.seq} on rank {w.rank} "
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

    def _deliver(self, entry: Pending, pickled: Pickled) -> None:
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
        if msg.seq not in self.pending or self._state.failure is not None or self._state.closed:
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

    def _complete(self, seq: int) -> Pending | None:
        """Take ``seq``'s pending entry, telling drain waiters."""
        entry = self.pending.pop(seq, None)
        if self._drain_waiters:  # read after the pop: a waiter that counts itself later sees it
            with self._event:
                self._event.notify_all()
        return entry

    def remote_exception(
        self, seq: int, err: Error[WorkerError], entry: Pending
    ) -> RemoteException:
        """What a fetch of ``seq`` raises for the worker error ``err`` (caused by its root)."""
        w = err.error
        root_site, _root_label = self.root_sites.get(err.caused_by, (entry.site, entry.label))
        head = (
            f"{_what(w.function)} failed at s{err.caused_by} on rank {w.rank} of "
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
            f"{w.proc_id}.{self._worker_name}[0]",
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
        """The session failed with ``exc``: every pending seq raises it; values on their
        way are dropped."""
        self._raise_in_all(exc)
        self.arrived.clear()
        self.awaited.clear()
        with self._event:
            self._event.notify_all()

    def shutdown(self) -> None:
        """The session ended: what is still pending raises."""
        self._raise_in_all(
            DeviceException("mesh was shut down with this operation pending", "shutdown")
        )

    def _raise_in_all(self, exc: BaseException) -> None:
        for entry in list(self.pending.values()):
            if entry.future is not None:
                entry.future.set_exception(exc)
        self.pending.clear()

    def wait_drained(self, timeout_s: float) -> int:
        """Wait until no seq is pending (the timeout restarts on each Result); how many
        still are."""
        with self._event:
            self._drain_waiters += 1
            try:
                last = len(self.pending)
                while self.pending and self._state.failure is None:
                    if not self._event.wait(timeout_s) and len(self.pending) == last:
                        return len(self.pending)
                    last = len(self.pending)
            finally:
                self._drain_waiters -= 1
        return 0

    def warn_unfetched(self) -> None:
        """One WARNING per root error that no fetch raised during the session."""
        while self.unfetched:
            log.warning("%s", self.unfetched.popitem(last=False)[1])


def _what(function: str) -> str:
    """How an error names what failed: an op on mesh tensors runs as its aten overload
    (``torch.ops.aten.add.Tensor``), named as torch users know it (``op
    'aten.add.Tensor'``); anything else is a remote function."""
    if function.startswith("torch.ops."):
        return f"op '{function.removeprefix('torch.ops.')}'"
    return f"remote function '{function}'"
