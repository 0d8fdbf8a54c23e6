"""`palatine.Tensor`: a tensor that lives on a mesh and a stream, and how its ops leave.

A `Tensor` is a ``torch.Tensor`` wrapper subclass with no data of its own: it carries
the metadata of the tensor each rank of its mesh holds (shape, strides, dtype, device,
``requires_grad``) and the `RemoteValue` that names it on the workers (its ref, mesh,
stream and the seq that made it). Dropping the last client object drops the value.

Every torch op on it reaches `Tensor.__torch_dispatch__` as an aten overload
(``aten.add.Tensor``). `dispatch` checks the arguments (the three Monarch errors:
`LOCAL_TENSOR`, `WRONG_MESH`, `WRONG_STREAM`), learns what the op returns from fake
tensors (`palatine.tensor.client.fake`, cached by op and input metadata), and issues it
through the session like a remote call: one seq whose Node defines the outputs' refs
(and redefines the inputs it writes), and a ``CallFunction`` naming the op by path
(``torch.ops.aten.add.Tensor``). The controller's history orders it after what it
uses, and a failure fails exactly what depends on it.

Views and in-place ops: an output that views an input joins the input's *alias group*
(`Storage`); an op that writes a tensor in place (or through ``out=``) returns that
tensor object itself and lists every live tensor of its group as mutated, so a failure
of the write poisons each of them.
"""

from __future__ import annotations

import io
import math
import pickle
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Final, cast

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from palatine import config
from palatine.core.future import Future
from palatine.errors import CoalescingError
from palatine.protocol.worker import (
    REDUCE_OPS,
    CallFunction,
    FunctionPath,
    FunctionRef,
    Pickled,
    RequestStatus,
    Slice,
)
from palatine.tensor.client import known
from palatine.tensor.client.collectives import reduce
from palatine.tensor.client.context import active_stream, get_active_mesh
from palatine.tensor.client.drops import slice_key
from palatine.tensor.client.fake import Meta, OpSpec, propagate
from palatine.tensor.client.remote import restore as restore_value
from palatine.tensor.client.session import Stream
from palatine.tensor.client.sites import capture_site
from palatine.tensor.client.transfer import to_mesh as move
from palatine.tensor.client.values import RemoteValue, SlicedValue, ValueMesh, pickle_args
from palatine.tensor.worker.local_shard import local_shard
from palatine.tensor.worker.values import REF_TAG, dumps_args

__all__ = [
    "LOCAL_TENSOR",
    "WRONG_MESH",
    "WRONG_STREAM",
    "DROPPED",
    "BORROWED",
    "Borrow",
    "MUTATING_BORROW",
    "Storage",
    "Tensor",
    "check_tensors",
    "dispatch",
    "issue",
    "mesh_tensors",
    "move_tensor",
    "same_mesh",
    "slice_tensor",
    "wrap",
]

LOCAL_TENSOR: Final = (
    "LOCAL_TENSOR: a local tensor (one that lives in this process) was mixed with mesh "
    "tensors; move it to the mesh first (make it under mesh.activate(), or pass it to a "
    "remote function), or compute with local tensors only inside palatine.no_mesh()"
)
WRONG_MESH: Final = (
    "WRONG_MESH: tensors of two meshes were used together; an op runs on one mesh (its "
    "first mesh tensor's; the active one for an op without tensors): move the tensor "
    "with tensor.to_mesh(mesh)"
)
WRONG_STREAM: Final = (
    "WRONG_STREAM: a tensor was used on a stream that does not own it; borrow it with "
    "stream.borrow(tensor)"
)
DROPPED: Final = "DROPPED: a dropped tensor was used"
BORROWED: Final = (
    "BORROWED: a tensor lent to another stream by a mutable borrow was used; drop the "
    "borrow first (borrow.drop())"
)
MUTATING_BORROW: Final = (
    "MUTATING_BORROW: a tensor that is borrowed by another stream (or a borrowed tensor "
    "itself) would be written; end the borrow first (borrow.drop())"
)


