"""Small functions the client runs on workers by import path (cheap to import there)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "META_TAG",
    "Leaves",
    "broadcast_state",
    "coordinate",
    "coordinate_tensor",
    "identity",
    "identity_printing",
    "result_meta",
    "tensor_leaves",
]

# (The session's TCPStore master is palatine.tensor.worker.collectives.open_store.)


def coordinate(mesh: Any, dims: tuple[str, ...]) -> int:
    """This worker's row-major index over ``dims`` of its device-mesh view."""
    idx = 0
    for d in dims:
        idx = idx * mesh.size(d) + mesh.rank(d)
    return idx


def identity(value: Any) -> Any:
    return value


def identity_printing(value: Any) -> Any:
    """`identity`, printing one line (the benchmark of output streaming)."""
    print(f"call {value} done", flush=True)
    return value


def ready(*values: Any) -> None:
    """Nothing: run on one rank and fetched, it says that every one of ``values`` is
    there and not failed (`palatine.resync` checks its source with it before a
    broadcast that every rank must join)."""


def pack_flat(*values: Any) -> Any:
    """One flat tensor of ``values`` in order (a bucket of reduces, `fuse_reduces`)."""
    import torch

    return torch.cat([v.reshape(-1) for v in values])


def unpack_flat(flat: Any, *values: Any, bind: tuple[int, ...] = ()) -> Any:
    """Write the pieces of ``flat`` back into ``values`` in place. Returns the values
    at ``bind`` (the reduces whose result is a new ref for their value): one of them
    as itself, several as a list, none as None."""
    offset = 0
    for v in values:
        n = v.numel()
        v.copy_(flat[offset : offset + n].view_as(v))
        offset += n
    out = [values[i] for i in bind]
    return out[0] if len(out) == 1 else (out or None)


def broadcast_state(value: Any, src: int) -> None:
    """Make ``value`` on every rank what it is on rank ``src`` (`palatine.resync`):
    modules' parameters and buffers and tensors in place, optimizers through their state
    dict; dicts, lists and tuples are walked (in their own order, the same on every rank
    that built them alike); anything else (a process group, a random generator: a rank's
    own data position) is left as it is. Over the session's collective group."""
    import torch
    import torch.distributed as dist

    def visit(v: Any) -> None:
        if isinstance(v, torch.nn.Module):
            for t in [*v.parameters(), *v.buffers()]:
                dist.broadcast(t.data, src)
        elif isinstance(v, torch.optim.Optimizer):
            box = [v.state_dict()]
            dist.broadcast_object_list(box, src)
            v.load_state_dict(box[0])
        elif isinstance(v, torch.Tensor):
            dist.broadcast(v.data, src)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    visit(value)


class Leaves(list[Any]):
    """The tensor leaves of a remote function's result, flat (``CallFunction.flatten``):
    bound one per result ref, even when there is just one."""


def tensor_leaves(ret: Any, n: int, label: str) -> Leaves:
    """The tensor leaves of ``ret`` in torch's pytree order, checked to be ``n``: the
    client learned the structure from a shape function, and a result that disagrees with
    it is the function's error, not a silent misbinding."""
    import torch
    from torch.utils._pytree import tree_leaves

    found = Leaves(x for x in tree_leaves(ret) if isinstance(x, torch.Tensor))
    if len(found) != n:
        raise TypeError(
            f"{label} returned {len(found)} tensor(s) where its propagation said {n}: "
            "the shape function (propagate=) does not describe what the function returns"
        )
    return found


def result_meta(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a function or a dotted path) and return its result with every tensor
    replaced by ``("__palatine_meta__", shape, stride, dtype, device)``: what a client
    learns a remote function's result structure from (``propagate="inspect"``)."""
    import torch
    from torch.utils._pytree import tree_map

    if isinstance(fn, str):
        fn = _resolve(fn)
    out = fn(*args, **kwargs)

    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return (META_TAG, tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device))
        return x

    return tree_map(describe, out)


META_TAG = "__palatine_meta__"
"""First item of a tensor's description in `result_meta`'s answer."""


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def coordinate_tensor(mesh: Any, dims: tuple[str, ...]) -> Any:
    """`coordinate` as a 0-dim int64 tensor (``mesh.rank(dims)``)."""
    import torch

    return torch.tensor(coordinate(mesh, dims), dtype=torch.int64)
