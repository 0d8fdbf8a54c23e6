"""Moving a tensor point to point between meshes of the same shape: `SendTensor`.

The pipeline-parallel pattern: a tensor on one mesh (``mesh(pp=0)``) becomes a tensor
on another of the same sizes (``mesh(pp=1)``). Ranks pair by row-major index: the rank
at index ``i`` of the source slice sends to the rank at index ``i`` of the destination
(`pairing`). The command reaches each rank of both once; `parts` splits it into what
this rank runs, and on which stream: the send on the value's stream, the receive on the
result's stream, both as one part when those are one stream (a rank that sends to one
peer and receives from another must post both before it waits, or a ring of moves
would wait for itself), and a rank paired with itself binds a copy.

On the world group (`BackendNetworkInit`), with torch.distributed's isend/irecv (one
batch per phase on NCCL) and tags derived from the seq, in two phases, each posted
whole before it is waited for, so that no rank ever waits for a send that its peer
posts only later:

1. a small header (status, dtype, shape, bytes, device kind, error length); with a
   `Factory` (the client knew the source's metadata) the data goes in this phase too,
   into a buffer the destination allocates before the header arrives;
2. the data (without a factory), or the source's error after a failed source.

Data travels as bytes (``uint8``), so any dtype goes over any backend. A failed source
still sends a header, then its error (the root `WorkerError`, msgpack): the destination
stores it as the result's `SeqError` and never waits for data that will not come. With
a factory, a failed source sends zeros of it as the data, which the destination drops.
A peer declared lost ends the waits at once (`palatine.tensor.worker.peers`), and the
rank leaves its groups as after any collective that met a lost peer.

The result is a new tensor, never a view of the source (a rank paired with itself
clones), without autograd history; it lives on the destination worker's accelerator
when the source's did, else on CPU. torch is imported lazily (workers only).
"""

from __future__ import annotations

import datetime
import math
import threading
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from palatine.errors import CollectivePeerLost
from palatine.protocol.worker import Factory, SendTensor, Slice, WorkerError
from palatine.tensor.worker.collectives import (
    CollectiveContext,
    _context,
    abandon_groups,
    collective_timeout_s,
)
from palatine.tensor.worker.peers import is_peer_loss, run_abortable, wait_work
from palatine.tensor.worker.state import MISSING
from palatine.tensor.worker.values import SeqError

if TYPE_CHECKING:
    from palatine.tensor.worker.state import StreamView, WorkerState

__all__ = ["LABEL", "MAX_DIMS", "Pairing", "Transfer", "pairing", "parts", "run"]

LABEL = "to_mesh"
"""The op's name in errors and progress reports."""

MAX_DIMS = 16
"""The most dims a moved tensor may have (the header's fixed size)."""

_OK, _FAILED = 0, 1
# header fields: status, dtype code, ndim, data bytes, device kind, error bytes, shape...
_STATUS, _DTYPE, _NDIM, _NBYTES, _DEVICE, _ERR_LEN, _SHAPE = range(7)
_HEADER_LEN = _SHAPE + MAX_DIMS
_CPU, _ACCELERATOR = 0, 1
_HEADER_TAG, _DATA_TAG, _ERROR_TAG = range(3)
_TAG_SEQS = 1 << 28  # tags stay below 2**30: gloo takes them as 32-bit unsigned


class Pairing(NamedTuple):
    """What one rank does in a move: the rank it sends to and the rank it receives
    from (None: it does not); both the rank itself: it copies locally."""

    send_to: int | None
    recv_from: int | None


def _shape_text(s: Slice) -> str:
    return f"sizes {list(s.sizes)} (ranks {s.ranks()})"


def pairing(from_ranks: Slice, to_ranks: Slice, rank: int) -> Pairing:
    """``rank``'s part in moving from ``from_ranks`` to ``to_ranks``: the rank at
    row-major index ``i`` of the source sends to the one at index ``i`` of the
    destination. ValueError when the two differ in size or repeat a rank."""
    src = from_ranks.ranks()
    dst = to_ranks.ranks()
    if len(src) != len(dst):
        raise ValueError(
            f"{LABEL}: the source has {len(src)} ranks, {_shape_text(from_ranks)}, and the "
            f"destination {len(dst)}, {_shape_text(to_ranks)}"
        )
    for name, ranks, s in (("source", src, from_ranks), ("destination", dst, to_ranks)):
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{LABEL}: the {name} repeats a rank: {_shape_text(s)}")
    send_to = dst[src.index(rank)] if rank in src else None
    recv_from = src[dst.index(rank)] if rank in dst else None
    return Pairing(send_to, recv_from)


