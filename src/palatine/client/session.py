"""The client session: one attachment to a controller (40-worker-client.md §2.1, §2.10).

The session is a *program generator*: each remote call takes the next seq and fresh
refs under one lock (so seq order is send order across user threads), and hands
``Node`` + ``Send`` to the runtime loop, which sends them to the controller in order.
Results come back to the `ClientActor` (``user[R].client_actor[0]``): each ``Result``
completes its seq's future; ``Log`` goes to the ``palatine`` logger; the first
``Failure`` marks the session failed — pending futures and every later call raise it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from palatine import runtime
from palatine.actor import Actor, handler
from palatine.controller.history import Error
from palatine.controller.messages import (
    Detach,
    DropRefs,
    Failure,
    KeepAlive,
    Log,
    Node,
    Result,
    Send,
    Serialized,
)
from palatine.errors import DeviceException, PalatineError, RemoteException, StuckWorkersException
from palatine.future import Future
from palatine.ids import ActorId, ProcId
from palatine.worker.messages import BorrowDrop, BorrowLastUse, DeleteRefs, Err, Ok, Slice, WorkerError
from palatine.wire.codec import Message, loads

if TYPE_CHECKING:
    from palatine.client.values import IssueSite

__all__ = ["Session", "ClientActor", "device_exception"]

log = logging.getLogger("palatine")

_LEVELS = {"info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def device_exception(failure: Any) -> DeviceException:
    """The user-facing exception for a controller ``DeviceFailure``."""
    details = {
        k: getattr(failure, k)
        for k in (
            "world", "rank", "proc_id", "host", "addr", "pid", "exit_code", "exit_signal",
            "reason", "actor_id", "actor_error", "ranks", "expected_seq", "ops", "stacks",
        )
    }
    cls = StuckWorkersException if failure.kind == "stuck" else DeviceException
    exc = cls(failure.message, failure.kind, **details)
    for k, v in details.items():
        setattr(exc, k, v)
    return exc


class ClientActor(Actor):
    """Receives the controller's ``Result``, ``Log`` and ``Failure`` for the session."""

    __palatine_name__ = "palatine.client.ClientActor"

    def __init__(self) -> None:
        self.session: Session | None = None

    @handler
    def on_result(self, msg: Result) -> None:
        if self.session is not None:
            self.session.on_result(msg)

    @handler
    def on_log(self, msg: Log) -> None:
        log.log(_LEVELS.get(msg.level, logging.INFO), "%s", msg.message, extra={"details": msg.details})

    @handler
    def on_failure(self, msg: Failure) -> None:
        if self.session is not None:
            self.session.fail(device_exception(msg.failure))

    def handle_undeliverable(self, returned: Any) -> None:
        s = self.session
        if s is not None and (s.detached or s.closed or s.failure is not None):
            return  # the controller going away after Detach (or a failure) is expected
        super().handle_undeliverable(returned)


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
        self.root_sites: OrderedDict[int, tuple[IssueSite | None, str]] = OrderedDict()
        self.failure: DeviceException | None = None
        self.closed = False
        self.detached = False
        self._drops: list[tuple[int, Slice, int | None]] = []
        self._drop_lock = threading.Lock()
        self.collective_ref: int | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._result_event = threading.Condition()
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
        """Allocate a seq and send its Node and commands, in seq order (any thread)."""
        with self.lock:
            self.check_usable()
            seq = next(self._seq)
            cmds = make_commands(seq) if make_commands is not None else commands
            self.pending[seq] = _Pending(future, site, label)
            drops = self._take_drops()
            msgs: list[Message] = []
            if drops:
                msgs += self._drop_messages(drops)
            msgs.append(Node(seq=seq, defs=defs, uses=uses, label=label))
            for ranks, cmd in cmds:
                msgs.append(Send(ranks=[ranks], message=Serialized.of(cmd)))
            self._send(msgs)
            return seq

    def send_commands(self, commands: list[tuple[Slice, Message]]) -> None:
        """Commands without a seq of their own (CreateStream, DeleteRefs, Exit)."""
        with self.lock:
            self._send([Send(ranks=[r], message=Serialized.of(c)) for r, c in commands])

    def _send(self, msgs: list[Message]) -> None:
        tell = self.mailbox.tell
        dest = self.controller

        def go() -> None:
            for m in msgs:
                tell(dest, m)

        runtime.post(go)

    # ------------------------------------------------------------ refs lifetime
    def drop_later(self, ref: int, ranks: Slice, borrow: int | None = None) -> None:
        """Called from finalizers: no I/O here, just queue (flushed on next send / idle).

        ``borrow`` (a borrowed handle's borrow id) releases the borrow instead of
        deleting the ref: ``BorrowLastUse`` then ``BorrowDrop`` (40-worker-client.md §1.7).
        """
        with self._drop_lock:
            self._drops.append((ref, ranks, borrow))

    def _take_drops(self) -> list[tuple[int, Slice, int | None]]:
        with self._drop_lock:
            drops, self._drops = self._drops, []
        return drops

    def _drop_messages(self, drops: list[tuple[int, Slice, int | None]]) -> list[Message]:
        by_slice: dict[tuple[Any, ...], tuple[Slice, list[int]]] = {}
        out: list[Message] = []
        for ref, sl, borrow in drops:
            if borrow is not None:
                # the worker unbinds the borrowed ref itself (BorrowLastUse): no DeleteRefs
                out.append(Send(ranks=[sl], message=Serialized.of(BorrowLastUse(borrow=borrow))))
                out.append(Send(ranks=[sl], message=Serialized.of(BorrowDrop(borrow=borrow))))
                continue
            key = (sl.offset, tuple(sl.sizes), tuple(sl.strides))
            by_slice.setdefault(key, (sl, []))[1].append(ref)
        for sl, refs in by_slice.values():
            out.append(Send(ranks=[sl], message=Serialized.of(DeleteRefs(refs=refs))))
        out.append(DropRefs(refs=[r for r, _, _ in drops]))
        return out

    def flush_drops(self) -> None:
        with self.lock:
            if self.closed or self.failure is not None:
                return
            drops = self._take_drops()
            if drops:
                self._send(self._drop_messages(drops))

    # ------------------------------------------------------------ results (loop thread)
    def on_result(self, msg: Result) -> None:
        entry = self.pending.pop(msg.seq, None)
        with self._result_event:
            self._result_event.notify_all()
        if entry is None:
            log.warning("protocol error: Result for unknown seq s%d", msg.seq)
            return
        res = msg.result
        if isinstance(res, Err):
            err: Error[WorkerError] = res.error
            if err.caused_by == msg.seq:
                self.root_sites[msg.seq] = (entry.site, entry.label)
                while len(self.root_sites) > 1000:
                    self.root_sites.popitem(last=False)
            exc = self.remote_exception(msg.seq, err, entry)
            if entry.future is not None:
                entry.future.set_exception(exc)
            elif err.caused_by == msg.seq:
                w = err.error
                log.warning(
                    "remote function %s failed at s%d on rank %d (not fetched): %s: %s",
                    w.function, msg.seq, w.rank, w.exc_type.rsplit(".", 1)[-1], w.message,
                )
            return
        if entry.future is None:
            return
        if isinstance(res, Ok):
            try:
                value = loads(res.value.data, list(res.value.buffers))
            except Exception as e:  # noqa: BLE001 - surfaced to the waiter
                entry.future.set_exception(e)
                return
            entry.future.set_result(value)
        else:
            entry.future.set_result(None)

    def remote_exception(self, seq: int, err: Error[WorkerError], entry: _Pending) -> RemoteException:
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
        for entry in list(self.pending.values()):
            if entry.future is not None:
                entry.future.set_exception(self.failure)
        self.pending.clear()
        with self._result_event:
            self._result_event.notify_all()

    # ------------------------------------------------------------ liveness (loop thread)
    def start_keepalive(self) -> None:
        interval = min(5.0, self.liveness_timeout_s / 3)

        def beat() -> None:
            if self.closed or self.detached:
                return
            self.flush_drops()
            self.mailbox.tell(self.controller, KeepAlive())
            self._keepalive = self.loop.call_later(interval, beat)

        self._keepalive = self.loop.call_later(interval, beat)

    def watch_controller(self, proc: Any, controller_proc: ProcId) -> None:
        fut = proc.watch(controller_proc)

        def gone(f: asyncio.Future[Any]) -> None:
            if f.cancelled() or self.detached or self.closed:
                return
            notice = f.result()
            self.fail(
                DeviceException(
                    f"controller {self.controller} ({controller_proc}) is gone: {notice.reason}",
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
        if self._keepalive is not None:
            self._keepalive.cancel()
        runtime.post(lambda: self.mailbox.tell(self.controller, Detach()))

    def wait_drained(self, timeout_s: float) -> int:
        """Wait until no seq is pending (the timeout restarts on each Result)."""
        with self._result_event:
            last = len(self.pending)
            while self.pending and self.failure is None:
                if not self._result_event.wait(timeout_s):
                    if len(self.pending) == last:
                        return len(self.pending)
                last = len(self.pending)
        return 0

    def shutdown_pending(self) -> None:
        exc = DeviceException("mesh was shut down with this operation pending", "shutdown")
        for entry in list(self.pending.values()):
            if entry.future is not None:
                entry.future.set_exception(exc)
        self.pending.clear()


_sessions: weakref.WeakSet[Session] = weakref.WeakSet()


class SessionError(PalatineError):
    """Misuse of a session object (used across sessions)."""
