"""Device mesh views and collectives over torch.distributed (§1.4, §1.6).

* `DeviceMeshView` is one rank's view of a device mesh (a strided `Slice` of the worker
  world with dim names): its coordinate, the size and the **members** (ranks differing
  only along that dim) of every dim. User functions receive it for a mesh ref.
* Collectives run on a stream thread (`run` is called by `Stream.run_collective`):
  `BackendNetworkInit` joins the world-wide group through a TCPStore opened by rank 0
  (`open_store`, fetched by the client first), choosing NCCL iff every rank has its
  own CUDA device, else gloo (``PALATINE_COLLECTIVE_BACKEND`` overrides);
  `CreateProcessGroup` and `Reduce` make subgroups of a mesh's members with torch's
  local synchronisation, so only members take part.
* A `Reduce` whose input failed on some rank must not hang its peers: with a `Factory`
  the failed rank takes part with zeros; without one every member first all-gathers a
  small header ``(status, root seq, dtype, shape)`` and nobody runs the data collective
  when any header is not ok.

torch is imported lazily, only here and only on workers (``import torch`` costs ~2 s).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from palatine.worker.messages import (
    REDUCE_OPS,
    BackendNetworkInit,
    CreateProcessGroup,
    Reduce,
    Slice,
    WorkerError,
)
from palatine.worker.stream import MISSING, InfrastructureError, current_stream
from palatine.worker.values import SeqError

if TYPE_CHECKING:
    from palatine.worker.stream import Stream, WorkerState

__all__ = [
    "CollectiveContext",
    "DeviceMeshView",
    "backend_name",
    "collective_timeout_s",
    "destroy",
    "mesh_rank",
    "open_store",
    "run",
]

log = logging.getLogger(__name__)

_MAX_HEADER_DIMS = 8
_HEADER_LEN = 5 + _MAX_HEADER_DIMS
_OK, _DEPENDENT, _BAD_INPUT = 0, 1, 2


# --------------------------------------------------------------------------- meshes


class DeviceMeshView:
    """One rank's view of a device mesh: coordinates, sizes and members per dim.

    For slice ``(offset, sizes, strides)`` and this rank ``g`` the coordinates are the
    index vector with ``offset + Σ idx·stride = g``. ``members(dim)`` are the ranks that
    differ from ``g`` only along ``dim`` (several dims: along any of them), in index
    order. Example: 2×3 strides ``[3, 1]``, rank 1 → dim 0 members ``[1, 4]``, dim 1
    members ``[0, 1, 2]``.
    """

    __slots__ = ("coords", "global_rank", "names", "offset", "ref", "sizes", "strides")

    def __init__(
        self,
        ref: int,
        names: Sequence[str],
        sizes: Sequence[int],
        strides: Sequence[int],
        offset: int,
        coords: Sequence[int],
        global_rank: int,
    ) -> None:
        self.ref = ref
        self.names = tuple(names)
        self.sizes = tuple(sizes)
        self.strides = tuple(strides)
        self.offset = offset
        self.coords = tuple(coords)
        self.global_rank = global_rank

    @classmethod
    def create(cls, ref: int, names: Sequence[str], ranks: Slice, rank: int) -> DeviceMeshView:
        """This ``rank``'s view; ValueError when the rank is not in the slice."""
        if len(names) != len(ranks.sizes) or len(ranks.sizes) != len(ranks.strides):
            raise ValueError(
                f"device mesh r{ref} has {len(names)} names, {len(ranks.sizes)} sizes and "
                f"{len(ranks.strides)} strides"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"device mesh r{ref} has duplicate dim names {list(names)}")
        for idx in itertools.product(*(range(s) for s in ranks.sizes)):
            g = ranks.offset + sum(i * st for i, st in zip(idx, ranks.strides, strict=True))
            if g == rank:
                return cls(ref, names, ranks.sizes, ranks.strides, ranks.offset, idx, rank)
        raise ValueError(
            f"rank {rank} is outside device mesh r{ref} (offset {ranks.offset}, sizes "
            f"{list(ranks.sizes)}, strides {list(ranks.strides)})"
        )

    def _dim(self, dim: str) -> int:
        try:
            return self.names.index(dim)
        except ValueError:
            raise ValueError(
                f"unknown dimension {dim!r}; this mesh has {list(self.names)}"
            ) from None

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self.coords[self._dim(dim)]

    def size(self, dim: str | None = None) -> int:
        """The size of ``dim`` (all dims: the number of ranks in the mesh)."""
        if dim is None:
            n = 1
            for s in self.sizes:
                n *= s
            return n
        return self.sizes[self._dim(dim)]

    def members(self, dims: str | Sequence[str] | None = None) -> list[int]:
        """Ranks that differ from this one only along ``dims`` (None: the whole mesh)."""
        if dims is None:
            sel = list(range(len(self.names)))
        elif isinstance(dims, str):
            sel = [self._dim(dims)]
        else:
            sel = [self._dim(d) for d in dims]
        out = []
        for vals in itertools.product(*(range(self.sizes[d]) for d in sel)):
            idx = list(self.coords)
            for d, v in zip(sel, vals, strict=True):
                idx[d] = v
            out.append(self.offset + sum(i * st for i, st in zip(idx, self.strides, strict=True)))
        return out

    @property
    def coordinates(self) -> dict[str, int]:
        """``{dim: coordinate}`` of this rank."""
        return dict(zip(self.names, self.coords, strict=True))

    def __repr__(self) -> str:
        dims = ", ".join(
            f"{n}={c}/{s}" for n, c, s in zip(self.names, self.coords, self.sizes, strict=True)
        )
        return f"DeviceMeshView(r{self.ref}, rank {self.global_rank}: {dims})"