class Storage:
    """The alias group of a worker-side storage: the live mesh tensors that view it.

    An in-place write to any of them changes all of them on the workers, so the op lists
    every live member as mutated (its Node redefines their refs, and a failure poisons
    them all)."""

    __slots__ = ("members", "borrowed", "lent", "read_only", "__weakref__")

    def __init__(self, read_only: bool = False) -> None:
        self.members: weakref.WeakSet[Tensor] = weakref.WeakSet()
        #: How many read-only borrows (``stream.borrow(t)``) of this storage are open:
        #: while any is, no op may write it (``MUTATING_BORROW``).
        self.borrowed = 0
        #: Lent to another stream by a mutable borrow: no op may use it (``BORROWED``).
        self.lent = False
        #: This storage is a read-only borrow of another stream's tensor.
        self.read_only = read_only


class Tensor(torch.Tensor):
    """A tensor on every rank of a mesh, on one stream; its data stays on the workers.

    Torch ops on it (and torch factories under ``mesh.activate()``) return new mesh
    tensors at once, computed on the workers in issue order. ``palatine.inspect(t)``
    or ``palatine.fetch_shard(t)`` bring a shard's value back."""

    # No Python-level torch function handling: ops go straight to __torch_dispatch__.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    _value: RemoteValue
    _meta: Meta
    _storage: Storage
    #: The value every rank holds, when the client knows it (`palatine.tensor.client.known`).
    _known: torch.Tensor | None

    @staticmethod
    def __new__(cls, value: RemoteValue, meta: Meta, storage: Storage | None = None) -> Tensor:
        t: Tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride,
            dtype=meta.dtype,
            device=meta.device,
            requires_grad=meta.requires_grad,
        )
        t._value = value
        t._meta = meta
        t._known = None
        s = storage if storage is not None else Storage()
        t._storage = s
        s.members.add(t)
        return t

    def __init__(self, value: RemoteValue, meta: Meta, storage: Storage | None = None) -> None:
        pass  # all done in __new__ (torch.Tensor's own __init__ takes no such arguments)

    # ------------------------------------------------------------ identity
    @property
    def __palatine_ref__(self) -> int:
        """The ref the workers know this tensor by (pickled as ``("ref", n)``)."""
        return self._value.ref

    @property
    def ref(self) -> int:
        return self._value.ref

    @property
    def mesh(self) -> ValueMesh:
        """The mesh whose every rank holds a shard of this tensor."""
        return self._value.mesh

    @property
    def stream(self) -> Stream:
        """The stream that owns this tensor (ops on another stream must borrow it)."""
        return self._value.stream

    @property
    def value(self) -> RemoteValue:
        """This tensor as a `RemoteValue` (for APIs that take one)."""
        return self._value

    @property
    def dropped(self) -> bool:
        return self._value.dropped_at is not None

    def drop(self) -> None:
        """Free the worker-side tensor now; a later use raises ``TypeError``."""
        self._value.drop()

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        v = self._value
        ranks = v.mesh.ranks
        contiguous = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
        span = f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 1 else f"{ranks}"
        dims = ", ".join(f"{n}={s}" for n, s in zip(v.mesh.names, v.mesh.sizes, strict=True))
        dtype = str(self._meta.dtype).removeprefix("torch.")
        return (
            f"palatine.Tensor(r{v.ref}, shape={list(self._meta.shape)}, dtype={dtype}, "
            f"device={self._meta.device}, mesh=({dims}) ranks {span}, stream={v.stream.name})"
        )

    __str__ = __repr__

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Into an actor call on the procs of its tensor engine (`palatine.job.engine`):
        as that proc's own shard, after every op issued before the call. Anywhere else
        it cannot travel: its data lives on the workers."""
        session = self._value.session
        if not session.actors_colocated:
            raise TypeError(
                f"{self!r} cannot be pickled: its data lives on the workers "
                "(pass it to a remote function, or fetch it with palatine.inspect)"
            )
        known.forget(list(self._storage.members))  # the actor may write it
        # Kept alive a while: a temporary (``a.f.call(torch.ones(2))``) would otherwise
        # be dropped, and its ref freed, before the actor's proc decodes the call.
        session.sent_to_actors.append(self)
        return (local_shard, (session.worker_world, self._value.ref, *_barrier(self)))

    def __bool__(self) -> bool:
        return bool(known_here(self, "bool()"))

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_needs_data("numpy conversion"))

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """A copy on another device or dtype (or this tensor when nothing changes), as
        an op of the workers: the client's torch need not have the device (a CPU-only
        client drives CUDA workers)."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        copy = kwargs.get("copy", False)
        same_device = device is None or device == self.device
        if not copy and same_device and dtype in (None, self.dtype) and memory_format is None:
            return self
        options: dict[str, Any] = {"non_blocking": non_blocking}
        if dtype is not None:
            options["dtype"] = dtype
        if device is not None:
            options["device"] = device
        if memory_format is not None:
            options["memory_format"] = memory_format
        return torch.ops.aten._to_copy.default(self, **options)

    def cuda(self, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:  # type: ignore[override]
        """``to("cuda")`` (each worker's own device, or index ``device``)."""
        where = (
            torch.device("cuda")
            if device is None
            else torch.device("cuda", device)
            if isinstance(device, int)
            else torch.device(device)
        )
        return self.to(where, non_blocking=non_blocking)

    def cpu(self, **kwargs: Any) -> Any:  # type: ignore[override]
        """``to("cpu")``: on the workers' CPUs (``palatine.inspect`` brings values here)."""
        return self.to("cpu")

    def tolist(self) -> Any:
        return known_here(self, "tolist()").tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_needs_data("numpy()"))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return dispatch(func, args, kwargs or {})

    # ------------------------------------------------------------ collectives
    def reduce(
        self,
        dims: str | tuple[str, ...],
        reduction: str = "sum",
        scatter: bool = False,
        mesh: Any = None,
        _inplace: bool = False,
        out: Tensor | None = None,
    ) -> Tensor:
        """The ``reduction`` of this tensor over ``dims`` of its mesh: ``sum``, ``avg``,
        ``max``, ``min``, ``product``, or ``stack`` (a new leading dim of the group's
        size). ``scatter``: each member keeps its share of the result, split along dim 0
        (for ``stack``: its own slot). ``out``: a mesh tensor the result is written to.
        ``mesh`` is accepted for Monarch's signature and must be this tensor's mesh."""
        if mesh is not None and not same_mesh(mesh, self._value.mesh):
            raise TypeError(f"{WRONG_MESH}: reduce of {self!r} over another mesh {mesh!r}")
        return reduce_tensor(self, dims, reduction, scatter, _inplace, out)

    def reduce_(
        self,
        dims: str | tuple[str, ...],
        reduction: str = "sum",
        scatter: bool = False,
        mesh: Any = None,
    ) -> Tensor:
        """`reduce`, in place: this tensor becomes the result and is returned."""
        return self.reduce(dims, reduction, scatter, mesh, True)

    def _borrow_onto(self, stream: Stream, mutable: bool) -> Borrow:
        """`Stream.borrow` of this tensor."""
        return Borrow(self, stream, mutable)

    # ------------------------------------------------------------ meshes
    def to_mesh(self, mesh: Any, stream: Stream | None = None) -> Tensor:
        """This tensor copied to ``mesh``, a mesh of the same sizes (the rank at index i
        of this tensor's mesh sends its shard to the rank at index i of ``mesh``), on
        ``stream`` (default: this tensor's): the pipeline-parallel move."""
        return move_tensor(self, mesh, stream)

    def slice_mesh(self, **coords: int | slice) -> Tensor:
        """This tensor as the ranks of ``self.mesh.slice(**coords)`` hold it."""
        return slice_tensor(self, **coords)

    # ------------------------------------------------------------ recovery
    def restore(self, fn: Any = None, *args: Any, **kwargs: Any) -> Tensor:
        """After ``mesh.recover()``, make this tensor again on the ranks the recovery
        lost it on: as ``fn(*args, **kwargs)`` there, or, without ``fn``, as an
        uninitialized tensor of its shape, strides, dtype and device, for
        ``palatine.resync(t)`` (or an in-place write) to fill. The other ranks keep
        theirs. Returns this tensor, usable on its whole mesh again."""
        if fn is None:
            m = self._meta
            fn, args, kwargs = torch.empty_strided, (m.shape, m.stride), {"dtype": m.dtype}
            if m.device.type != "cpu":
                kwargs["device"] = str(m.device)
        restore_value(self._value, fn, *args, **kwargs)
        return self


