"""Messages of the tensor worker protocol.

Two directions:

* **Commands** (`WorkerMessage`) reach a worker actor ``W[r].<worker_name>``. The client
  encodes them and hands the bytes to the controller in a ``Send``; the controller casts
  them, undecoded, through its comm actor. The controller itself
  sends `RequestStatus` probes on the same path, and `ProgressQuery` directly.
* **Replies** go from a worker to the controller through the worker's single outbox:
  `Status`, `RemoteFunctionFailed`, `FetchResult` (and `WorkerProgress` / `RefValue`
  as answers to asks).

Everything here subclasses `palatine.wire.codec.Message` (a stable ``type_id`` per
class, decoded by it) except the nested value structs. This module sits in the worker
layer and imports nothing above the wire layer, so the controller and the client import
it freely while the worker never imports the controller.

Wire invariants:

* Commands are **tagged** structs (the tag is the class name), so a `CommandGroup` can
  carry any mix of them and a tagged command still decodes under its own ``type_id``.
* Refs, seqs and stream ids are plain integers chosen by the client; a ``None`` entry in
  ``CallFunction.results`` discards that item of the return value.
* User values are never msgpack: they travel as `Pickled` (pickle protocol 5 bytes plus
  out-of-band buffers), which the controller stores and forwards without decoding.
  A command's positional and keyword arguments are **one** pickle of ``(args, kwargs)``
  (the persistent-id substitution of refs runs once per command).
* Ids inside human-facing descriptions (`WorkerError`) are canonical text, so the client
  can put them straight into exception attributes.
* A request that gets a reply (``ProgressQuery``, ``GetRefUnitTestsOnly``) has no reply
  field: its reply port is the envelope's ``reply_to`` of an ``ask``.
* A command cast to several slices for one seq (`SendTensor` goes to the union of its
  source and destination ranks) reaches each rank once: every rank works out its own
  part from the command's fields.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeAlias, TypeVar

import msgspec

from palatine.ids import ActorId
from palatine.wire.codec import Message

__all__ = [
    # values
    "Ok",
    "Err",
    "Pickled",
    "Slice",
    "FunctionPath",
    "Cloudpickle",
    "FunctionRef",
    "Factory",
    "ReduceOp",
    "REDUCE_OPS",
    "WorkerError",
    "ExecutingOp",
    "StreamProgress",
    "WorkerParams",
    # commands
    "CreateStream",
    "CreateDeviceMesh",
    "CallFunction",
    "SendValue",
    "DeleteRefs",
    "RequestStatus",
    "CommandGroup",
    "BackendNetworkInit",
    "CreateProcessGroup",
    "Reduce",
    "SendTensor",
    "BorrowCreate",
    "BorrowFirstUse",
    "BorrowLastUse",
    "BorrowDrop",
    "Exit",
    "SetRefUnitTestsOnly",
    "RecordedCommand",
    "DefineRecording",
    "CallRecording",
    "DropRecording",
    "with_seq",
    "GetRefUnitTestsOnly",
    "ProgressQuery",
    "PeersLost",
    "CastCommand",
    "WorkerMessage",
    # replies
    "Status",
    "RemoteFunctionFailed",
    "FetchResult",
    "FetchedValue",
    "DIRECT",
    "FetchValue",
    "WorkerProgress",
    "RefValue",
    "DebuggerMessage",
    "WorkerReply",
]


# --------------------------------------------------------------------------- values

V = TypeVar("V")
E = TypeVar("E")


class Ok(msgspec.Struct, Generic[V], frozen=True, array_like=True, tag="Ok"):
    """A successful result carrying a value (opaque to the controller).

    With `Err`, a tagged union encoded array-like: ``["Ok", value]`` / ``["Err", error]``.
    Shared by `FetchResult` here and by the controller's ``Result`` (re-exported by
    `palatine.tensor.controller.history`).
    """

    value: V


class Err(msgspec.Struct, Generic[E], frozen=True, array_like=True, tag="Err"):
    """A failed result: ``Err(WorkerError)`` in a FetchResult, ``Err(Error)`` in a Result."""

    error: E


class Pickled(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A pickled user value: protocol-5 bytes plus its out-of-band buffers, in order.

    Opaque to the controller; only workers and the client unpickle it.

    Wire invariant: a buffer is either a `pickle.PickleBuffer` over private memory (a
    worker's snapshot of a fetched value, or a received frame) or any other bytes-like
    object. With ``encode_message_oob`` (`Mailbox.tell`, a worker's replies) the
    PickleBuffers travel outside the msgpack payload, in the envelope's ``buffers``, and
    decode as PickleBuffers viewing the received frame, so the controller forwards them
    without a copy. Everything else is inlined as msgpack binary (and decodes as
    `bytes`), as are PickleBuffers under ``encode_message``.
    """

    data: bytes
    buffers: list[Any] = []


