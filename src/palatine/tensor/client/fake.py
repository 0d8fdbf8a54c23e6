"""Fake propagation: what an op on mesh tensors returns, learned on the client.

A mesh tensor's data lives on the workers; the client knows only its metadata
(`Meta`: shape, strides, dtype, device, ``requires_grad``). Before an op is sent, the
client must know the metadata of what it returns, so that it can hand the caller
tensors at once. It learns it by running the op on *fake* tensors (torch's
``FakeTensorMode``: tensors with metadata and no data, on the right device), then keeps
the answer in a cache keyed by the op and its inputs' metadata, so a loop of the same ops
(the common case) runs the fake op once.

Sans-IO: nothing here sends anything. What an answer says (`OpSpec`) is, per output of
the op, either fresh metadata or "this is input tensor *i*, written in place" (the
schema's ``Tensor(a!)``) or "a view of input tensor *i*" (``Tensor(a)``), which the
tensor module turns into mutations and alias groups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

__all__ = [
    "CACHE_LIMIT",
    "Meta",
    "OpSpec",
    "Out",
    "meta_of",
    "fake_call",
    "fake_like",
    "op_key",
    "propagate",
    "spec_of",
]

CACHE_LIMIT: Final = 8192
"""Cached answers kept at most (the cache is cleared when it grows past this)."""


class Meta:
    """What the client knows of a mesh tensor: everything but its data."""

    __slots__ = ("shape", "stride", "dtype", "device", "requires_grad")

    def __init__(
        self,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: bool = False,
    ) -> None:
        self.shape = shape
        self.stride = stride
        self.dtype = dtype
        self.device = device
        self.requires_grad = requires_grad

    def key(self) -> tuple[Any, ...]:
        return (self.shape, self.stride, self.dtype, self.device, self.requires_grad)

    def __repr__(self) -> str:
        return f"Meta({list(self.shape)}, {self.dtype}, {self.device})"


def meta_of(t: torch.Tensor) -> Meta:
    """The metadata of a (fake or real) tensor."""
    return Meta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)


class Out:
    """One tensor output of an op: fresh (``meta``), or aliasing input tensor ``alias``
    (``written``: the op writes it in place, so the output *is* that input)."""

    __slots__ = ("meta", "alias", "written")

    def __init__(self, meta: Meta, alias: int | None = None, written: bool = False) -> None:
        self.meta = meta
        self.alias = alias
        self.written = written


class OpSpec:
    """What an op returns: ``outs`` (its tensor outputs, in order) and ``rebuild``, which
    turns a list of tensors (one per ``out``) into the op's return value (a tensor, a
    tuple or list of them, or a structure with non-tensor leaves); ``mutated``: the
    input tensors (by index) the op writes in place, returned or not."""

    __slots__ = ("outs", "rebuild", "mutated")

    def __init__(
        self, outs: list[Out], rebuild: Callable[[list[Any]], Any], mutated: list[int]
    ) -> None:
        self.outs = outs
        self.rebuild = rebuild
        self.mutated = mutated


# ---------------------------------------------------------------------------- keys


class _Unhashable(Exception):
    """An argument the cache cannot key on (a list of data, an object): no caching."""


_SCALARS: Final = frozenset({int, float, bool, str, complex, type(None)})
_ATOMS: Final = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(x: Any, meta: Callable[[Any], Meta | None]) -> Any:
    t = type(x)
    if t in _SCALARS:
        return (t, x)  # 1, 1.0 and True promote differently: the type is part of the key
    m = meta(x)
    if m is not None:
        return m.key()
    if t is tuple or t is list:
        return (t, tuple(_key(v, meta) for v in x))
    if isinstance(x, _ATOMS) or t is type:
        return x
    if isinstance(x, torch.Tensor):  # a 0-dim local tensor: its value cannot matter
        return ("local", x.dtype, tuple(x.shape))
    if t is dict:
        return (dict, tuple((k, _key(v, meta)) for k, v in x.items()))
    raise _Unhashable


_NUMBERS: Final = frozenset({int, float, bool, complex})
_BY_TYPE: Final = frozenset({"Tensor", "Scalar", "Tensor?", "Scalar?"})

# op -> (positions, keyword names) of the arguments whose Python numbers count by type
_numbers_by_type: dict[Any, tuple[frozenset[int], frozenset[str]]] = {}


def _by_type(func: Any) -> tuple[frozenset[int], frozenset[str]]:
    """Where an aten op takes a number as a ``Tensor`` or ``Scalar``: the number's value
    cannot change the result's metadata there (its type can: promotion), so the cache
    keys it by type, and ``x + i`` in a loop is learned once. Numbers elsewhere (sizes,
    dims, indices) are keyed by value."""
    hit = _numbers_by_type.get(func)
    if hit is None:
        schema = getattr(func, "_schema", None)
        pos: set[int] = set()
        names: set[str] = set()
        if schema is not None:
            for i, a in enumerate(schema.arguments):
                if str(a.type) in _BY_TYPE:
                    names.add(a.name)
                    if not a.kwarg_only:
                        pos.add(i)
        hit = _numbers_by_type[func] = (frozenset(pos), frozenset(names))
    return hit


def op_key(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], meta: Callable[[Any], Meta | None]
) -> Any:
    """The cache key of ``func`` on these arguments (mesh tensors by their metadata,
    through ``meta``; numbers by type where the op takes them as tensors or scalars), or
    None when an argument cannot be keyed."""
    try:
        pos, names = _by_type(func)
        if pos:
            args = tuple(
                type(a) if i in pos and type(a) in _NUMBERS else a for i, a in enumerate(args)
            )
        if kwargs and names:
            kwargs = {
                k: type(v) if k in names and type(v) in _NUMBERS else v for k, v in kwargs.items()
            }
        return (func, _key(args, meta), _key(kwargs, meta) if kwargs else None)
    except _Unhashable:
        return None


# ---------------------------------------------------------------------------- fake runs

# FakeTensorMode instances are not thread-safe; one per thread that propagates.
_local = threading.local()


class _Quiet(logging.Filter):
    """Drops the traceback torch's fake tensors log when an op fails on fakes during a
    propagation here: the op's error is raised to the caller, who sees it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_local, "propagating", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_Quiet())