# torch turns a TypeError raised inside a binary operator (``x + y``) into NotImplemented,
# and Python then reports only "unsupported operand type(s)". The operators of `Tensor`
# re-raise the error the dispatch met instead, which names the problem.
_met = threading.local()


def _operator(name: str) -> Any:
    base = getattr(torch.Tensor, name)

    def op(self: Tensor, other: Any) -> Any:
        _met.error = None
        out = base(self, other)
        if out is NotImplemented:
            err, _met.error = _met.error, None
            if err is not None:
                raise err
        return out

    op.__name__ = name
    op.__qualname__ = f"Tensor.{name}"
    op.__doc__ = f"``{name}`` of torch.Tensor, with the mesh's own TypeError kept."
    return op


_OPERATORS: Final = tuple(
    f"__{p}{n}__"
    for n in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "matmul",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
    )
    for p in ("", "r", "i")
) + ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")

for _name in _OPERATORS:
    if hasattr(torch.Tensor, _name):
        setattr(Tensor, _name, _operator(_name))


def _argument_error(text: str) -> TypeError:
    """A TypeError for a bad argument, remembered for `_operator` (see there)."""
    err = TypeError(text)
    _met.error = err
    return err


def _needs_data(what: str) -> str:
    return (
        f"{what} needs the value of a mesh tensor, which lives on the workers: bring it "
        "back with palatine.inspect(t) (or palatine.fetch_shard(t))"
    )


