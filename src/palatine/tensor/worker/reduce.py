"""Reductions over device-mesh dims: `Reduce` on a stream.

``op`` ∈ sum, avg, product, min, max, band, bor, bxor → all-reduce; with ``scatter`` →
reduce-scatter along dim 0; ``stack`` → all-gather into a new leading dim; ``stack`` +
``scatter`` → all-to-all. Ops gloo lacks are emulated. A `Reduce` whose input failed on
some rank must not hang its peers: with a `Factory` the failed rank takes part with
zeros; without one every member first all-gathers a small header and nobody runs the
data collective when any header is not ok. torch is imported lazily (workers only).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from palatine.errors import CollectivePeerLost
from palatine.protocol.worker import REDUCE_OPS, Reduce, WorkerError
from palatine.tensor.worker.collectives import (
    CollectiveContext,
    _context,
    _mesh,
    _new_group,
    abandon_groups,
    collective_timeout_s,
)
from palatine.tensor.worker.peers import is_peer_loss, wait_work
from palatine.tensor.worker.state import MISSING
from palatine.tensor.worker.values import SeqError

if TYPE_CHECKING:
    from palatine.tensor.worker.state import StreamView, WorkerState

__all__ = ["reduce"]

log = logging.getLogger(__name__)

_MAX_HEADER_DIMS = 8
_HEADER_LEN = 5 + _MAX_HEADER_DIMS
_OK, _DEPENDENT, _BAD_INPUT = 0, 1, 2


_unsupported: set[tuple[str, str]] = set()

Wait = Callable[[Any], None]
"""Waits for an asynchronous collective's work (`palatine.tensor.worker.peers.wait_work`)."""


def _is_unsupported(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, NotImplementedError | RuntimeError) and (
        "not support" in text or "unsupported" in text or "does not support" in text
    )


def _try_native(backend: str, kind: str, native: Any, emulate: Any) -> Any:
    """Run ``native()``; if the backend lacks the op, ``emulate()`` (remembered)."""
    key = (backend, kind)
    if key not in _unsupported:
        try:
            return native()
        except (RuntimeError, NotImplementedError) as e:
            if not _is_unsupported(e):
                raise
            log.info("%s lacks %s; emulating it", backend, kind)
            _unsupported.add(key)
    return emulate()


def _torch_op(dist: Any, op: str) -> Any:
    return {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
        "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR,
    }[op]


def _result_shape(cmd: Reduce, shape: Sequence[int], n: int) -> list[int]:
    shape = list(shape)
    if cmd.op == "stack":
        if cmd.scatter:
            _check_divisible(shape, n, "stack with scatter (all-to-all)")
            return shape
        return [n, *shape]
    if cmd.scatter:
        _check_divisible(shape, n, "reduce-scatter")
        return [shape[0] // n, *shape[1:]]
    return shape


def _check_divisible(shape: list[int], n: int, what: str) -> None:
    if not shape or shape[0] % n:
        d0 = shape[0] if shape else "none (a 0-d tensor)"
        raise ValueError(f"{what} needs dim 0 divisible by the group size {n}; dim 0 is {d0}")


def _all_reduce(dist: Any, ctx: Any, t: Any, op: str, group: Any, n: int, wait: Wait) -> None:
    if op == "avg":

        def emulate() -> None:
            wait(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True))
            if t.is_floating_point() or t.is_complex():
                t.div_(n)
            else:
                t.floor_divide_(n)

        _try_native(
            ctx.backend,
            "avg",
            lambda: wait(dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group, async_op=True)),
            emulate,
        )
    else:
        wait(dist.all_reduce(t, op=_torch_op(dist, op), group=group, async_op=True))