class Slice(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A strided view of worker-world ranks: ``offset + Σ idx[d]·strides[d]``.

    ``sizes`` and ``strides`` have one entry per mesh dim (row-major: the last dim varies
    fastest). A 2×2 mesh over ranks 0–3 is ``Slice(0, [2, 2], [2, 1])``; its row
    ``host=1`` is ``Slice(2, [2], [1])``.
    """

    offset: int
    sizes: list[int]
    strides: list[int]

    def __len__(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def ranks(self) -> list[int]:
        """The ranks of the slice in row-major order (duplicates kept if strides overlap)."""
        if len(self.sizes) != len(self.strides):
            raise ValueError(f"slice has {len(self.sizes)} sizes but {len(self.strides)} strides")
        out = [self.offset]
        for size, stride in zip(self.sizes, self.strides, strict=True):
            if len(out) == 1:  # a contiguous run needs no per-rank arithmetic
                first = out[0]
                out = (
                    list(range(first, first + size * stride, stride)) if stride else [first] * size
                )
            else:
                steps = [i * stride for i in range(size)]
                out = [b + s for b in out for s in steps]
        return out


class FunctionPath(msgspec.Struct, frozen=True, tag=True):
    """A function named by its dotted import path (``torch.add``, ``mypkg.mod.fn``)."""

    path: str


class Cloudpickle(msgspec.Struct, frozen=True, tag=True):
    """A function shipped by value, plus the source text of the files it came from.

    ``sources`` maps a file name to its text (≤ 1 MiB each) so worker tracebacks can
    show source lines of client files the worker host does not have.
    """

    data: bytes
    sources: dict[str, str] = {}


FunctionRef: TypeAlias = FunctionPath | Cloudpickle
"""How a command names the function it runs."""


class Factory(msgspec.Struct, frozen=True, kw_only=True):
    """Metadata of a collective's input that the client knows: a `Reduce` rank whose
    input failed takes part with zeros of it; a `SendTensor` destination receives the
    data into a buffer of it without waiting for the header first."""

    size: list[int]
    dtype: str
    layout: str = "strided"
    device: str = "cpu"


ReduceOp = Literal["sum", "avg", "product", "min", "max", "band", "bor", "bxor", "stack"]
"""The reduction operators of `Reduce` (``stack`` gathers into a new leading dim)."""

REDUCE_OPS: tuple[str, ...] = (
    "sum",
    "avg",
    "product",
    "min",
    "max",
    "band",
    "bor",
    "bxor",
    "stack",
)


class WorkerError(msgspec.Struct, frozen=True, kw_only=True):
    """A user error raised while running ``seq`` on one worker.

    ``exc_type`` is the qualified exception type, ``traceback`` the worker traceback with
    palatine's own frames removed, ``exception`` the pickled exception when it pickles
    within 1 MiB. ``world`` and ``proc_id`` are canonical id text.
    """

    seq: int
    rank: int
    world: str
    proc_id: str
    host: str
    pid: int
    stream: str
    function: str
    exc_type: str
    message: str
    traceback: str = ""
    exception: bytes | None = None
    # the error is a collective's connection to a peer failing (reset, closed, a palatine
    # collective abandoned because a member was lost): its cause is probably a lost peer,
    # which the controller waits (bounded) to name before it reports the error as its own
    peer_lost: bool = False


class ExecutingOp(msgspec.Struct, frozen=True, kw_only=True):
    """The op a stream is running now, and for how long."""

    seq: int
    function: str
    running_for_s: float


class StreamProgress(msgspec.Struct, frozen=True, kw_only=True):
    """One stream's state in a `WorkerProgress` answer."""

    id: int
    name: str
    executing: ExecutingOp | None = None
    queued: int = 0
    last_completed_seq: int | None = None


class WorkerParams(msgspec.Struct, frozen=True, kw_only=True):
    """Spawn parameters of ``palatine.tensor.worker.WorkerActor`` (msgpack ``Params``).

    ``device_index`` is ``None`` for a CPU worker, else the index among the devices this
    proc can see (``0`` = the first).
    """

    world_size: int
    rank: int
    device_index: int | None
    controller_actor: ActorId


# --------------------------------------------------------------------------- commands


class CreateStream(Message, kw_only=True, tag=True):
    """Start stream thread ``palatine-stream-<name>``; an existing ``id`` is an infra error."""

    id: int
    name: str
    default: bool = False


class CreateDeviceMesh(Message, kw_only=True, tag=True):
    """Store this rank's view of the device mesh ``ranks`` under ref ``result``."""

    result: int
    names: list[str]
    ranks: Slice


class CallFunction(Message, kw_only=True, tag=True):
    """Run ``function(*args, **kwargs)`` on ``stream`` as invocation ``seq``.

    ``args`` is one pickle of ``(args, kwargs)`` with refs as persistent ids; results
    bind to ``results`` (``None`` entries discard); ``mutates`` are poisoned on failure.
    ``flatten``: ``results`` are the tensor leaves of the returned structure (a pytree,
    in torch's pytree order), not the returned value or sequence itself.
    """

    seq: int
    results: list[int | None]
    mutates: list[int] = []
    function: FunctionRef
    args: Pickled
    stream: int
    flatten: bool = False


class SendValue(Message, kw_only=True, tag=True):
    """Compute a value (``function``, or the identity on the single argument) and send
    ``FetchResult{seq, …}`` to the controller.

    With ``deliver_to`` (the client's actor), a value of at least ``direct_value_bytes``
    goes there directly as `FetchedValue`, and the controller gets `DIRECT` in its
    place: a big value crosses one link and is held by no process in between.
    """

    seq: int
    mutates: list[int] = []
    function: FunctionRef | None = None
    args: Pickled
    stream: int
    deliver_to: ActorId | None = None


class DeleteRefs(Message, kw_only=True, tag=True):
    """Forget ``refs`` on every stream after the commands already queued there."""

    refs: list[int]


class RequestStatus(Message, kw_only=True, tag=True):
    """Barrier over all streams; then ``Status{seq + 1, rank, controller}`` is sent.

    ``controller = True`` marks the controller's own progress probes, which never complete anything.
    """

    seq: int
    controller: bool = False


class BackendNetworkInit(Message, kw_only=True, tag=True):
    """Join the world-wide collective group through the store at ``store_addr``.

    ``generation`` counts the session's recoveries: a rank that joined an earlier
    generation's group leaves it first (a group with a lost member is of no use)."""

    seq: int
    result: int
    store_addr: str
    stream: int
    generation: int = 0


class CreateProcessGroup(Message, kw_only=True, tag=True):
    """Make a torch process group of this rank's members of ``mesh`` along ``dims``."""

    seq: int
    result: int
    mesh: int
    dims: list[str]
    stream: int


class Reduce(Message, kw_only=True, tag=True):
    """Collective ``op`` over ``dims`` of ``mesh`` on ref ``value``."""

    seq: int
    result: int
    value: int
    factory: Factory | None = None
    mesh: int
    dims: list[str]
    op: ReduceOp = "sum"
    scatter: bool = False
    in_place: bool = False
    out: int | None = None
    stream: int


class SendTensor(Message, kw_only=True, tag=True):
    """Move tensor ``value`` point to point from the ranks ``from_ranks`` to the ranks
    ``to_ranks`` (a mesh of the same sizes), binding ``result`` on the destination.

    Pairing is by row-major index: the rank at index ``i`` of ``from_ranks.ranks()``
    sends to the rank at index ``i`` of ``to_ranks.ranks()``. The command is cast to
    the union of both; each rank works out whether it sends (on ``stream``, where
    ``value`` lives), receives (on ``to_stream``, ``None``: ``stream``), or both; a rank
    paired with itself binds a copy. A small header goes first (status, dtype, shape;
    a failed source sends its error after it, so the destination is poisoned too);
    ``factory``, the source's metadata when the client knows it, lets the destination
    post the data's receive together with the header's.
    """

    seq: int
    result: int
    value: int
    from_ranks: Slice
    to_ranks: Slice
    factory: Factory | None = None
    stream: int
    to_stream: int | None = None


class BorrowCreate(Message, kw_only=True, tag=True):
    """On ``from_stream``: snapshot ``value`` into borrow slot ``borrow``."""

    borrow: int
    result: int
    value: int
    from_stream: int
    to_stream: int


class BorrowFirstUse(Message, kw_only=True, tag=True):
    """On the target stream: wait until the borrow is ready, then bind its result."""

    borrow: int


class BorrowLastUse(Message, kw_only=True, tag=True):
    """On the target stream: unbind the borrowed result and release the slot."""

    borrow: int


class BorrowDrop(Message, kw_only=True, tag=True):
    """On the source stream: wait until released, then free the borrow slot."""

    borrow: int


class Exit(Message, kw_only=True, tag=True):
    """Drain the streams and stop the worker actor; ``error`` ended the client's session."""

    error: str | None = None


class SetRefUnitTestsOnly(Message, kw_only=True, tag=True):
    """Test hook: bind ``value`` to ``ref`` on ``stream``."""

    ref: int
    value: Pickled
    stream: int


class GetRefUnitTestsOnly(Message, kw_only=True, tag=True):
    """Test hook (an ``ask``, sent directly): read ``ref`` on ``stream``; replies `RefValue`."""

    ref: int
    stream: int


class ProgressQuery(Message, kw_only=True, tag=True):
    """Ask (sent directly, not cast) for the per-stream state; replies `WorkerProgress`."""


class PeersLost(Message, kw_only=True, tag=True):
    """Sent directly (not cast) by the controller to every other rank when ``ranks`` are
    declared lost: palatine's own collectives waiting for one of them end at once with
    ``reason`` (the supervision's words: proc, pid, host, how it ended), instead of
    waiting for a peer that will never come (gloo cannot abort a collective; the worker
    abandons its group). Handled on the worker actor's loop, never behind a stream."""

    ranks: list[int]
    reason: str
    # the lost procs' pids, beside ``ranks`` (0: not known): a notice that arrives after
    # a recovery's new group formed names an old pid and is ignored
    pids: list[int] = []


RecordedCommand: TypeAlias = (
    CallFunction | Reduce | SendTensor | BorrowCreate | BorrowFirstUse | BorrowLastUse | BorrowDrop
)
"""The commands a recording may hold (`palatine.compile`): what one step of tensor work
issues. Fetches, process-group set-up and stream or mesh creation are not replayed."""


def with_seq(cmd: RecordedCommand, seq: int) -> RecordedCommand:
    """``cmd`` as issued under ``seq`` (the borrow commands carry none)."""
    if type(cmd) is CallFunction or type(cmd) is Reduce or type(cmd) is SendTensor:
        return msgspec.structs.replace(cmd, seq=seq)
    return cmd


class DefineRecording(Message, kw_only=True, tag=True):
    """Keep ``commands``, this rank's share of a function's recorded step, as recording
    ``recording`` (a session-unique id) for later `CallRecording`s. ``fresh``: the refs
    the step makes anew (a ref is defined once, so each call frees them first)."""

    recording: int
    commands: list[RecordedCommand]
    fresh: list[int] = []


class CallRecording(Message, kw_only=True, tag=True):
    """Run recording ``recording`` again, every command exactly as recorded (the same
    refs: its ``fresh`` ones are freed first and made again) but under seq ``seq``: one
    message per rank for a whole step instead of one command per op."""

    seq: int
    recording: int


class DropRecording(Message, kw_only=True, tag=True):
    """Forget recording ``recording`` (its function was freed or recorded again)."""

    recording: int


CastCommand: TypeAlias = (
    CreateStream
    | CreateDeviceMesh
    | CallFunction
    | SendValue
    | DeleteRefs
    | RequestStatus
    | BackendNetworkInit
    | CreateProcessGroup
    | Reduce
    | SendTensor
    | BorrowCreate
    | BorrowFirstUse
    | BorrowLastUse
    | BorrowDrop
    | Exit
    | SetRefUnitTestsOnly
    | DefineRecording
    | CallRecording
    | DropRecording
)
"""The commands that may be cast (alone or inside a `CommandGroup`), in one tagged union."""


class CommandGroup(Message, kw_only=True, tag=True):
    """Several commands handled exactly as if each had arrived alone, in order."""

    commands: list[CastCommand]


WorkerMessage: TypeAlias = (
    CastCommand | CommandGroup | GetRefUnitTestsOnly | ProgressQuery | PeersLost
)
"""Every command a worker actor handles."""


# --------------------------------------------------------------------------- replies


class Status(Message, kw_only=True):
    """Rank ``rank`` has completed every seq below ``seq`` on all its streams.

    The answer to ``RequestStatus{seq - 1, controller}``; ``controller`` is copied from
    the request.
    """

    seq: int
    rank: int
    controller: bool = False


class RemoteFunctionFailed(Message, kw_only=True):
    """Root user error of invocation ``seq`` on one rank (dependent errors are silent)."""

    seq: int
    error: WorkerError


FetchValue: TypeAlias = Ok[Pickled] | Err[WorkerError]
"""What a worker puts in `FetchResult.value`: ``Ok(Pickled)`` or ``Err(WorkerError)``."""


DIRECT = Pickled(b"")
"""The `FetchResult` value of a value sent to the client directly (`FetchedValue`):
no pickle is empty, so an empty one cannot be mistaken for a value."""


class FetchedValue(Message, kw_only=True):
    """Worker to client: the value of ``SendValue`` ``seq``, sent directly
    (``SendValue.deliver_to``); the controller's ``Result`` for ``seq`` carries `DIRECT`."""

    seq: int
    value: Pickled


class FetchResult(Message, kw_only=True):
    """The value (or error) of a ``SendValue`` for ``seq``, sent before any Status covering it."""

    seq: int
    value: FetchValue


class WorkerProgress(Message, kw_only=True):
    """Answer to `ProgressQuery`, built without touching the stream threads."""

    rank: int
    pid: int
    streams: list[StreamProgress] = []


class RefValue(Message, kw_only=True):
    """Answer to `GetRefUnitTestsOnly`: absent (``found = False``), errored, or a value;
    a worker that is exiting answers ``found = False`` with an ``error`` saying so."""

    found: bool
    error: str | None = None
    value: Pickled | None = None


class DebuggerMessage(Message, kw_only=True):
    """Remote-debugger traffic of ``rank`` (later; forwarded verbatim to the client)."""

    rank: int
    payload: bytes = b""


WorkerReply: TypeAlias = (
    Status | RemoteFunctionFailed | FetchResult | WorkerProgress | RefValue | DebuggerMessage
)
"""What a worker sends back."""