def wrap(value: RemoteValue, meta: Meta, storage: Storage | None = None) -> Tensor:
    """A mesh tensor over ``value`` with ``meta`` (``storage``: the alias group it views)."""
    return Tensor(value, meta, storage)


# ---------------------------------------------------------------------------- dispatch

_paths: dict[Any, tuple[FunctionPath, str]] = {}


def _path(func: Any) -> tuple[FunctionPath, str]:
    """How a command names an aten overload, and the label errors show."""
    hit = _paths.get(func)
    if hit is None:
        label = f"{func.namespace}.{func._opname}.{func._overloadname}"
        hit = _paths[func] = (FunctionPath(path=f"torch.ops.{label}"), label)
    return hit


def _meta(x: Any) -> Meta | None:
    return x._meta if isinstance(x, Tensor) else None


_SCALARS: Final = frozenset({int, float, bool, str, type(None), complex})


def _collect(x: Any, found: list[Tensor]) -> bool:
    """Add the mesh tensors in ``x`` (its tuples, lists and dict values) to ``found``;
    whether a local tensor is among them. A loop, not a generator: every op runs it."""
    t = type(x)
    if t in _SCALARS:
        return False
    if t is Tensor:
        found.append(x)
        return False
    if t is tuple or t is list:
        local = False
        for v in x:
            if _collect(v, found):
                local = True
        return local
    if t is dict:
        return _collect(list(x.values()), found)
    if isinstance(x, Tensor):
        found.append(x)
        return False
    # A local tensor is an error, except a 0-dim one on the CPU: a number that torch made
    # a tensor of (``x[0] = 5``, ``x * torch.tensor(2.0)`` made under no_mesh), which
    # travels by value as the number would.
    return isinstance(x, torch.Tensor) and not (x.dim() == 0 and x.device.type == "cpu")