def _mode() -> FakeTensorMode:
    mode = getattr(_local, "mode", None)
    if mode is None:
        with _environment_kept():  # (its first construction imports torch._dynamo)
            mode = _local.mode = FakeTensorMode(allow_non_fake_inputs=False)
    return mode


_ENV_SET_BY_TORCH: Final = ("TORCHINDUCTOR_CACHE_DIR",)


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    """Take back what torch writes into the environment while it runs fake ops (its
    compiler's cache dir, whenever it looks it up): the program's environment is the
    program's, and the processes it starts should not inherit a setting it never made."""
    before = [os.environ.get(k) for k in _ENV_SET_BY_TORCH]
    try:
        yield
    finally:
        for k, v in zip(_ENV_SET_BY_TORCH, before, strict=True):
            if v is None:
                os.environ.pop(k, None)
            elif os.environ.get(k) != v:
                os.environ[k] = v


def _map(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``x`` with ``fn`` applied to every leaf of its tuples, lists and dicts."""
    t = type(x)
    if t is tuple or t is list:
        return t(_map(v, fn) for v in x)
    if t is dict:
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x)


def _fake(mode: FakeTensorMode, m: Meta) -> torch.Tensor:
    with _environment_kept(), torch._C.DisableTorchFunction(), mode:
        t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)
    if m.requires_grad:
        t.requires_grad_(True)
    return t


def _run_fake(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    meta: Callable[[Any], Meta | None],
) -> tuple[Any, list[torch.Tensor], list[int]]:
    """Run ``func`` on fakes of the mesh tensors in the arguments: its fake result, the
    fakes given for the inputs (in argument order), and the inputs it wrote in place
    (their version counters moved)."""
    mode = _mode()
    inputs: list[torch.Tensor] = []

    def fake(x: Any) -> Any:
        m = meta(x)
        if m is None:
            if isinstance(x, torch.Tensor):  # a 0-dim local tensor: a number, as a value
                with _environment_kept():
                    return mode.from_tensor(x)
            return x
        f = _fake(mode, m)
        inputs.append(f)
        return f

    fargs = _map(args, fake)
    fkwargs = _map(kwargs, fake)
    versions = [t._version for t in inputs]
    _local.propagating = True
    try:
        # No torch-function mode: a shape function's torch.zeros must make a fake here,
        # not a mesh tensor (an active mesh's factories are a torch-function mode).
        with _environment_kept(), torch._C.DisableTorchFunction(), mode:
            out = func(*fargs, **fkwargs)
    finally:
        _local.propagating = False
    schema = getattr(func, "_schema", None)
    if schema is not None:
        # An aten op says what it writes (``Tensor(a!)``); version counters would not
        # tell inside __torch_dispatch__, below the key that bumps them.
        ids = {id(t) for t in _written_by_schema(schema, fargs, fkwargs)}
        written = [i for i, t in enumerate(inputs) if id(t) in ids]
    else:
        written = [i for i, t in enumerate(inputs) if t._version != versions[i]]
    return out, inputs, written


def _written_by_schema(schema: Any, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The argument values an op's schema marks as written in place."""
    out: list[Any] = []
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        out.extend(v if isinstance(v, list | tuple) else [v])
    return out


def spec_of(out: Any, inputs: list[torch.Tensor], written: list[int]) -> OpSpec:
    """The `OpSpec` of a fake result: each tensor leaf, and which input it is (a written
    input returned: the op's in-place or ``out=`` result) or views (any other output
    sharing an input's storage, the input itself returned unwritten included)."""
    outs: list[Out] = []
    by_id = {id(t): i for i, t in enumerate(inputs)}
    storages: dict[Any, int] = {}
    for i, t in enumerate(inputs):
        storages.setdefault(t.untyped_storage()._cdata, i)

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        i = by_id.get(id(x))
        if i is not None and i in written:  # the op returned its input (in place, out=)
            outs.append(Out(meta_of(x), i, written=True))
        else:
            base = storages.get(x.untyped_storage()._cdata)
            outs.append(Out(meta_of(x), base, written=False))
        return _Slot(len(outs) - 1)

    shape = tree_map(leaf, out)
    if isinstance(shape, _Slot):
        return OpSpec(outs, _first, written)

    def rebuild(ts: list[Any]) -> Any:
        return tree_map(lambda s: ts[s.index] if isinstance(s, _Slot) else s, shape)

    return OpSpec(outs, rebuild, written)


def _first(ts: list[Any]) -> Any:
    return ts[0]


class _Slot:
    """Where the *index*-th tensor output sits in an op's return structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_cache: dict[Any, OpSpec] = {}


def propagate(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    meta: Callable[[Any], Meta | None],
) -> OpSpec:
    """What ``func(*args, **kwargs)`` returns, mesh tensors given by ``meta``: cached by
    the op and its inputs' metadata. Raises what the op raises on fake tensors (a shape
    mismatch, a bad dtype) before anything is sent."""
    key = op_key(func, args, kwargs, meta)
    if key is not None:
        hit = _cache.get(key)
        if hit is not None:
            return hit
    out, inputs, written = _run_fake(func, args, kwargs, meta)
    spec = spec_of(out, inputs, written)
    if key is not None:
        if len(_cache) >= CACHE_LIMIT:
            _cache.clear()
        _cache[key] = spec
    return spec


def fake_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    meta: Callable[[Any], Meta | None],
) -> OpSpec:
    """Run a shape function ``fn`` (``remote(f, propagate=fn)``) on fakes of the mesh
    tensors in its arguments: the `OpSpec` of what it returns (never cached: a user's
    function may depend on more than its arguments' metadata)."""
    out, inputs, written = _run_fake(fn, args, kwargs, meta)
    return spec_of(out, inputs, written)


def fake_like(m: Meta) -> torch.Tensor:
    """A fake tensor with metadata ``m`` (to build a shape function's answer)."""
    return _fake(_mode(), m)
