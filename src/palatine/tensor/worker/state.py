"""What all streams of one worker share: `WorkerState` (identity,
worker-level tables, the way out to the outbox), `Countdown` barriers, `Borrow` slots,
and the `MISSING` sentinel. Streams themselves are in `palatine.tensor.worker.stream`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from palatine.errors import InfrastructureError
from palatine.ids import ActorId, PortId
from palatine.protocol.worker import BackendNetworkInit, CreateProcessGroup, Reduce, WorkerError
from palatine.tensor.worker.peers import LostPeers, is_peer_loss
from palatine.tensor.worker.user_errors import user_error_fields
from palatine.tensor.worker.values import FunctionCache, SeqError
from palatine.wire.codec import encode_message_oob

__all__ = [
    "MISSING",
    "Borrow",
    "StreamView",
    "Countdown",
    "OutItem",
    "WorkerState",
    "current_stream",
    "set_current_stream",
    "worker_info",
]

_FUNCTIONS = FunctionCache()


class StreamView(Protocol):
    """What the code below `palatine.tensor.worker.stream` needs of a stream (the
    collectives it runs, the thread's current stream), so none of it depends on `Stream`."""

    name: str
    worker: WorkerState
    refs: dict[int, Any]

    def wait_event(self, ev: threading.Event) -> None:
        """Wait for ``ev`` as the stream's thread waits: abandoned when the worker exits."""

    def poison_collective(
        self, cmd: BackendNetworkInit | CreateProcessGroup | Reduce, err: SeqError
    ) -> None:
        """Poison what a failed collective command would have defined or mutated."""


_local = threading.local()


def set_current_stream(stream: StreamView | None) -> None:
    """Record ``stream`` as the one running on this thread (a stream's thread, at start and end)."""
    _local.stream = stream


def current_stream() -> StreamView | None:
    """The stream whose thread is running the caller, or None."""
    return getattr(_local, "stream", None)


def worker_info() -> dict[str, Any]:
    """Who runs the calling remote function: ``{world, rank, world_size, local_rank,
    device, proc_id, stream}``. RuntimeError outside a worker stream."""
    s = current_stream()
    if s is None:
        raise RuntimeError("palatine.worker_info() works only inside a remote function on a worker")
    w = s.worker
    return {
        "world": w.world,
        "rank": w.rank,
        "world_size": w.world_size,
        "local_rank": w.local_rank,
        "device": w.device,
        "proc_id": w.proc_id,
        "stream": s.name,
    }


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""Sentinel for an absent ref."""

OutItem = tuple[PortId, int, bytes, list[Any]] | InfrastructureError
"""An outbox entry: an encoded message for a port with its out-of-band buffers (the
envelope's ``buffers``), or a failure of the worker actor."""


class Countdown:
    """A marker passed by every stream; the last arrival runs ``done`` (on its thread)."""

    __slots__ = ("_done", "_left", "_lock")

    def __init__(self, n: int, done: Callable[[], None]) -> None:
        self._left = n
        self._lock = threading.Lock()
        self._done = done

    def arrive(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done()


class Borrow:
    """A value lent from one stream to another: slot, readiness, release."""

    __slots__ = (
        "from_id",
        "id",
        "ready",
        "ready_event",
        "release_event",
        "released",
        "result",
        "to_id",
        "value",
        "value_ref",
    )

    def __init__(self, bid: int, result: int, value_ref: int, from_id: int, to_id: int) -> None:
        self.id = bid
        self.result = result
        self.value_ref = value_ref
        self.from_id = from_id
        self.to_id = to_id
        self.value: Any = None
        self.ready = threading.Event()
        self.released = threading.Event()
        self.ready_event: Any = None  # torch.cuda.Event on CUDA
        self.release_event: Any = None


class WorkerState:
    """What all streams of one worker share: identity, worker-level tables, the outbox.

    Worker-level tables hold device mesh views (``meshes``), process groups and the
    collective context (``groups``; a failed creation holds its `SeqError`), and live
    borrows. Streams read them; the loop and the last stream past a ``DeleteRefs``
    marker mutate them (single dict operations, atomic under the GIL).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        world: str,
        proc_id: str,
        host: str,
        pid: int,
        device: str,
        device_index: int | None,
        local_rank: int,
        store_host: str,
        controller: ActorId,
        emit: Callable[[OutItem], None],
        torch_available: bool,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.world = world
        self.proc_id = proc_id
        self.host = host
        self.pid = pid
        self.device = device
        self.device_index = device_index
        self.local_rank = local_rank
        self.store_host = store_host
        self.controller = controller
        self.torch_available = torch_available
        self.meshes: dict[int, Any] = {}
        self.groups: dict[int, Any] = {}
        self.reduce_groups: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.collective: Any = None  # CollectiveContext | SeqError | None
        self.collective_generation = 0  # of the group it joined (`BackendNetworkInit`)
        self.collective_pending: threading.Event | None = None  # set when an init finished
        # ranks declared lost in this generation (`PeersLost`): they end palatine's
        # collectives waiting for them (`palatine.tensor.worker.peers`)
        self.peers = LostPeers()
        # why this generation's groups were abandoned (a lost peer); None: they were not
        self.collective_abandoned: str | None = None
        self.borrows: dict[int, Borrow] = {}
        self.functions = _FUNCTIONS
        self._emit = emit
        self.flush = flush  # a stream thread's flush point: what it queued goes out

    # ---------------------------------------------------------------- outbox
    def send(self, msg: Any) -> None:
        """Encode ``msg`` now (this thread) and queue it for the controller."""
        tid = type(msg).__palatine_type_id__
        self._emit((PortId(self.controller, tid), tid, *encode_message_oob(msg)))

    def reply(self, port: PortId, msg: Any) -> None:
        """Encode ``msg`` now and queue it for ``port`` (the reply of an ask)."""
        self._emit((port, type(msg).__palatine_type_id__, *encode_message_oob(msg)))

    def fail(self, exc: InfrastructureError) -> None:
        """Queue the failure of the worker actor (after everything emitted before)."""
        self._emit(exc)

    # ---------------------------------------------------------------- tables
    def lookup_shared(self, ref: int) -> Any:
        """A worker-level value for ``ref`` (mesh view, group, context), or `MISSING`."""
        v = self.meshes.get(ref, MISSING)
        if v is MISSING:
            v = self.groups.get(ref, MISSING)
            group = getattr(v, "palatine_group", None)
            if group is not None:
                v = group  # the collective context stands for the world group
        return v

    def forget_shared(self, refs: Iterable[int]) -> None:
        """Drop meshes and groups named by ``refs`` (every stream passed the marker)."""
        for r in refs:
            if self.meshes.pop(r, None) is not None:
                for key in [k for k in list(self.reduce_groups) if k[0] == r]:
                    self.reduce_groups.pop(key, None)
            self.groups.pop(r, None)

    def worker_error(self, seq: int, stream: str, label: str, exc: BaseException) -> WorkerError:
        """The `WorkerError` of user error ``exc`` raised by ``seq`` on ``stream``."""
        return WorkerError(
            seq=seq,
            rank=self.rank,
            world=self.world,
            proc_id=self.proc_id,
            host=self.host,
            pid=self.pid,
            stream=stream,
            function=label,
            peer_lost=is_peer_loss(exc),
            **user_error_fields(exc),
        )