def mesh_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The mesh tensors among the arguments; `TypeError` for a local tensor among them."""
    found: list[Tensor] = []
    local = _collect(args, found)
    if kwargs and _collect(list(kwargs.values()), found):
        local = True
    if local:
        raise _argument_error(LOCAL_TENSOR)
    return found


def same_mesh(a: ValueMesh, b: ValueMesh) -> bool:
    """Whether two mesh objects are the same mesh (the same ranks, laid out alike)."""
    return a is b or (
        a.session is b.session
        and slice_key(a.slice_spec) == slice_key(b.slice_spec)
        and a.names == b.names
    )


def check_tensors(tensors: list[Tensor], mesh: ValueMesh, stream: Stream) -> None:
    """The checks every op makes of its mesh tensors: alive, on ``mesh`` and ``stream``,
    not lost by a recovery."""
    records = mesh.session.recovery
    ranks: set[int] | None = None
    for t in tensors:
        v = t._value
        if v.dropped_at is not None:
            raise _argument_error(f"{DROPPED}: {t!r} was dropped at {v.dropped_at.short()}")
        if not same_mesh(v.mesh, mesh):
            raise _argument_error(f"{WRONG_MESH}: {t!r} is not on {mesh!r}")
        if t._storage.lent:
            raise _argument_error(f"{BORROWED}: {t!r}")
        if v.stream.id != stream.id:
            raise _argument_error(
                f"{WRONG_STREAM}: {t!r} belongs to stream {v.stream.name!r}, "
                f"the op runs on {stream.name!r}"
            )
        if records.lost:
            ranks = set(mesh.ranks) if ranks is None else ranks
            records.check_not_lost(t, ranks)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Issue aten overload ``func`` on mesh tensors: the caller gets its outputs as
    mesh tensors at once (`Tensor.__torch_dispatch__`)."""
    tensors = mesh_tensors(args, kwargs)
    # The first mesh tensor's mesh, as in Monarch: `x.cos()` runs where x lives, even
    # inside another mesh's activate(); the active mesh only for ops without one.
    active = get_active_mesh()
    if tensors:
        mesh = tensors[0].mesh
    elif active is not None:
        mesh = active
    else:  # (an op with no tensor argument cannot reach a tensor subclass)
        raise TypeError(f"{func} has no mesh tensor argument and no mesh is active")
    stream = active_stream(mesh)
    check_tensors(tensors, mesh, stream)
    recorder = mesh.session.recorder
    if recorder is not None and func in _LOCAL_SCALAR:
        return known_here(tensors[0], "item()").item()
    if func in _LOCAL_SCALAR and tensors[0]._known is not None:
        return tensors[0]._known.item()  # ``t.item()`` of a value the client knows
    fpath, label = _path(func)
    try:
        spec = propagate(func, args, kwargs, _meta)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise _argument_error(
            f"{label} on a mesh tensor depends on the tensor's values, which live on the "
            f"workers ({type(e).__name__}): bring them back with palatine.inspect(t), or "
            "compute it inside a remote function"
        ) from None
    if not any(t._known is not None for t in tensors) or (
        # inside a recorded call, a tensor made before it: replays change it unseen
        recorder is not None and any(t._value.ref < recorder.start_ref for t in tensors)
    ):
        return issue(fpath, label, args, kwargs, mesh, stream, spec, tensors)
    # Known inputs (`palatine.tensor.client.known`): the op runs on them here too, after
    # it was issued; what it writes is known again if it could, forgotten otherwise.
    written = [m for i in spec.mutated for m in inputs_group(tensors[i])]
    before = [(m, m._known) for m in written]
    out = issue(fpath, label, args, kwargs, mesh, stream, spec, tensors)
    if any(k is None for _, k in before):
        return out  # a partly known group stays forgotten (`issue` forgot it)
    for m, k in before:
        m._known = k
    local = known.op_value(func, args, kwargs, tensors, _known_of)
    pairs = None if local is known.UNKNOWN else known.results_known(out, local)
    if pairs is None:
        known.forget(written)
        return out
    for o, v in pairs:
        if o._known is None or o._known is not v:
            o._known = v
    return out


