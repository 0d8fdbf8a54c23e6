"""Values the client knows: small mesh tensors that every rank holds alike, mirrored here.

A program reads some mesh tensors as numbers: an optimizer's step counter
(``torch.optim.Adam`` keeps ``state["step"]`` as a 0-dim tensor and calls
``step.item()`` every step), a scale made with ``torch.tensor(0.5)``. Their values do
not depend on anything the workers hold, so the client can compute them as well and
answer ``item()``, ``bool()`` and ``tolist()`` without a round trip.

A mesh tensor may carry a *known* value: a local CPU tensor equal to the shard every rank
of its mesh holds. It has one when it was made

* by a deterministic factory (``zeros``, ``full``, ``tensor``, ``arange``, ...; never
  ``rand`` or ``empty``) of at most `KNOWN_MAX_NUMEL` elements, or
* by a deterministic op (no ``nondeterministic_seeded`` tag) whose mesh-tensor inputs
  all have known values and whose outputs are that small.

The op runs on the known values too, right after it is issued: a view of a known value
is a view of it here, and an in-place op writes it here as it writes the workers' tensor,
so the mirror keeps the workers' aliasing. Anything else that writes a tensor (an op on
unknown inputs, a remote function's declared mutation, an in-place reduce, a mutable
borrow) forgets the known values of its whole alias group (`forget`). Worker-side
numerics on another device may differ in the last bit for floating point; integer
counters and the constants optimizers use are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch
from torch.utils._pytree import tree_leaves, tree_map

from palatine.tensor.client.context import no_mesh

__all__ = [
    "KNOWN_MAX_NUMEL",
    "DETERMINISTIC_FACTORIES",
    "UNKNOWN",
    "factory_value",
    "op_value",
    "results_known",
    "forget",
]

#: The most elements a known value may have: scalars and small constants, never data.
KNOWN_MAX_NUMEL: Final = 64

#: Factories whose result is the same on every rank and computable here.
DETERMINISTIC_FACTORIES: Final = frozenset(
    {"zeros", "ones", "full", "arange", "tensor", "eye", "linspace", "logspace"}
)


#: `op_value`'s answer when the op cannot run here (an in-place op's own result is None).
UNKNOWN: Final = object()


def _small(shape: Iterable[int]) -> bool:
    return math.prod(shape) <= KNOWN_MAX_NUMEL


def factory_value(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], shape: Iterable[int]
) -> torch.Tensor | None:
    """The value factory ``torch.<name>(*args, **kwargs)`` makes on every rank, computed
    on this process's CPU; None when it is random, uninitialized or not small."""
    if name not in DETERMINISTIC_FACTORIES or not _small(shape):
        return None
    local = {k: v for k, v in kwargs.items() if k not in ("device", "requires_grad", "pin_memory")}
    with no_mesh():  # a local tensor, even while the factory mode is on
        value = getattr(torch, name)(*args, **local)
    return value if isinstance(value, torch.Tensor) else None


def op_value(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: list[Any],
    known_of: Callable[[Any], torch.Tensor | None],
) -> Any:
    """Aten overload ``func`` run on the known values of its mesh tensors ``inputs``
    (``known_of`` gives one, or None): its result with local tensors where the op returns
    mesh tensors, or `UNKNOWN` when an input has no known value or the op is random."""
    if not inputs or torch.Tag.nondeterministic_seeded in func.tags:
        return UNKNOWN
    knowns: dict[int, torch.Tensor] = {}
    for t in inputs:
        k = known_of(t)
        if k is None:
            return UNKNOWN
        knowns[id(t)] = k
    swap = lambda x: knowns.get(id(x), x)  # noqa: E731 - one expression, used twice
    try:
        return func(*tree_map(swap, args), **tree_map(swap, kwargs))
    except Exception:  # noqa: BLE001 - the workers' run decides; here: not known
        return UNKNOWN


def results_known(outputs: Any, local: Any) -> list[tuple[Any, torch.Tensor]] | None:
    """Pairs (mesh tensor, its known value) of an op's outputs and their local results,
    when they line up leaf by leaf and every mesh output is small; else None."""
    outs = [x for x in tree_leaves(outputs) if isinstance(x, torch.Tensor)]
    locs = [x for x in tree_leaves(local) if isinstance(x, torch.Tensor)]
    if len(outs) != len(locs):
        return None
    pairs = []
    for o, v in zip(outs, locs, strict=True):
        if v.shape != o.shape or v.dtype != o.dtype or not _small(o.shape):
            return None
        pairs.append((o, v))
    return pairs


def forget(members: Iterable[Any]) -> None:
    """The alias group ``members`` was written by something not mirrored here."""
    for m in members:
        m._known = None