def mesh_rank(mesh: DeviceMeshView, dims: str | Sequence[str]) -> int | tuple[int, ...]:
    """A remote function: this rank's coordinate along ``dims`` (a tuple for several)."""
    if isinstance(dims, str):
        return mesh.rank(dims)
    return tuple(mesh.rank(d) for d in dims)


# --------------------------------------------------------------------------- setup


def collective_timeout_s() -> float:
    """``PALATINE_COLLECTIVE_TIMEOUT`` (seconds, default 600)."""
    from palatine.config import parse_seconds

    text = os.environ.get("PALATINE_COLLECTIVE_TIMEOUT")
    return parse_seconds(text, name="PALATINE_COLLECTIVE_TIMEOUT") if text else 600.0


class CollectiveContext:
    """The world-wide collective session of this process (§1.6).

    ``palatine_group`` is what a user function receives for the context's ref: the
    world process group.
    """

    __slots__ = ("backend", "device", "palatine_group", "store")

    def __init__(self, backend: str, store: Any, group: Any, device: Any) -> None:
        self.backend = backend
        self.store = store
        self.palatine_group = group
        self.device = device

    def __repr__(self) -> str:
        return f"CollectiveContext({self.backend})"


_masters: list[Any] = []
_masters_lock = threading.Lock()


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def open_store() -> str:
    """A remote function for rank 0: open a TCPStore master on a free port; ``host:port``.

    The host is this worker's address host (``127.0.0.1`` for unix and local
    transports). The store lives until the worker exits.
    """
    import torch.distributed as dist

    s = current_stream()
    host = s.worker.store_host if s is not None else "127.0.0.1"
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=collective_timeout_s()),
    )
    with _masters_lock:
        _masters.append(store)
    return f"{_fmt_host(host)}:{store.port}"


def backend_name() -> str:
    """A remote function: the backend of the world collective group (``gloo``/``nccl``)."""
    import torch.distributed as dist

    return str(dist.get_backend())


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"invalid store address {addr!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def _device_info(w: WorkerState) -> tuple[str, str]:
    if w.device.startswith("cuda") and w.device_index is not None:
        import torch

        props = torch.cuda.get_device_properties(w.device_index)
        return "cuda", str(getattr(props, "uuid", w.device_index))
    return "cpu", ""


def _choose_backend(infos: list[list[str]]) -> str:
    override = os.environ.get("PALATINE_COLLECTIVE_BACKEND")
    if override:
        return override
    if all(kind == "cuda" for _h, kind, _u in infos):
        devices = {(h, u) for h, _k, u in infos}
        if len(devices) == len(infos):
            return "nccl"
    return "gloo"


def _backend_network_init(stream: Stream, cmd: BackendNetworkInit) -> None:
    import torch
    import torch.distributed as dist

    w = stream.worker
    if dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialised in the process of worker rank {w.rank}"
        )
    host, port = _split_addr(cmd.store_addr)
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, w.world_size, is_master=False, timeout=timeout, wait_for_workers=False
    )
    kind, uuid = _device_info(w)
    store.set(f"palatine/device/{w.rank}", json.dumps([socket.gethostname(), kind, uuid]))
    infos = [json.loads(store.get(f"palatine/device/{r}")) for r in range(w.world_size)]
    backend = _choose_backend(infos)
    kwargs: dict[str, Any] = {}
    device = torch.device("cpu")
    if backend == "nccl" and w.device_index is not None:
        device = torch.device("cuda", w.device_index)
        kwargs["device_id"] = device
    prefixed = dist.PrefixStore("palatine/pg/", store)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend,
        store=prefixed,
        rank=w.rank,
        world_size=w.world_size,
        timeout=timeout,
        **kwargs,
    )
    ctx = CollectiveContext(backend, store, dist.group.WORLD, device)
    w.groups[cmd.result] = ctx
    w.collective = ctx
    log.info("rank %d joined the collective group (%s, %d ranks)", w.rank, backend, w.world_size)


_named = threading.local()
_patch_lock = threading.Lock()
_patched = False


def _install_group_namer() -> None:
    """Let us choose subgroup names (identical on every member, by construction).

    torch names a locally synchronised group by hashing its ranks together with the
    number of groups *this process* has created so far; ranks that took part in
    different sub-mesh groups before would then disagree on the name (and the store
    prefix) and never rendezvous. Our names derive from the command (seq and ref), so
    members always agree. The override applies only while a thread has set a name.
    """
    global _patched
    with _patch_lock:
        if _patched:
            return
        from torch.distributed import distributed_c10d as c10d

        original = getattr(c10d, "_process_group_name", None)
        if original is None:  # a torch without the hook: keep its own names
            _patched = True
            return

        def name_for(ranks: Any, use_hashed_name: Any) -> Any:
            name = getattr(_named, "name", None)
            if name is not None:
                return name
            return original(ranks, use_hashed_name)

        c10d._process_group_name = name_for
        _patched = True


def _new_group(ranks: list[int], what: str) -> Any:
    """A locally synchronised group of ``ranks`` named after the command ``what``.

    Sibling subgroups made by one command (the rows of a mesh) differ in their members,
    so the members are part of the name.
    """
    import hashlib

    import torch.distributed as dist

    _install_group_namer()
    members = "_".join(map(str, ranks))
    if len(members) > 64:
        members = hashlib.blake2b(members.encode(), digest_size=12).hexdigest()
    _named.name = f"{what}.{members}"
    try:
        return dist.new_group(
            ranks,
            timeout=datetime.timedelta(seconds=collective_timeout_s()),
            use_local_synchronization=True,
        )
    finally:
        _named.name = None


def _context(stream: Stream) -> CollectiveContext | SeqError:
    """The session's collective context (waiting for an init still running elsewhere)."""
    pending = stream.worker.collective_pending
    if pending is not None and not pending.is_set():
        stream.wait_event(pending)
    ctx = stream.worker.collective
    if ctx is None:
        raise RuntimeError(
            f"collectives are not initialised on worker rank {stream.worker.rank}: "
            "BackendNetworkInit must run first"
        )
    return ctx  # type: ignore[no-any-return]


def _mesh(stream: Stream, ref: int, what: str) -> DeviceMeshView:
    view = stream.worker.meshes.get(ref)
    if view is None:
        raise InfrastructureError(
            f"unknown device mesh r{ref} in {what} on rank {stream.worker.rank}"
        )
    return view  # type: ignore[no-any-return]


def _create_process_group(stream: Stream, cmd: CreateProcessGroup) -> None:
    view = _mesh(stream, cmd.mesh, f"CreateProcessGroup s{cmd.seq}")
    members = sorted(view.members(cmd.dims or None))
    ctx = _context(stream)
    if type(ctx) is SeqError:
        stream.poison_collective(cmd, ctx)
        return
    pg = _new_group(members, f"palatine.pg.s{cmd.seq}.r{cmd.result}")
    stream.worker.groups[cmd.result] = pg


# --------------------------------------------------------------------------- reduce


_unsupported: set[tuple[str, str]] = set()


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


def _all_reduce(dist: Any, ctx: Any, t: Any, op: str, group: Any, n: int) -> None:
    if op == "avg":

        def emulate() -> None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            if t.is_floating_point() or t.is_complex():
                t.div_(n)
            else:
                t.floor_divide_(n)

        _try_native(
            ctx.backend,
            "avg",
            lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group),
            emulate,
        )
    else:
        dist.all_reduce(t, op=_torch_op(dist, op), group=group)