_LOCAL_SCALAR: Final = frozenset(
    {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
)


def known_here(t: Tensor, what: str) -> torch.Tensor:
    """The value of ``t`` the client knows, for ``what`` (``item()``, ``bool()``); a
    `TypeError` when it does not. Inside a recorded call (`palatine.compile`), only a
    value the call itself made: anything older may differ when the call is replayed,
    and a replay cannot ask again."""
    recorder = t._value.session.recorder
    if recorder is not None and (t._known is None or t._value.ref < recorder.start_ref):
        raise CoalescingError(
            f"{what} of {t!r} inside a compiled function: the value lives on the workers "
            "and a replay would reuse the answer of the recorded call (an optimizer that "
            "reads its step count this way cannot be compiled; keep such reads outside, "
            "or keep the value on the workers)"
        )
    if t._known is None:
        raise TypeError(_needs_data(what))
    return t._known


def _barrier(t: Tensor) -> tuple[int, int]:
    """A no-op on ``t``'s stream and ranks, waited for (at most `Config.rpc_timeout_s`):
    once it returns, every op issued before it has run on that stream, so an actor in
    the same proc reads ``t`` as the program left it. Its stream id and seq."""
    v = t._value
    sid = v.stream.id
    session = v.session
    spec = v.mesh.slice_spec
    whole = Slice(offset=0, sizes=[session.world_size], strides=[1])
    done: Future[Any] = Future(session.loop)

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [
            (spec, CallFunction(seq=seq, results=[], function=_READY, args=_NO_ARGS, stream=sid)),
            (whole, RequestStatus(seq=seq, controller=False)),  # its completion comes back
        ]

    seq = session.issue(
        "barrier for an actor call", [], [v.ref], [], future=done, make_commands=commands
    )
    done.result(timeout=config.get().rpc_timeout_s)
    return sid, seq


_READY: Final = FunctionPath(path="palatine.tensor.worker.functions.ready")
_NO_ARGS: Final = dumps_args((), {})


def _known_of(t: Tensor) -> torch.Tensor | None:
    return t._known


def inputs_group(t: Tensor) -> list[Tensor]:
    """The live members of ``t``'s alias group (``t`` among them)."""
    return list(t._storage.members)


def issue(
    fpath: FunctionRef,
    label: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: ValueMesh,
    stream: Stream,
    spec: OpSpec,
    inputs: list[Tensor],
    flatten: bool = False,
) -> Any:
    """Send one op or remote call whose outputs ``spec`` describes (``inputs``: the mesh
    tensors among its arguments, in argument order, which ``spec`` indexes); the caller
    gets its return value with mesh tensors at once. ``flatten``: the worker binds the
    tensor leaves of whatever structure the function returns (a remote function's
    pytree) rather than the return value itself (an op's tensor or tuple)."""
    session = mesh.session
    session.check_usable()
    site = capture_site()
    mutated: list[int] = []
    for i in spec.mutated:
        t = inputs[i]
        st = t._storage
        if st.read_only or st.borrowed:
            raise _argument_error(f"{MUTATING_BORROW}: {label} would write {t!r}")
    for i in spec.mutated:
        members = list(inputs[i]._storage.members)
        known.forget(members)  # `dispatch` mirrors the write where it can
        for m in members:
            mutated.append(m._value.ref)
    if flatten:  # a remote function's arguments may hold any handle: the general path
        pickled, uses = pickle_args((args, kwargs), _no_check)
    else:
        pickled, uses = pickle_op(args, kwargs, inputs)
    new_ref = session.ids.new_ref
    outs = spec.outs
    results: list[int | None] = [None if o.written else new_ref() for o in outs]
    spec_slice = mesh.slice_spec
    sid = stream.id

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [
            (
                spec_slice,
                CallFunction(
                    seq=seq,
                    results=results,
                    mutates=mutated,
                    function=fpath,
                    args=pickled,
                    stream=sid,
                    flatten=flatten,
                ),
            )
        ]

    defs = [r for r in results if r is not None]
    seq = session.issue(label, defs + mutated, uses, [], site=site, make_commands=commands)
    made: list[Any] = []
    for o, r in zip(outs, results, strict=True):
        if r is None:
            assert o.alias is not None
            made.append(inputs[o.alias])
            continue
        value = RemoteValue(session, r, mesh, stream, seq, label)
        storage = inputs[o.alias]._storage if o.alias is not None else None
        made.append(Tensor(value, o.meta, storage))
    return spec.rebuild(made)


def _no_check(handle: Any) -> None:
    """Handles other than mesh tensors in an op's arguments are not checked further."""


def _ref_id(obj: Any) -> Any:
    """The persistent id of a mesh tensor in an op's arguments (``("ref", n)``)."""
    return (REF_TAG, obj._value.ref) if type(obj) is Tensor else None


def pickle_op(
    args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[Tensor]
) -> tuple[Pickled, list[int]]:
    """The one pickle of an op's ``(args, kwargs)`` and the refs it uses. An op's
    arguments are mesh tensors (checked already) and plain values: the C pickler with a
    plain persistent-id function does, at a fraction of the general path's cost
    (`pickle_args`), which takes anything else (a remote value, a function by value)."""
    if all(type(t) is Tensor for t in inputs):  # (a subclass goes the general way)
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=5)
        p.persistent_id = _ref_id  # type: ignore[method-assign]
        try:
            p.dump((args, kwargs))
            return Pickled(buf.getvalue()), [t._value.ref for t in inputs]
        except (pickle.PicklingError, TypeError, AttributeError):
            pass
    return pickle_args((args, kwargs), _no_check)


