"""Streams: one OS thread per stream, executing its commands in arrival order.

A `Stream` owns a FIFO, a thread named ``palatine-stream-<name>`` and a **refs table**
(``ref → value | SeqError``) that only its own thread touches. The worker actor's loop
posts work items (bound ``run_*`` methods) and never waits for them. What a stream
produces for the controller — `RemoteFunctionFailed`, `FetchResult`, the `Status` of a
completed barrier, replies to test hooks — is encoded on the stream thread and handed
to the worker's single outbox (`WorkerState.send`), which goes out in production order:
at the stream's flush points (before user code, before a wait, after each work item) on
the worker's direct session to the controller's proc, else through the actor's loop.
That is what keeps a root error or a fetched value ahead of any `Status` covering its
seq: a stream emits them before it reaches a later barrier.

Error classes: an exception raised by user code, by resolving or unpickling, or
by binding results is a **user error** (reported once, results and mutated refs
poisoned); a call whose input holds a `SeqError` is a **dependent error** (poisoned
silently with the root's `SeqError`); an `InfrastructureError` (duplicate ref, unknown
borrow, ``__test_panic``, a bug here) ends the stream and fails the worker actor.

The progress view (`current`, `last_completed_seq`, `queued`) is plain attributes the
loop reads without locks, so a progress query never waits for a stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from palatine import config
from palatine.errors import InfrastructureError, ValueTooLarge
from palatine.ids import PortId
from palatine.protocol.worker import (
    DIRECT,
    BackendNetworkInit,
    CallFunction,
    CreateProcessGroup,
    Err,
    FetchedValue,
    FetchResult,
    FunctionPath,
    FunctionRef,
    GetRefUnitTestsOnly,
    Ok,
    Reduce,
    RefValue,
    RemoteFunctionFailed,
    SendValue,
    SetRefUnitTestsOnly,
)
from palatine.tensor.worker import collectives, transfer
from palatine.tensor.worker.functions import Leaves as _Leaves
from palatine.tensor.worker.functions import tensor_leaves
from palatine.tensor.worker.prepared import PreparedCall
from palatine.tensor.worker.reduce import reduce
from palatine.tensor.worker.state import MISSING, Borrow, Countdown, WorkerState, set_current_stream
from palatine.tensor.worker.transfer import Transfer
from palatine.tensor.worker.values import (
    TEST_PANIC_PATH,
    ResolvedFunction,
    SeqError,
    dumps_fetched,
    load_args,
    load_value,
)
from palatine.wire.oob import InPlace

__all__ = ["InfrastructureError", "Stream"]

log = logging.getLogger(__name__)

_SIZE_WALK_ITEMS = 1000  # items looked at, at most: the walk must cost little next to the pickle


def _nbytes_at_least(value: Any, limit: int) -> bool:
    """Whether ``value``'s tensors, arrays and bytes add up to at least ``limit`` bytes
    (a quick walk through lists, tuples and dicts, before anything is pickled)."""
    total = 0
    stack = [value]
    seen = 0
    while stack and seen < _SIZE_WALK_ITEMS:
        v = stack.pop()
        seen += 1
        if isinstance(v, (bytes, bytearray, memoryview)):
            total += memoryview(v).nbytes
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        else:
            n = getattr(v, "nbytes", None)  # numpy arrays and torch tensors
            if isinstance(n, int):
                total += n
        if total >= limit:
            return True
    return False


class _Stopped(BaseException):
    """Unwinds a stream thread that was abandoned while waiting (never user-visible)."""


_WorkItem = tuple[Callable[[Any], None] | None, Any]


def _function_hint(ref: FunctionRef | None) -> str:
    if ref is None:
        return "fetch"
    if type(ref) is FunctionPath:
        return ref.path
    return "<cloudpickled function>"


class Stream:
    """One stream: a thread, its FIFO, its refs table and its progress view."""

    def __init__(self, worker: WorkerState, sid: int, name: str, default: bool) -> None:
        self.worker = worker
        self.id = sid
        self.name = name
        self.default = default
        self.refs: dict[int, Any] = {}
        self.current: tuple[int, str, float] | None = None
        self.last_completed_seq: int | None = None
        self._q: queue.SimpleQueue[_WorkItem] = queue.SimpleQueue()
        self._held: list[_WorkItem] | None = None
        self._hold_depth = 0  # open holds (a `CallRecording` inside a `CommandGroup`)
        self._abandoned = False
        self._deps: list[SeqError] = []
        self.cuda_stream: Any = None
        self.thread = threading.Thread(
            target=self._run, name=f"palatine-stream-{name}", daemon=True
        )

    def __repr__(self) -> str:
        return f"Stream({self.id}, {self.name!r})"

    # ---------------------------------------------------------------- loop side
    def start(self) -> None:
        self.thread.start()

    def post(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Queue ``fn(arg)`` to run on this stream's thread after everything queued."""
        held = self._held
        if held is not None:
            held.append((fn, arg))
        else:
            self._q.put((fn, arg))

    def hold(self) -> None:
        """Collect posts until `release` hands them over as one queue item (one wake-up
        of the stream thread for a whole `CommandGroup`, not one per command). Holds
        nest: the outermost release hands over."""
        self._hold_depth += 1
        if self._held is None:
            self._held = []

    def release(self) -> None:
        self._hold_depth -= 1
        if self._hold_depth:
            return
        self._put_held()
        self._held = None

    def _put_held(self) -> None:
        held = self._held
        if held:
            self._held = []
            self._q.put(held[0] if len(held) == 1 else (self._run_all, held))

    def _run_all(self, items: list[_WorkItem]) -> None:
        flush = self.worker.flush
        for fn, arg in items:
            if self._abandoned:
                return
            if getattr(fn, "__func__", None) not in _QUICK:
                flush()  # what came before goes out before user code runs
            fn(arg)  # type: ignore[misc]

    def run_recorded(self, arg: tuple[list[_WorkItem], int]) -> None:
        """This stream's share of a recording (`CallRecording`), in order, each command
        under the call's seq. Only this thread sets it: the commands are this stream's
        own, and the next call's items queue behind these."""
        items, seq = arg
        flush = self.worker.flush
        for fn, cmd in items:
            if self._abandoned:
                return
            cmd.seq = seq
            flush()  # what came before goes out before user code runs
            fn(cmd)  # type: ignore[misc]

    def run_prepared(self, pc: PreparedCall) -> None:
        """A recorded aten op (`run_call`'s work, its arguments rebuilt by the prepared
        fillers instead of unpickled)."""
        seq = pc.seq
        label = pc.label
        self.current = (seq, label, time.monotonic())
        cmd = pc.cmd
        results = cmd.results
        try:
            self.check_fresh(results, seq)
            try:
                deps = self._deps = []
                lookup = self._lookup
                args = pc.args(lookup)
                kwargs = pc.kwargs(lookup)
                if deps:
                    self.poison(results, deps[0])
                    self.poison(cmd.mutates, deps[0])
                    return
                self._bind(results, pc.fn(*args, **kwargs), label)
            except (InfrastructureError, _Stopped):
                raise
            except BaseException as e:  # noqa: BLE001 - as run_call
                self.user_error(seq, label, e, [*results, *cmd.mutates])
        finally:
            self.current = None
            self.last_completed_seq = seq

    @property
    def queued(self) -> int:
        """Queue items not yet taken (a held group counts once)."""
        return self._q.qsize()

    def close(self, drain: bool = True) -> None:
        """Stop after the queued work (``drain``), or as soon as possible (abandon)."""
        if not drain:
            self._abandoned = True
        self._put_held()  # work posted before the close runs before it
        self._q.put((None, None))

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        set_current_stream(self)
        try:
            self._setup_device()
            get = self._q.get
            flush = self.worker.flush
            while True:
                try:
                    fn, arg = get(timeout=1.0)
                except queue.Empty:
                    if self._abandoned:
                        return
                    continue
                if fn is None:
                    return
                if self._abandoned:
                    continue
                fn(arg)
                flush()
        except _Stopped:
            return
        except InfrastructureError as e:
            self._abandoned = True
            self.worker.fail(e)
        except BaseException as e:
            self._abandoned = True
            log.exception("stream %s of rank %d crashed", self.name, self.worker.rank)
            self.worker.fail(
                InfrastructureError(
                    f"stream {self.name} of rank {self.worker.rank} crashed: "
                    f"{type(e).__name__}: {e}"
                )
            )
        finally:
            self.current = None
            set_current_stream(None)
            self.worker.flush()

    def _setup_device(self) -> None:
        w = self.worker
        if w.device_index is None or not w.device.startswith("cuda"):
            return
        import torch

        torch.cuda.set_device(w.device_index)
        self.cuda_stream = (
            torch.cuda.default_stream()
            if self.default or self.name == "main"
            else torch.cuda.Stream()  # type: ignore[no-untyped-call]
        )
        torch.cuda.set_stream(self.cuda_stream)

    def wait_event(self, ev: threading.Event) -> None:
        """Wait for ``ev`` in slices, so an abandoned stream still unwinds."""
        self.worker.flush()
        while not ev.wait(0.1):
            if self._abandoned:
                raise _Stopped()

    # ---------------------------------------------------------------- helpers
    def _lookup(self, ref: int) -> Any:
        v = self.refs.get(ref, MISSING)
        if v is MISSING:
            v = self.worker.lookup_shared(ref)
            if v is MISSING:
                raise LookupError(
                    f"ref r{ref} not found on stream {self.name} of rank {self.worker.rank}"
                )
        if type(v) is SeqError:
            self._deps.append(v)
        return v

    def load(self, args: Any) -> tuple[tuple[Any, ...], dict[str, Any], SeqError | None]:
        """Unpickle ``(args, kwargs)`` with refs; the first errored input, if any."""
        deps = self._deps = []
        a, k = load_args(args, self._lookup)
        return a, k, (deps[0] if deps else None)

    def resolve(self, ref: FunctionRef) -> ResolvedFunction:
        if type(ref) is FunctionPath and ref.path == TEST_PANIC_PATH:
            raise InfrastructureError("__test_panic called")
        return self.worker.functions.resolve(ref, self.worker.rank)

    def check_fresh(self, refs: Iterable[int | None], seq: int | None) -> None:
        """Every ref in ``refs`` must be undefined here (a ref is defined once)."""
        table = self.refs
        for r in refs:
            if r is not None and r in table:
                by = f" (s{seq})" if seq is not None else ""
                raise InfrastructureError(
                    f"duplicate definition of ref r{r} on stream {self.name} of rank "
                    f"{self.worker.rank}{by}"
                )

    def poison(self, refs: Iterable[int | None], err: SeqError) -> None:
        table = self.refs
        for r in refs:
            if r is not None:
                table[r] = err

    def user_error(
        self, seq: int, label: str, exc: BaseException, poison: Iterable[int | None]
    ) -> SeqError:
        """Report a root user error once and poison ``poison`` with it."""
        werr = self.worker.worker_error(seq, self.name, label, exc)
        self.worker.send(RemoteFunctionFailed(seq=seq, error=werr))
        err = SeqError(seq, werr)
        self.poison(poison, err)
        if werr.peer_lost and self.worker.collective_abandoned is None:
            # A collective of the user's that met a lost peer: leave the group now, as a
            # step should (its connections close, so peers still waiting in the same
            # collective for this rank fail too instead of waiting out the timeout).
            collectives.abandon_groups(self.worker, werr.message, in_flight=False)
        return err

    def _bind(self, results: Sequence[int | None], ret: Any, label: str) -> None:
        n = len(results)
        if n == 0:
            return
        if n == 1 and type(ret) is not _Leaves:
            r = results[0]
            if r is not None:
                self.refs[r] = ret
            return
        if isinstance(ret, str | bytes | bytearray | dict) or not (
            hasattr(ret, "__len__") and hasattr(ret, "__iter__")
        ):
            raise TypeError(
                f"expected {n} results from {label}, got a {type(ret).__qualname__}, "
                "which is not a sequence"
            )
        items = list(ret)
        if len(items) != n:
            raise ValueError(f"expected {n} results from {label}, got {len(items)}")
        table = self.refs
        for r, v in zip(results, items, strict=True):
            if r is not None:
                table[r] = v

    # ---------------------------------------------------------------- commands
    def run_call(self, cmd: CallFunction) -> None:
        seq = cmd.seq
        t0 = time.monotonic()
        label = _function_hint(cmd.function)
        self.current = (seq, label, t0)
        results = cmd.results
        try:
            self.check_fresh(results, seq)
            try:
                rf = self.resolve(cmd.function)
                label = rf.label
                self.current = (seq, label, t0)
                args, kwargs, dep = self.load(cmd.args)
                if dep is not None:
                    self.poison(results, dep)
                    self.poison(cmd.mutates, dep)
                    return
                ret = rf.fn(*args, **kwargs)
                if cmd.flatten:
                    ret = tensor_leaves(ret, len(results), label)
                self._bind(results, ret, label)
            except (InfrastructureError, _Stopped):
                raise
            except BaseException as e:  # noqa: BLE001 - SystemExit from user code too
                self.user_error(seq, label, e, [*results, *cmd.mutates])
        finally:
            self.current = None
            self.last_completed_seq = seq

    def run_send_value(self, cmd: SendValue) -> None:
        seq = cmd.seq
        t0 = time.monotonic()
        label = _function_hint(cmd.function)
        self.current = (seq, label, t0)
        try:
            try:
                rf = self.resolve(cmd.function) if cmd.function is not None else None
                if rf is not None:
                    label = rf.label
                    self.current = (seq, label, t0)
                args, kwargs, dep = self.load(cmd.args)
                if dep is not None:
                    self.poison(cmd.mutates, dep)
                    self.worker.send(FetchResult(seq=seq, value=Err(dep.error)))
                    return
                if rf is None:
                    if len(args) != 1 or kwargs:
                        raise TypeError(
                            "a fetch without a function takes exactly one value, got "
                            f"{len(args)} positional and {len(kwargs)} keyword arguments"
                        )
                    value = args[0]
                else:
                    value = rf.fn(*args, **kwargs)
                cfg = config.get()
                to = cmd.deliver_to
                # A big value for the client goes to it directly, from its own memory
                # (no snapshot): this stream waits until it is received, so nothing it
                # runs meanwhile can write that memory.
                big = to is not None and _nbytes_at_least(value, cfg.direct_value_bytes)
                in_place = InPlace() if big else None
                pickled = dumps_fetched(value, in_place)
                nbytes = len(pickled.data) + sum(memoryview(b).nbytes for b in pickled.buffers)
                what = "the fetched value" if rf is None else f"the value {label} returned"
                too_large = config.value_too_large(what, nbytes)
                if too_large is not None:
                    del pickled
                    raise ValueTooLarge(too_large)
                direct = to is not None and nbytes >= cfg.direct_value_bytes
                if direct:
                    # Straight to the client; the controller orders the fetch as ever.
                    assert to is not None
                    port = PortId(to, FetchedValue.__palatine_type_id__)
                    self.worker.reply(port, FetchedValue(seq=seq, value=pickled))
                else:
                    self.worker.send(FetchResult(seq=seq, value=Ok(pickled)))
                del value, pickled, args, kwargs
                if in_place is not None:
                    self.worker.flush()
                    self._await_sent(in_place, seq, cfg.message_delivery_timeout_s + 5.0)
                if direct:
                    # Sent once the value is received (or given up): the client has it
                    # by then, and waits a bounded time for it otherwise.
                    self.worker.send(FetchResult(seq=seq, value=Ok(DIRECT)))
            except (InfrastructureError, _Stopped):
                raise
            except BaseException as e:  # noqa: BLE001 - the user's code failed: the client gets it
                err = self.user_error(seq, label, e, cmd.mutates)
                self.worker.send(FetchResult(seq=seq, value=Err(err.error)))
        finally:
            self.current = None
            self.last_completed_seq = seq

    def _await_sent(self, in_place: InPlace, seq: int, timeout_s: float) -> None:
        """Wait until the channel has let go of a value sent from its own memory."""
        if not in_place.wait(timeout_s):
            log.warning(
                "s%d: the fetched value was not received within %s s; going on", seq, timeout_s
            )

    def run_marker(self, countdown: Countdown) -> None:
        """A `RequestStatus` barrier: this stream has finished everything before it."""
        countdown.arrive()

    def run_delete(self, arg: tuple[list[int], Countdown]) -> None:
        refs, countdown = arg
        table = self.refs
        for r in refs:
            table.pop(r, None)
        countdown.arrive()

    def run_set_ref(self, cmd: SetRefUnitTestsOnly) -> None:
        self.refs[cmd.ref] = load_value(cmd.value, self._lookup)

    def run_get_ref(self, arg: tuple[GetRefUnitTestsOnly, PortId]) -> None:
        cmd, port = arg
        v = self.refs.get(cmd.ref, MISSING)
        if v is MISSING:
            msg = RefValue(found=False)
        elif type(v) is SeqError:
            msg = RefValue(found=True, error=v.text())
        else:
            try:
                msg = RefValue(found=True, value=dumps_fetched(v))
            except TypeError as e:
                msg = RefValue(found=True, error=str(e))
        self.worker.reply(port, msg)

    def run_collective(
        self, cmd: BackendNetworkInit | CreateProcessGroup | Reduce | Transfer
    ) -> None:
        """Collective commands, and a rank's part of a `SendTensor` (`Transfer`); torch
        is imported by `collectives`, `reduce` and `transfer` only."""
        seq = cmd.seq
        t0 = time.monotonic()
        label = _COLLECTIVE_LABELS[type(cmd)]
        if type(cmd) is Reduce:
            label = f"reduce({cmd.op}{', scatter' if cmd.scatter else ''})"
        self.current = (seq, label, t0)
        try:
            if type(cmd) is Reduce and not (cmd.in_place and cmd.result == cmd.value):
                self.check_fresh([cmd.result], seq)  # an in-place result may rename the input
            elif type(cmd) is Transfer and cmd.receives:
                self.check_fresh([cmd.cmd.result], seq)
            try:
                if not self.worker.torch_available:
                    raise ModuleNotFoundError(
                        f"torch is not installed on worker rank {self.worker.rank}", name="torch"
                    )
                if isinstance(cmd, Reduce):
                    reduce(self, cmd)
                elif isinstance(cmd, Transfer):
                    transfer.run(self, cmd)
                else:
                    collectives.run(self, cmd)
            except (InfrastructureError, _Stopped):
                raise
            except BaseException as e:  # noqa: BLE001 - a user error: poison the results
                err = self.user_error(seq, label, e, ())
                self.poison_collective(cmd, err)
        finally:
            if type(cmd) is BackendNetworkInit and self.worker.collective_pending is not None:
                self.worker.collective_pending.set()
            self.current = None
            self.last_completed_seq = seq

    def poison_collective(
        self, cmd: BackendNetworkInit | CreateProcessGroup | Reduce | Transfer, err: SeqError
    ) -> None:
        """Poison what a failed collective command would have defined or mutated."""
        w = self.worker
        if type(cmd) is BackendNetworkInit:
            w.groups[cmd.result] = err
            w.collective = err
        elif type(cmd) is CreateProcessGroup:
            w.groups[cmd.result] = err
        elif type(cmd) is Reduce:
            self.poison([cmd.result, cmd.value if cmd.in_place else None, cmd.out], err)
        elif type(cmd) is Transfer and cmd.receives:
            self.poison([cmd.cmd.result], err)

    # ---------------------------------------------------------------- borrows
    def run_borrow_create(self, b: Borrow) -> None:
        v = self.refs.get(b.value_ref, MISSING)
        if v is MISSING:
            raise InfrastructureError(
                f"borrow {b.id}: ref r{b.value_ref} not found on stream {self.name} of rank "
                f"{self.worker.rank}"
            )
        b.value = v
        if self.cuda_stream is not None:
            import torch

            b.ready_event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            b.ready_event.record()
        b.ready.set()

    def run_borrow_first_use(self, b: Borrow) -> None:
        self.wait_event(b.ready)
        if b.ready_event is not None:
            import torch

            torch.cuda.current_stream().wait_event(b.ready_event)
        self.check_fresh([b.result], None)
        self.refs[b.result] = b.value

    def run_borrow_last_use(self, b: Borrow) -> None:
        self.refs.pop(b.result, None)
        if self.cuda_stream is not None:
            import torch

            b.release_event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            b.release_event.record()
        b.released.set()

    def run_borrow_drop(self, b: Borrow) -> None:
        self.wait_event(b.released)
        if b.release_event is not None:
            import torch

            torch.cuda.current_stream().wait_event(b.release_event)
        b.value = None


_COLLECTIVE_LABELS: dict[type[Any], str] = {
    BackendNetworkInit: "backend_network_init",
    CreateProcessGroup: "process_group",
    Reduce: "reduce",
    Transfer: transfer.LABEL,
}

_QUICK = frozenset({Stream.run_marker})
"""Work that runs no user code and never waits: no flush point before it. (Deleting refs
may run a value's ``__del__``; setting one unpickles.)"""
