"""`remote_autograd_function`: a user's ``torch.autograd.Function`` run on the workers,
inside the client's autograd.

``RemoteMyFn = remote_autograd_function(MyFn)`` (or ``@remote_autograd_function`` on the
class) is a ``torch.autograd.Function`` of the client. ``RemoteMyFn.apply(x, w)`` on mesh
tensors issues ``MyFn`` itself on every rank of their mesh
(`palatine.tensor.worker.autograd_function.forward`) and returns mesh tensors at once,
linked into the client's autograd graph; ``loss.backward()`` on the client then issues
``MyFn.backward`` on the workers with the ``ctx`` that rank's forward filled. That ctx
stays on the workers: the forward call also returns an `OpaqueRef` of the recorded
graph, which the client saves for backward (as its key, a saved tensor), so torch frees
it after the backward (or with the graph, when no backward comes) and the workers free
the graph then.

How the client learns the forward's outputs (``propagate=``): ``"mocked"`` (the default)
runs ``MyFn.apply`` on fake tensors here (plain torch code is its own shape function); a
callable is a shape function taking the Function's arguments; ``"inspect"`` and
``"cached"`` run it for real on the mesh's first rank, as for `palatine.remote`. The
gradients need nothing: each has its input's shape, strides and dtype. On local tensors
(no mesh tensor among the arguments) ``apply`` is ``MyFn.apply`` itself.

Not supported: a Function that writes an input in place (``mark_dirty``), and a
backward of the backward (``create_graph=True``).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from palatine.tensor.client.propagation import PROPAGATORS, TensorFunction
from palatine.tensor.client.tensor import Tensor
from palatine.tensor.worker import autograd_function as halves
from palatine.tensor.worker.opaque import OpaqueRef

__all__ = ["RemoteAutogradFunction", "remote_autograd_function"]

log = logging.getLogger(__name__)


class RemoteAutogradFunction(torch.autograd.Function):
    """The base of every `remote_autograd_function` class: its forward and backward
    issue the user's Function (``target``) on the workers (see the module)."""

    target: ClassVar[type[torch.autograd.Function]]
    """The user's Function, run on the workers."""

    propagate: ClassVar[Any] = "mocked"
    """How the client learns the forward's outputs (see the module)."""

    _calls: ClassVar[tuple[TensorFunction, TensorFunction] | None] = None

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, Tensor) for a in (*args, *kwargs.values())):
            return cls.target.apply(*args, **kwargs)  # type: ignore[no-untyped-call]
        return super().apply(*args, **kwargs)  # type: ignore[no-untyped-call]

    @classmethod
    def _remote(cls) -> tuple[TensorFunction, TensorFunction]:
        """The forward and backward remote functions (made on first use)."""
        calls = cls.__dict__.get("_calls")  # (each class its own: not a parent's)
        if calls is None:
            target, p = cls.target, cls.propagate
            if p == "mocked":
                shape: Any = _Mocked(target)
            elif callable(p):
                shape = _Shaped(p)
            else:
                shape = p
            calls = cls._calls = (
                TensorFunction(halves.Bound(halves.forward, target, "forward"), shape),
                TensorFunction(halves.Bound(halves.backward, target, "backward"), _grads_like),
            )
        return calls

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        fwd, _ = ctx._forward_cls._remote()
        needs = tuple(ctx.needs_input_grad)
        recorded, out = fwd(needs, *args)
        ctx.save_for_backward(recorded.key)  # released after the backward: frees the graph
        ctx.likes = tuple(
            (tuple(a.shape), tuple(a.stride()), a.dtype, a.device) if need else None
            for a, need in zip(args, needs, strict=True)
        )
        # An output that gets no gradient stays None (torch would make a zero tensor of
        # its own, not a mesh tensor); the workers' graph fills its own zeros.
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if all(g is None for g in grads):
            return (None,) * len(ctx.likes)
        _, bwd = ctx._forward_cls._remote()
        (key,) = ctx.saved_tensors
        return bwd(ctx.likes, OpaqueRef.of_key(key), *grads)


class _Mocked:
    """The forward's shape function for ``propagate="mocked"``: the Function itself on
    the fake inputs (without autograd), and a placeholder for the recorded graph."""

    def __init__(self, target: type[torch.autograd.Function]) -> None:
        self.target = target

    def __call__(self, needs: tuple[bool, ...], *args: Any) -> tuple[OpaqueRef, Any]:
        with torch.no_grad():
            return OpaqueRef(), self.target.apply(*args)  # type: ignore[no-untyped-call]


class _Shaped:
    """The forward's shape function for a user's one (which takes the Function's
    arguments)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, needs: tuple[bool, ...], *args: Any) -> tuple[OpaqueRef, Any]:
        return OpaqueRef(), self.fn(*args)


def _grads_like(likes: tuple[Any, ...], recorded: OpaqueRef, *grads: Any) -> tuple[Any, ...]:
    """The backward's shape function: one gradient like each input that needs one."""
    return tuple(
        None
        if like is None
        else torch.empty_strided(like[0], like[1], dtype=like[2], device=like[3])
        for like in likes
    )


def remote_autograd_function(
    target: type[torch.autograd.Function] | None = None,
    name: str | None = None,
    *,
    propagate: Any = "mocked",
) -> Any:
    """A ``torch.autograd.Function`` class whose ``apply`` runs ``target`` on the
    workers of its mesh-tensor arguments, forward and backward (see the module); named
    ``name`` (default ``Remote_<target name>``). Also a decorator: ``@remote_autograd_function``
    or ``@remote_autograd_function(propagate=...)``. A class that already is one is
    returned as it is, with a warning."""
    if target is None:
        return lambda t: remote_autograd_function(t, name, propagate=propagate)
    if isinstance(target, type) and issubclass(target, RemoteAutogradFunction):
        log.warning("%s already runs on the workers: returned as it is", target.__qualname__)
        return target
    if not (isinstance(target, type) and issubclass(target, torch.autograd.Function)):
        raise TypeError(
            f"remote_autograd_function takes a torch.autograd.Function subclass, not {target!r}"
        )
    if not callable(propagate) and propagate not in PROPAGATORS:
        raise ValueError(f"propagate must be a callable or one of {PROPAGATORS}, not {propagate!r}")
    return type(
        name or f"Remote_{target.__name__}",
        (RemoteAutogradFunction,),
        {
            "target": target,
            "propagate": propagate,
            "__module__": target.__module__,
            "__doc__": target.__doc__,
        },
    )
