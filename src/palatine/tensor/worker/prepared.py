"""Prepared calls: a recorded aten op with its arguments unpickled once.

A recording (`DefineRecording`) is run again and again with the same commands; an op's
pickled ``(args, kwargs)`` differ between runs only in the values their refs name. So the
worker unpickles them once, with a marker in place of each ref, and keeps a filler that
rebuilds them from the stream's refs table on each run: a few attribute loads instead of
an unpickler per op. Only aten ops (``torch.ops.*`` paths, not flattened) are prepared:
their arguments are tensors, numbers, dtypes and sequences of them, which no call
mutates; user functions still get freshly unpickled arguments every time.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from palatine.protocol.worker import CallFunction, FunctionPath
from palatine.tensor.worker.values import load_args

__all__ = ["PreparedCall", "prepare"]

#: Rebuilds one argument from a ref lookup (None: the argument is a constant).
Filler = Callable[[Callable[[int], Any]], Any]


class _Slot:
    """Where a ref stood in the unpickled arguments."""

    __slots__ = ("ref",)

    def __init__(self, ref: int) -> None:
        self.ref = ref


class PreparedCall:
    """One recorded op: its command (whose ``seq`` the stream sets per run), the
    resolved function and label, and the fillers of its arguments."""

    __slots__ = ("cmd", "fn", "label", "args", "kwargs", "seq")

    def __init__(
        self, cmd: CallFunction, fn: Any, label: str, args: Filler, kwargs: Filler
    ) -> None:
        self.cmd = cmd
        self.fn = fn
        self.label = label
        self.args = args
        self.kwargs = kwargs
        self.seq = cmd.seq


def prepare(cmd: CallFunction, resolve: Callable[[Any], Any]) -> PreparedCall | None:
    """``cmd`` prepared, or None when it is not an aten op or its arguments are not
    plain enough (it then runs as any call does)."""
    fref = cmd.function
    if type(fref) is not FunctionPath or not fref.path.startswith("torch.ops.") or cmd.flatten:
        return None
    try:
        rf = resolve(fref)
        args, kwargs = load_args(cmd.args, _Slot)
        fill_args = _filler(args)
        fill_kwargs = _filler(kwargs)
    except (
        pickle.UnpicklingError,
        TypeError,
        ValueError,
        LookupError,
        ImportError,
        AttributeError,
    ):
        return None
    if fill_args is None:
        fill_args = _const(tuple(args))
    if fill_kwargs is None:
        fill_kwargs = _const(kwargs)
    return PreparedCall(cmd, rf.fn, rf.label, fill_args, fill_kwargs)


def _const(value: Any) -> Filler:
    return lambda lookup: value


def _filler(obj: Any) -> Filler | None:
    """How to rebuild ``obj`` with its refs looked up; None when it holds none."""
    if type(obj) is _Slot:
        ref = obj.ref
        return lambda lookup: lookup(ref)
    if type(obj) is tuple or type(obj) is list:
        parts = [_filler(x) for x in obj]
        if all(p is None for p in parts):
            return None
        kind = type(obj)
        fills = [p if p is not None else _const(x) for p, x in zip(parts, obj, strict=True)]
        return lambda lookup: kind([f(lookup) for f in fills])
    if type(obj) is dict:
        items = {k: _filler(v) for k, v in obj.items()}
        if all(p is None for p in items.values()):
            return None
        fills_d = {k: (p if p is not None else _const(obj[k])) for k, p in items.items()}
        return lambda lookup: {k: f(lookup) for k, f in fills_d.items()}
    return None