def reduced_meta(meta: Meta, group: int, reduction: str, scatter: bool) -> Meta:
    """The metadata of a reduction over a group of ``group`` members, as Monarch's: an
    all-reduce keeps the shape; ``stack`` adds a leading dim of the group's size;
    ``scatter`` (reduce-scatter) needs dim 0 of the group's size and drops it (member
    r keeps row r of the reduction); ``stack`` with ``scatter`` (all-to-all) keeps it."""
    shape = meta.shape
    if reduction == "stack":
        shape = shape if scatter else (group, *shape)
    elif scatter:
        if not shape or shape[0] != group:
            raise _argument_error(
                f"When scattering results the outer most dimension of tensor with sizes "
                f"({list(shape)}) must match the size ({group}) of the reduced group"
            )
        shape = shape[1:]
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    dtype = meta.dtype
    if reduction == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise _argument_error(f"reduce 'avg' of a {dtype} tensor: use a floating point dtype")
    return Meta(shape, stride, dtype, meta.device, False)


def reduce_tensor(
    t: Tensor,
    dims: str | tuple[str, ...],
    reduction: str,
    scatter: bool,
    in_place: bool,
    out: Tensor | None,
) -> Tensor:
    """`Tensor.reduce` / `reduce_`: the collective on its value, wrapped again.

    Checked here, before anything is sent (Monarch lets some of these through to fail
    on the workers): the dims (``()``: all of the mesh's), the reduction, one dim only
    for ``stack`` or ``scatter``, no ``out`` or shape change in place, ``out``'s shape."""
    v = t._value
    mesh = v.mesh
    names = [dims] if isinstance(dims, str) else list(dims)
    if not names:
        names = list(mesh.names)
    if len(set(names)) != len(names):
        raise ValueError(f"reducing the same dimension twice: {names}")
    if reduction not in REDUCE_OPS:
        raise ValueError(f"reduction {reduction!r} not supported, reductions are {REDUCE_OPS}")
    if len(names) > 1 and (reduction == "stack" or scatter):
        raise ValueError(
            f"reduction {reduction} or scatter = {scatter} is not valid for multiple dimensions"
        )
    group = 1
    for d in names:
        group *= mesh.sizes[mesh._dim(d)]
    if in_place:
        if out is not None:
            raise ValueError("`out` cannot be used with inplace reduce.")
        if scatter or reduction == "stack":
            raise ValueError(
                f"reduction {reduction} (scatter={scatter}) is not valid for an in-place "
                "operation because the output size will not match the input size."
            )
    meta = reduced_meta(t._meta, group, reduction, scatter)
    if out is not None and out._meta.shape != meta.shape:
        raise ValueError(
            f"The given output shape, {list(out._meta.shape)}, is incorrect. Reduce expects "
            f"the shape to be {list(meta.shape)}."
        )
    check_tensors([t] + ([out] if out is not None else []), mesh, active_stream(mesh))
    like = (list(t._meta.shape), t._meta.dtype)
    squeeze = scatter and reduction != "stack"  # the workers keep dim 0, of size 1
    value = reduce(
        v,
        tuple(names),
        reduction,
        scatter,
        in_place,
        out._value if out is not None and not squeeze else None,
        like,
    )
    if in_place:
        known.forget(t._storage.members)
        return t
    if squeeze:
        kept = Meta(
            (1, *meta.shape), (math.prod(meta.shape), *meta.stride), meta.dtype, meta.device
        )
        result = cast(Tensor, Tensor(value, kept).squeeze(0))
        if out is not None:
            out.copy_(result)
            return out
        return result
    if out is not None:
        return out
    return Tensor(value, meta)


