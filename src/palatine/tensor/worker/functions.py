"""Small functions the client runs on workers by import path (cheap to import there)."""

from __future__ import annotations

from typing import Any

__all__ = ["coordinate", "identity", "identity_printing", "broadcast_state"]

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