class Transfer:
    """One rank's part of a `SendTensor` on one stream: it sends to ``send_to``,
    receives from ``recv_from``, or both (None: it does not)."""

    __slots__ = ("cmd", "recv_from", "send_to")

    def __init__(self, cmd: SendTensor, send_to: int | None, recv_from: int | None) -> None:
        self.cmd = cmd
        self.send_to = send_to
        self.recv_from = recv_from

    @property
    def seq(self) -> int:
        return self.cmd.seq

    @property
    def receives(self) -> bool:
        """Whether this part binds the result."""
        return self.recv_from is not None

    def __repr__(self) -> str:
        return f"Transfer(s{self.cmd.seq}, send_to={self.send_to}, recv_from={self.recv_from})"


def parts(cmd: SendTensor, rank: int) -> list[tuple[int, Transfer]]:
    """What ``rank`` runs for ``cmd``: ``(stream id, part)`` pairs, in posting order.
    ValueError when the rank has no part or the command cannot be run as given."""
    p = pairing(cmd.from_ranks, cmd.to_ranks, rank)
    to_stream = cmd.stream if cmd.to_stream is None else cmd.to_stream
    if p.send_to is None and p.recv_from is None:
        raise ValueError(
            f"{LABEL} s{cmd.seq} reached rank {rank}, which is in neither its source "
            f"{_shape_text(cmd.from_ranks)} nor its destination {_shape_text(cmd.to_ranks)}"
        )
    if p.send_to is not None and p.recv_from is not None and to_stream == cmd.stream:
        return [(cmd.stream, Transfer(cmd, p.send_to, p.recv_from))]
    if p.send_to == rank:
        raise ValueError(
            f"{LABEL} s{cmd.seq}: rank {rank} is paired with itself, which needs the value's "
            f"stream {cmd.stream} to be the result's, not stream {to_stream}"
        )
    out = []
    if p.send_to is not None:
        out.append((cmd.stream, Transfer(cmd, p.send_to, None)))
    if p.recv_from is not None:
        out.append((to_stream, Transfer(cmd, None, p.recv_from)))
    return out


# --------------------------------------------------------------------------- running


def _tag(seq: int, kind: int) -> int:
    return (seq % _TAG_SEQS) * 4 + kind


def _dtype_code(dtype: Any) -> int:
    """The same number for a dtype in every process (str hashes are salted)."""
    return zlib.crc32(str(dtype).encode())


_dtypes: dict[int, Any] = {}


def _dtype_of(torch: Any, code: int) -> Any:
    """The dtype of ``code`` (None: this torch has no such dtype)."""
    if not _dtypes:
        for v in list(vars(torch).values()):
            if isinstance(v, torch.dtype):
                _dtypes.setdefault(_dtype_code(v), v)
    return _dtypes.get(code)


def _factory_dtype(torch: Any, f: Factory) -> Any:
    dt = getattr(torch, f.dtype.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"{LABEL}: unknown dtype {f.dtype!r} in the client's metadata")
    return dt


def _factory_nbytes(torch: Any, f: Factory) -> int:
    return math.prod(f.size) * int(_factory_dtype(torch, f).itemsize)


def _describe(dtype: Any, shape: Any) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