def _collective(
    torch: Any, dist: Any, ctx: Any, cmd: Reduce, t: Any, group: Any, n: int, me: int, wait: Wait
) -> Any:
    """The data collective on ``t`` (already on the communication device)."""
    op = cmd.op
    if op == "stack":
        if cmd.scatter:
            inp = t.contiguous()
            out = torch.empty_like(inp)

            def a2a_emulated() -> Any:
                parts = [torch.empty_like(inp) for _ in range(n)]
                wait(dist.all_gather(parts, inp, group=group, async_op=True))
                return torch.cat([p.chunk(n)[me] for p in parts])

            def a2a() -> Any:
                wait(dist.all_to_all_single(out, inp, group=group, async_op=True))
                return out

            return _try_native(ctx.backend, "all_to_all", a2a, a2a_emulated)
        inp = t.contiguous()
        flat = inp.reshape(-1)
        gathered = torch.empty(n * flat.numel(), dtype=inp.dtype, device=inp.device)

        def gather_emulated() -> Any:
            parts = [torch.empty_like(inp) for _ in range(n)]
            wait(dist.all_gather(parts, inp, group=group, async_op=True))
            return torch.stack(parts)

        def gather() -> Any:
            # The concatenated output form: every backend accepts it.
            # (all_gather_single where torch has it: all_gather_into_tensor warns there)
            native = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            wait(native(gathered, flat, group=group, async_op=True))
            return gathered.view(n, *inp.shape)

        return _try_native(ctx.backend, "all_gather_into_tensor", gather, gather_emulated)
    if cmd.scatter:
        inp = t.contiguous()
        out = torch.empty((inp.shape[0] // n, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)

        def rs_emulated() -> Any:
            tmp = inp.clone()
            _all_reduce(dist, ctx, tmp, op, group, n, wait)
            return tmp.chunk(n)[me].clone()

        def rs() -> Any:
            rop = dist.ReduceOp.AVG if op == "avg" else _torch_op(dist, op)
            native = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
            wait(native(out, inp, op=rop, group=group, async_op=True))
            return out

        return _try_native(ctx.backend, f"reduce_scatter.{op}", rs, rs_emulated)
    res = t if cmd.in_place else t.clone()
    _all_reduce(dist, ctx, res, op, group, n, wait)
    return res


def _local(torch: Any, cmd: Reduce, t: Any) -> Any:
    """A reduce over a group of one: no communication."""
    if cmd.op == "stack" and not cmd.scatter:
        return t.unsqueeze(0).clone()
    return t if cmd.in_place else t.clone()


def _dtypes(torch: Any) -> list[Any]:
    return [
        getattr(torch, n)
        for n in (
            "float32",
            "float64",
            "float16",
            "bfloat16",
            "int8",
            "uint8",
            "int16",
            "int32",
            "int64",
            "bool",
            "complex64",
            "complex128",
        )
    ]


def _header(torch: Any, status: int, root: int, t: Any, device: Any) -> Any:
    h = [status, root, -1, -1, -1] + [0] * _MAX_HEADER_DIMS
    if status == _OK:
        dts = _dtypes(torch)
        if t.dtype in dts:
            h[2] = dts.index(t.dtype)
        else:  # the same code in every worker process (str hashes are salted per process)
            h[2] = 100 + zlib.crc32(str(t.dtype).encode()) % 1000
        h[3] = t.dim()
        h[4] = t.numel()
        for i, s in enumerate(list(t.shape)[:_MAX_HEADER_DIMS]):
            h[5 + i] = s
    return torch.tensor(h, dtype=torch.int64, device=device)


def _describe(torch: Any, h: list[int]) -> str:
    dts = _dtypes(torch)
    dt = str(dts[h[2]]).removeprefix("torch.") if 0 <= h[2] < len(dts) else f"dtype#{h[2]}"
    dims = h[5 : 5 + min(h[3], _MAX_HEADER_DIMS)]
    return f"{dt}{dims}"


def _fabricate(torch: Any, f: Any) -> Any:
    return torch.zeros(
        f.size, dtype=getattr(torch, f.dtype.removeprefix("torch.")), device=f.device
    )


def _dependent_error(
    w: WorkerState, cmd: Reduce, grank: int, root: int, bad_input: bool
) -> SeqError:
    """What a healthy peer stores when another member's reduce input failed (silent)."""
    if bad_input:
        msg = f"reduce s{cmd.seq} failed on rank {grank}: bad input there"
        seq = cmd.seq
    else:
        msg = f"the input of reduce s{cmd.seq} failed on rank {grank} (root s{root})"
        seq = root
    werr = WorkerError(
        seq=seq,
        rank=grank,
        world=w.world,
        proc_id=f"{w.world}[{grank}]",
        host="",
        pid=0,
        stream="",
        function="reduce",
        exc_type="builtins.RuntimeError",
        message=msg,
    )
    return SeqError(seq, werr)


def _reduce(stream: StreamView, cmd: Reduce) -> None:
    import torch

    w = stream.worker
    view = _mesh(stream, cmd.mesh, f"Reduce s{cmd.seq}")
    if cmd.op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {cmd.op!r}; expected one of {', '.join(REDUCE_OPS)}")
    if cmd.in_place and (cmd.scatter or cmd.op == "stack"):
        raise ValueError("in_place needs an all-reduce (an op that keeps the shape, no scatter)")
    dims = tuple(cmd.dims) if cmd.dims else view.names
    members = sorted(view.members(dims))
    n = len(members)
    me = members.index(w.rank)

    # Local verdict first, without raising: peers must learn it before anyone gives up.
    problem: BaseException | None = None
    dep: SeqError | None = None
    value = stream.refs.get(cmd.value, MISSING)
    out_t: Any = None
    if value is MISSING:
        problem = LookupError(
            f"ref r{cmd.value} not found on stream {stream.name} of rank {w.rank}"
        )
    elif type(value) is SeqError:
        dep = value
    elif not isinstance(value, torch.Tensor):
        problem = TypeError(f"reduce needs a tensor, got a {type(value).__qualname__}")
    if cmd.out is not None and problem is None and dep is None:
        out_t = stream.refs.get(cmd.out, MISSING)
        if out_t is MISSING:
            problem = LookupError(
                f"ref r{cmd.out} not found on stream {stream.name} of rank {w.rank}"
            )
        elif type(out_t) is SeqError:
            dep = out_t
        elif not isinstance(out_t, torch.Tensor):
            problem = TypeError(f"reduce out= needs a tensor, got a {type(out_t).__qualname__}")
    if problem is None and dep is None:
        try:
            shape = _result_shape(cmd, value.shape, n)
            if out_t is not None and list(out_t.shape) != shape:
                raise ValueError(
                    f"reduce out tensor has shape {list(out_t.shape)} but the result has shape {shape}"
                )
        except ValueError as e:
            problem = e

    if n == 1:
        if problem is not None:
            raise problem
        if dep is not None:
            stream.poison_collective(cmd, dep)
            return
        _bind(stream, cmd, _local(torch, cmd, value), value, out_t)
        return

    ctx = _context(stream)
    if type(ctx) is SeqError:
        stream.poison_collective(cmd, ctx)
        return
    assert isinstance(ctx, CollectiveContext)
    timeout_s = collective_timeout_s()

    def wait(work: Any) -> None:
        wait_work(w.peers, work, members, w.rank, f"reduce s{cmd.seq}", timeout_s)

    try:
        _in_group(stream, cmd, ctx, dims, members, me, value, out_t, problem, dep, wait)
    except BaseException as e:
        if is_peer_loss(e):
            abandon_groups(w, str(e), in_flight=isinstance(e, CollectivePeerLost))
        raise


def _in_group(
    stream: StreamView,
    cmd: Reduce,
    ctx: CollectiveContext,
    dims: tuple[str, ...],
    members: list[int],
    me: int,
    value: Any,
    out_t: Any,
    problem: BaseException | None,
    dep: SeqError | None,
    wait: Wait,
) -> None:
    """The part of a reduce that talks to its group's other members."""
    import torch
    import torch.distributed as dist

    w = stream.worker
    n = len(members)
    key = (cmd.mesh, dims)
    group = w.reduce_groups.get(key)
    if group is None:
        group = w.reduce_groups[key] = _new_group(
            w, members, f"palatine.reduce.s{cmd.seq}.r{cmd.mesh}"
        )
    comm_device = ctx.device

    if cmd.factory is not None:
        # The client knew the metadata: a failed input takes part with zeros.
        t = _fabricate(torch, cmd.factory) if (problem is not None or dep is not None) else value
        res = _run_data(torch, dist, ctx, cmd, t, group, n, me, comm_device, wait)
        if problem is not None:
            raise problem
        if dep is not None:
            stream.poison_collective(cmd, dep)
            return
        _bind(stream, cmd, res, value, out_t)
        return

    status = (
        _OK if problem is None and dep is None else (_DEPENDENT if dep is not None else _BAD_INPUT)
    )
    hdr = _header(torch, status, dep.seq if dep is not None else -1, value, comm_device)
    parts = [torch.empty_like(hdr) for _ in range(n)]
    wait(dist.all_gather(parts, hdr, group=group, async_op=True))
    heads = [p.tolist() for p in parts]
    bad = [(i, h) for i, h in enumerate(heads) if h[0] != _OK]
    if bad:
        if problem is not None:
            raise problem
        if dep is not None:
            stream.poison_collective(cmd, dep)
            return
        deps = [(i, h) for i, h in bad if h[0] == _DEPENDENT]
        i, h = deps[0] if deps else bad[0]
        stream.poison_collective(cmd, _dependent_error(w, cmd, members[i], h[1], not deps))
        return
    if any(h[2:] != heads[0][2:] for h in heads):
        listing = ", ".join(f"rank {members[i]} {_describe(torch, h)}" for i, h in enumerate(heads))
        raise ValueError(f"reduce inputs differ across ranks: {listing}")
    res = _run_data(torch, dist, ctx, cmd, value, group, n, me, comm_device, wait)
    _bind(stream, cmd, res, value, out_t)


def _run_data(
    torch: Any,
    dist: Any,
    ctx: CollectiveContext,
    cmd: Reduce,
    t: Any,
    group: Any,
    n: int,
    me: int,
    comm_device: Any,
    wait: Wait,
) -> Any:
    """Run the collective, staging through the communication device when needed."""
    if t.device == comm_device:
        return _collective(torch, dist, ctx, cmd, t, group, n, me, wait)
    staged = t.to(comm_device)
    res = _collective(torch, dist, ctx, cmd, staged, group, n, me, wait)
    if cmd.in_place:
        t.copy_(staged)
        return t
    return res.to(t.device)


def _bind(stream: StreamView, cmd: Reduce, res: Any, value: Any, out_t: Any) -> None:
    if out_t is not None:
        out_t.copy_(res)
        res = out_t
    stream.refs[cmd.result] = res


reduce = _reduce
