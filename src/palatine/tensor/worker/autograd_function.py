"""The worker's halves of a remote autograd function (`palatine.remote_autograd_function`).

The client's autograd runs a ``torch.autograd.Function`` of its own whose forward and
backward issue these two as remote functions:

* `forward` runs the user's Function for real, ``target.apply(*args)``, with autograd
  on: each input whose gradient the client needs becomes a fresh leaf that requires
  grad, so the worker's autograd records the graph (the Function's ``ctx``, its saved
  tensors and attributes included). It returns the outputs, detached (worker tensors
  carry no autograd state), and an `OpaqueRef` holding the `Recorded` graph: the
  client keeps that handle until its own backward ran, then drops it, which frees the
  graph here.
* `backward` takes that handle and the output gradients and runs the graph's backward
  (``torch.autograd.grad``): the user's ``backward`` runs with the ``ctx`` its forward
  filled, and torch checks each gradient against its input as it would locally.

Running the Function itself (rather than its two methods on a stand-in ``ctx``) gives
every ``ctx`` feature its local meaning: ``save_for_backward`` and ``saved_tensors``,
``needs_input_grad``, ``set_materialize_grads``, ``mark_non_differentiable``, and the
``setup_context`` style.
"""

from __future__ import annotations

from typing import Any

from palatine.tensor.worker.opaque import OpaqueRef

__all__ = ["Bound", "Recorded", "backward", "forward"]


class Bound:
    """``impl(target, *args)`` as one remote function: a half of the worker side bound
    to the user's Function, and named after it (``MyFn.forward``) in errors. It is
    pickled once per remote function (the Function class by reference where workers
    can import it, else by value)."""

    def __init__(self, impl: Any, target: type, part: str) -> None:
        self.impl = impl
        self.target = target
        self.__qualname__ = f"{target.__qualname__}.{part}"
        self.__module__ = target.__module__

    def __call__(self, *args: Any) -> Any:
        return self.impl(self.target, *args)


class Recorded:
    """What a forward on a worker keeps for its backward: the leaves standing for the
    inputs (None where no gradient is needed), the gradient edges of the outputs (not
    the outputs themselves, so the graph keeps only what the Function saved; None for an
    output without a gradient), and the storages the client already has tensors of."""

    __slots__ = ("leaves", "edges", "storages")

    def __init__(self, leaves: list[Any], edges: list[Any], storages: set[int]) -> None:
        self.leaves = leaves
        self.edges = edges
        self.storages = storages


def _storage(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


def forward(target: Any, needs: tuple[bool, ...], *args: Any) -> tuple[OpaqueRef, Any]:
    """Run ``target.apply(*args)`` recording its graph for the inputs ``needs`` marks;
    return (an `OpaqueRef` of the `Recorded` graph, the outputs detached)."""
    import torch
    from torch.autograd.graph import get_gradient_edge

    call = list(args)
    leaves: list[Any] = [None] * len(call)
    for i, need in enumerate(needs):
        if need:
            leaves[i] = call[i] = call[i].detach().requires_grad_()
    with torch.enable_grad() if any(needs) else torch.no_grad():
        out = target.apply(*call)
    outs = out if type(out) is tuple else (out,)
    edges = [
        get_gradient_edge(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
        for o in outs
    ]
    plain = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
    storages = {_storage(t) for t in (*args, *plain) if isinstance(t, torch.Tensor)}
    recorded = OpaqueRef(Recorded(leaves, edges, storages))
    return recorded, (plain if type(out) is tuple else plain[0])


def backward(target: Any, likes: tuple[Any, ...], recorded: OpaqueRef, *grads: Any) -> Any:
    """The gradients of the forward's inputs, one per input (None where ``likes`` is
    None): the recorded graph's backward from ``grads`` (None for an output without
    one). Each gradient has exactly the shape, strides and dtype of its input as the
    client knows it (``likes``: ``(shape, stride, dtype, device)``), zeros where the Function
    gave none, and a storage of its own: the client takes it for a new tensor."""
    import torch

    rec: Recorded = recorded.value
    pairs = [
        (e, g) for e, g in zip(rec.edges, grads, strict=True) if e is not None and g is not None
    ]
    wanted = [leaf for leaf in rec.leaves if leaf is not None]
    found: list[Any] = [None] * len(wanted)
    if pairs and wanted:
        found = list(
            torch.autograd.grad(
                [e for e, _ in pairs],
                wanted,
                [g for _, g in pairs],
                retain_graph=True,  # freed with the record, when the client's graph goes
                allow_unused=True,
            )
        )
    taken = rec.storages | {_storage(g) for g in grads if isinstance(g, torch.Tensor)}
    given = iter(found)
    out: list[Any] = []
    for leaf, like in zip(rec.leaves, likes, strict=True):
        out.append(None if leaf is None else _own(next(given), leaf, like, taken))
    return tuple(out)


def _own(g: Any, leaf: Any, like: tuple[Any, ...], taken: set[int]) -> Any:
    """``g`` as the client expects it (`backward`); ``taken``: storages already named."""
    import torch

    shape, stride, dtype, _ = like
    if g is None:
        return torch.empty_strided(shape, stride, dtype=dtype, device=leaf.device).zero_()
    p = _storage(g)
    if tuple(g.stride()) != tuple(stride) or (p and p in taken):
        g = torch.empty_strided(shape, stride, dtype=dtype, device=g.device).copy_(g)
        p = _storage(g)
    taken.add(p)
    return g