def _collective(
    torch: Any, dist: Any, ctx: Any, cmd: Reduce, t: Any, group: Any, n: int, me: int
) -> Any:
    """The data collective on ``t`` (already on the communication device)."""
    op = cmd.op
    if op == "stack":
        if cmd.scatter:
            inp = t.contiguous()
            out = torch.empty_like(inp)

            def a2a_emulated() -> Any:
                parts = [torch.empty_like(inp) for _ in range(n)]
                dist.all_gather(parts, inp, group=group)
                return torch.cat([p.chunk(n)[me] for p in parts])

            def a2a() -> Any:
                dist.all_to_all_single(out, inp, group=group)
                return out

            return _try_native(ctx.backend, "all_to_all", a2a, a2a_emulated)
        inp = t.contiguous()
        flat = inp.reshape(-1)
        gathered = torch.empty(n * flat.numel(), dtype=inp.dtype, device=inp.device)

        def gather_emulated() -> Any:
            parts = [torch.empty_like(inp) for _ in range(n)]
            dist.all_gather(parts, inp, group=group)
            return torch.stack(parts)

        def gather() -> Any:
            # The concatenated output form: every backend accepts it.
            dist.all_gather_into_tensor(gathered, flat, group=group)
            return gathered.view(n, *inp.shape)

        return _try_native(ctx.backend, "all_gather_into_tensor", gather, gather_emulated)
    if cmd.scatter:
        inp = t.contiguous()
        out = torch.empty((inp.shape[0] // n, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)

        def rs_emulated() -> Any:
            tmp = inp.clone()
            _all_reduce(dist, ctx, tmp, op, group, n)
            return tmp.chunk(n)[me].clone()

        def rs() -> Any:
            if op == "avg":
                dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG, group=group)
            else:
                dist.reduce_scatter_tensor(out, inp, op=_torch_op(dist, op), group=group)
            return out

        return _try_native(ctx.backend, f"reduce_scatter.{op}", rs, rs_emulated)
    work = t if cmd.in_place else t.clone()
    _all_reduce(dist, ctx, work, op, group, n)
    return work


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
        h[2] = dts.index(t.dtype) if t.dtype in dts else 100 + hash(str(t.dtype)) % 1000
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


def _reduce(stream: Stream, cmd: Reduce) -> None:
    import torch
    import torch.distributed as dist

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
    key = (cmd.mesh, dims)
    group = w.reduce_groups.get(key)
    if group is None:
        group = w.reduce_groups[key] = _new_group(
            members, f"palatine.reduce.s{cmd.seq}.r{cmd.mesh}"
        )
    comm_device = ctx.device

    if cmd.factory is not None:
        # The client knew the metadata: a failed input takes part with zeros (§1.6).
        t = _fabricate(torch, cmd.factory) if (problem is not None or dep is not None) else value
        res = _run_data(torch, dist, ctx, cmd, t, group, n, me, comm_device)
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
    dist.all_gather(parts, hdr, group=group)
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
    res = _run_data(torch, dist, ctx, cmd, value, group, n, me, comm_device)
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
) -> Any:
    """Run the collective, staging through the communication device when needed."""
    if t.device == comm_device:
        return _collective(torch, dist, ctx, cmd, t, group, n, me)
    staged = t.to(comm_device)
    res = _collective(torch, dist, ctx, cmd, staged, group, n, me)
    if cmd.in_place:
        t.copy_(staged)
        return t
    return res.to(t.device)


def _bind(stream: Stream, cmd: Reduce, res: Any, value: Any, out_t: Any) -> None:
    if out_t is not None:
        out_t.copy_(res)
        res = out_t
    stream.refs[cmd.result] = res


# --------------------------------------------------------------------------- entry points


def run(stream: Stream, cmd: BackendNetworkInit | CreateProcessGroup | Reduce) -> None:
    """Execute one collective command on ``stream``'s thread (errors: see `Stream`)."""
    if type(cmd) is Reduce:
        _reduce(stream, cmd)
    elif type(cmd) is CreateProcessGroup:
        _create_process_group(stream, cmd)
    elif type(cmd) is BackendNetworkInit:
        _backend_network_init(stream, cmd)
    else:
        raise InfrastructureError(f"not a collective command: {type(cmd).__name__}")


def destroy() -> None:
    """Tear down this process's collective state (worker `Exit`): groups, store masters."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("destroying the process group failed: %s", e)
    with _masters_lock:
        _masters.clear()