class _Side:
    """What a rank's part learned before it talks to its peers."""

    __slots__ = ("dep", "problem", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.problem: BaseException | None = None
        self.dep: SeqError | None = None


def _verdict(torch: Any, stream: StreamView, t: Transfer, where: str) -> _Side:
    """The source value's state on a sending rank, found without raising: the peer
    must learn it before anyone gives up."""
    cmd = t.cmd
    side = _Side()
    value = stream.refs.get(cmd.value, MISSING)
    if value is MISSING:
        side.problem = LookupError(f"{where}: ref r{cmd.value} not found")
    elif type(value) is SeqError:
        side.dep = value
    elif not isinstance(value, torch.Tensor):
        side.problem = TypeError(f"{where}: needs a tensor, got a {type(value).__qualname__}")
    elif value.layout != torch.strided:
        side.problem = TypeError(f"{where}: needs a dense tensor, got layout {value.layout}")
    elif value.dim() > MAX_DIMS:
        side.problem = ValueError(
            f"{where}: a tensor has at most {MAX_DIMS} dims, got {value.dim()}"
        )
    elif cmd.factory is not None and (
        list(value.shape) != list(cmd.factory.size)
        or str(value.dtype).removeprefix("torch.") != cmd.factory.dtype.removeprefix("torch.")
    ):
        side.problem = ValueError(
            f"{where}: the value is {_describe(value.dtype, value.shape)}, not the "
            f"{_describe(cmd.factory.dtype, cmd.factory.size)} the client expected"
        )
    else:
        side.value = value
    return side


def _where(stream: StreamView, t: Transfer) -> str:
    """The op, its ranks and its stream, for errors."""
    me = stream.worker.rank
    if t.send_to == me:
        pair = f"rank {me} to itself"
    elif t.send_to is not None and t.recv_from is not None:
        pair = f"rank {me} to rank {t.send_to}, rank {t.recv_from} to rank {me}"
    elif t.send_to is not None:
        pair = f"rank {me} to rank {t.send_to}"
    else:
        pair = f"rank {t.recv_from} to rank {me}"
    return f"{LABEL} s{t.cmd.seq} ({pair}) on stream {stream.name}"


def _own_device(torch: Any, w: WorkerState, kind: int) -> Any:
    """Where a received tensor lives: this worker's accelerator if the source's lived
    on one and this worker has one, else the CPU."""
    if kind == _ACCELERATOR and w.device != "cpu":
        return torch.device(w.device)
    return torch.device("cpu")


def run(stream: StreamView, t: Transfer) -> None:
    """Run this rank's part ``t`` of a `SendTensor` on ``stream``'s thread (errors: see
    `palatine.tensor.worker.stream.Stream`; a user error is raised, for the stream to
    report and poison)."""
    import torch

    w = stream.worker
    cmd = t.cmd
    where = _where(stream, t)
    side = _verdict(torch, stream, t, where) if t.send_to is not None else _Side()
    if t.send_to == w.rank:  # paired with itself: a copy, no communication
        if side.problem is not None:
            raise side.problem
        stream.refs[cmd.result] = side.dep if side.dep is not None else side.value.detach().clone()
        return
    ctx = _context(stream)
    if type(ctx) is SeqError:  # the collective init failed, on every rank alike
        if t.receives:
            stream.refs[cmd.result] = ctx
        return
    assert isinstance(ctx, CollectiveContext)
    peers = sorted({r for r in (t.send_to, t.recv_from) if r is not None})
    timeout_s = collective_timeout_s()

    def wait(works: list[Any]) -> None:
        _wait_all(w, works, peers, where, timeout_s)

    try:
        _exchange(torch, stream, t, ctx, side, where, wait)
    except BaseException as e:
        if is_peer_loss(e):
            abandon_groups(w, str(e), in_flight=isinstance(e, CollectivePeerLost))
        raise


_Op = tuple[Any, Any, int, int]
"""A point-to-point operation to post: ``(dist.isend or dist.irecv, tensor, peer, tag)``."""

_posting = threading.Lock()


def _post(ctx: CollectiveContext, ops: list[_Op]) -> list[Any]:
    """Post one phase's operations on the world group; their works.

    NCCL runs a rank's sends and receives of a phase as one group (posted one by one,
    a send could wait on the GPU for a receive its peer posts behind its own send);
    gloo's operations are independent of each other and are posted as they are. One
    stream posts at a time: a group being posted is state of the process group.
    """
    import torch.distributed as dist

    with _posting:
        if ctx.backend == "nccl":
            batch = [dist.P2POp(fn, tensor, peer, tag=tag) for fn, tensor, peer, tag in ops]
            return list(dist.batch_isend_irecv(batch))
        return [fn(tensor, peer, tag=tag) for fn, tensor, peer, tag in ops]


def _wait_all(w: WorkerState, works: list[Any], peers: list[int], what: str, t: float) -> None:
    """Wait for the works of one phase; a lost peer ends the wait at once. A work with a
    future (NCCL) is waited for on this thread (its stream then waits on the GPU); gloo's
    point-to-point works have none: they are waited for on a thread of their own."""
    try:
        for work in works:
            work.get_future()
    except RuntimeError:

        def block() -> None:
            limit = datetime.timedelta(seconds=t)
            for work in works:
                work.wait(limit)

        run_abortable(w.peers, block, peers, w.rank, what, t + 5.0)
        return
    for work in works:
        wait_work(w.peers, work, peers, w.rank, what, t)


def _exchange(
    torch: Any,
    stream: StreamView,
    t: Transfer,
    ctx: CollectiveContext,
    side: _Side,
    where: str,
    wait: Any,
) -> None:
    """The two phases with the peers, then the outcome: bind, poison, or raise."""
    import torch.distributed as dist

    w = stream.worker
    cmd = t.cmd
    dev = ctx.device
    factory = cmd.factory
    seq = cmd.seq
    first: list[_Op] = []
    second: list[_Op] = []

    # The sending part knows everything it will send before it sends anything.
    failed = side.problem is not None or side.dep is not None
    if t.send_to is not None:
        data: Any = None
        error: Any = None
        header = [0] * _HEADER_LEN
        if failed:
            werr = (
                side.dep.error
                if side.dep is not None
                else w.worker_error(seq, stream.name, LABEL, side.problem)  # type: ignore[arg-type]
            )
            raw = msgspec.msgpack.encode(werr)
            error = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)
            header[_STATUS] = _FAILED
            header[_ERR_LEN] = len(raw)
            if factory is not None:
                data = torch.zeros(_factory_nbytes(torch, factory), dtype=torch.uint8, device=dev)
        else:
            v = side.value
            data = v.detach().to(dev).contiguous().reshape(-1).view(torch.uint8)
            header[_DTYPE] = _dtype_code(v.dtype)
            header[_NDIM] = v.dim()
            header[_NBYTES] = data.numel()
            header[_DEVICE] = _CPU if v.device.type == "cpu" else _ACCELERATOR
            header[_SHAPE : _SHAPE + v.dim()] = list(v.shape)
        hdr = torch.tensor(header, dtype=torch.int64, device=dev)
        first.append((dist.isend, hdr, t.send_to, _tag(seq, _HEADER_TAG)))
        if data is not None and data.numel():
            phase = first if factory is not None else second
            phase.append((dist.isend, data, t.send_to, _tag(seq, _DATA_TAG)))
        if error is not None:
            second.append((dist.isend, error, t.send_to, _tag(seq, _ERROR_TAG)))

    got_hdr: Any = None
    got_data: Any = None
    if t.recv_from is not None:
        got_hdr = torch.empty(_HEADER_LEN, dtype=torch.int64, device=dev)
        first.append((dist.irecv, got_hdr, t.recv_from, _tag(seq, _HEADER_TAG)))
        if factory is not None:
            got_data = torch.empty(_factory_nbytes(torch, factory), dtype=torch.uint8, device=dev)
            if got_data.numel():
                first.append((dist.irecv, got_data, t.recv_from, _tag(seq, _DATA_TAG)))
    wait(_post(ctx, first))

    h: list[int] = []
    got_error: Any = None
    if t.recv_from is not None:
        h = got_hdr.tolist()
        if h[_STATUS] != _OK:
            got_error = torch.empty(h[_ERR_LEN], dtype=torch.uint8, device=dev)
            second.append((dist.irecv, got_error, t.recv_from, _tag(seq, _ERROR_TAG)))
        elif factory is None:
            got_data = torch.empty(h[_NBYTES], dtype=torch.uint8, device=dev)
            if got_data.numel():
                second.append((dist.irecv, got_data, t.recv_from, _tag(seq, _DATA_TAG)))
    if second:
        wait(_post(ctx, second))

    if side.problem is not None:
        raise side.problem  # after the peer learned it: this rank's own user error
    if t.recv_from is None:
        return
    if got_error is not None:
        werr = msgspec.msgpack.decode(bytes(got_error.cpu().tolist()), type=WorkerError)
        stream.refs[cmd.result] = SeqError(werr.seq, werr)  # the source's error, silently
        return
    if factory is not None:
        dtype = _factory_dtype(torch, factory)
        shape = list(factory.size)
    else:
        dtype = _dtype_of(torch, h[_DTYPE])
        shape = h[_SHAPE : _SHAPE + h[_NDIM]]
        if dtype is None:
            raise TypeError(f"{where}: the source's dtype (code {h[_DTYPE]}) is unknown here")
    result = got_data.view(dtype).reshape(shape)
    stream.refs[cmd.result] = result.to(_own_device(torch, w, h[_DEVICE]))