def slice_tensor(t: Tensor, **coords: int | slice) -> Tensor:
    """``t`` as the ranks of ``t.mesh.slice(**coords)`` hold it: a mesh tensor of that
    sub-mesh, sharing ``t``'s worker-side tensor (writes to one are writes to both)."""
    v = t._value
    if v.dropped_at is not None:
        raise TypeError(f"{t!r} was dropped at {v.dropped_at.short()}")
    sub = v.mesh.slice(**coords)
    part = Tensor(SlicedValue(v, cast(ValueMesh, sub)), t._meta, t._storage)
    part._known = t._known  # the same storage: a write through either is seen by both
    return part


def move_tensor(t: Tensor, mesh: Any, stream: Stream | None = None) -> Tensor:
    """``t`` copied to ``mesh`` (of the same sizes: the rank at index i of ``t``'s mesh
    sends its shard to the rank at index i of ``mesh``), on ``stream`` (default: ``t``'s).
    A new tensor, contiguous. When ``t`` requires grad (and grad mode is on), the copy is
    part of the graph: its gradient moves back to ``t``'s mesh in the backward, so a
    pipeline's stages on two meshes train as one program."""
    if t.requires_grad and torch.is_grad_enabled():
        return cast(Tensor, _MoveToMesh.apply(t, mesh, stream))  # type: ignore[no-untyped-call]
    return _move(t, mesh, stream)


class _MoveToMesh(torch.autograd.Function):
    """`move_tensor` in autograd: forward moves the tensor, backward moves its gradient
    back to the source mesh and stream."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, mesh: Any, stream: Stream | None) -> Tensor:
        ctx.source = (t.mesh, t.stream)
        return _move(t, mesh, stream)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        mesh, stream = ctx.source
        return _move(grad, mesh, stream), None, None


def _move(t: Tensor, mesh: Any, stream: Stream | None) -> Tensor:
    mesh = getattr(mesh, "_device_mesh", mesh)
    m = t._meta
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"to_mesh(): stream must be a Stream, not {type(stream).__name__}")
    if stream is not None and stream.session is not mesh.session:
        stream = mesh.stream(stream.name)
    value = move(t._value, mesh, stream, (list(m.shape), m.dtype))
    stride = tuple(math.prod(m.shape[i + 1 :]) for i in range(len(m.shape)))
    return Tensor(value, Meta(m.shape, stride, m.dtype, m.device, False))


class Borrow:
    """An open borrow of a mesh tensor by another stream (``stream.borrow(t)``): its
    ``tensor`` is ``t``'s worker-side tensor, usable on that stream, which first waits
    for what ``t``'s stream did to it. Read-only (the default): neither side may be
    written until the borrow ends. ``mutable=True``: the borrowing side may write it,
    and ``t`` may not be used at all until the borrow ends (`BORROWED`). End it with
    `drop` (or leave a ``with borrow:`` block); the borrowed tensor is dropped then."""

    def __init__(self, origin: Tensor, stream: Stream, mutable: bool) -> None:
        st = origin._storage
        if st.lent:
            raise RuntimeError(f"{origin!r} is already lent to another stream mutably")
        if mutable and st.borrowed:
            raise RuntimeError(
                "Cannot borrow this tensor mutably because it (or a view) is already being "
                "borrowed non-mutably."
            )
        v = origin._value
        if v.dropped_at is not None:
            raise TypeError(f"{DROPPED}: {origin!r} was dropped at {v.dropped_at.short()}")
        bound = stream if stream.session is v.session else v.mesh.stream(stream.name)
        self.origin = origin
        self.mutable = mutable
        self.tensor = Tensor(v.to_stream(bound), origin._meta, Storage(read_only=not mutable))
        if mutable:
            st.lent = True
            known.forget(st.members)
        else:
            st.borrowed += 1
        self._open = True

    def drop(self) -> None:
        """End the borrow (once): the borrowed tensor is dropped, the origin usable."""
        if not self._open:
            return
        self._open = False
        st = self.origin._storage
        if self.mutable:
            st.lent = False
        else:
            st.borrowed -= 1
        self.tensor.drop()

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.drop()

    def __iter__(self) -> Iterator[Any]:
        """``t2, borrow = stream.borrow(t)``, as in Monarch."""
        return iter((self.tensor, self))

    def __del__(self) -> None:
        if getattr(self, "_open", False):
            try:
                self.drop()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass
