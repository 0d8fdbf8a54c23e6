"""The worker side of `palatine.random`: seeding and saving a worker's random generators.

The client names these functions by path, so a worker imports only this small module
(and torch, which it has already loaded for its ops). They run on the calling stream's
thread, like the ops they seed: every tensor op of a worker draws from torch's
process-wide generators (``torch.default_generator`` for CPU ops, one generator per CUDA
device for CUDA ops), whichever stream's thread runs it, and these functions act on
exactly those generators.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = [
    "State",
    "cpu_state",
    "cuda_states",
    "make_deterministic",
    "manual_seed",
    "manual_seed_all_cuda",
    "manual_seed_cuda",
    "rank_seed",
    "reseed",
    "set_cpu_state",
    "set_cuda_states",
    "set_state",
    "state",
]


class State(NamedTuple):
    """A worker's random state: its CPU generator's state, and its current CUDA device's
    (``None`` on a worker without CUDA). Both are uint8 CPU tensors, as torch gives them."""

    cpu: Any
    cuda: Any


def rank_seed(seed: Any, process_idx: Any) -> int:
    """The seed this rank uses: ``seed ^ process_idx`` (each an int or a 0-dim integer
    tensor; no ``process_idx`` is 0). Monarch's ``set_manual_seed_remote`` combines them so."""
    return int(seed) ^ (0 if process_idx is None else int(process_idx))


def manual_seed(seed: Any, process_idx: Any = None) -> None:
    """`torch.manual_seed` of `rank_seed` (the CPU generator and every CUDA device's)."""
    import torch

    torch.manual_seed(rank_seed(seed, process_idx))


def manual_seed_cuda(seed: Any, process_idx: Any = None) -> None:
    """`torch.cuda.manual_seed` of `rank_seed`: the current CUDA device's generator only."""
    import torch

    torch.cuda.manual_seed(rank_seed(seed, process_idx))


def manual_seed_all_cuda(seed: Any, process_idx: Any = None) -> None:
    """`torch.cuda.manual_seed_all` of `rank_seed`: every CUDA device's generator."""
    import torch

    torch.cuda.manual_seed_all(rank_seed(seed, process_idx))


def reseed() -> None:
    """`torch.seed`: a fresh, non-deterministic seed for the CPU and CUDA generators."""
    import torch

    torch.seed()


def cpu_state() -> torch.Tensor:
    """The CPU generator's state (`torch.get_rng_state`)."""
    import torch

    return torch.get_rng_state()


def set_cpu_state(new: torch.Tensor) -> None:
    import torch

    torch.set_rng_state(new)


def cuda_states() -> list[torch.Tensor]:
    """Every visible CUDA device's generator state (none on a worker without CUDA)."""
    import torch

    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []


def set_cuda_states(states: list[torch.Tensor]) -> None:
    import torch

    if len(states) != (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        raise ValueError(
            f"{len(states)} CUDA generator state(s) for the "
            f"{torch.cuda.device_count()} CUDA device(s) of this worker"
        )
    torch.cuda.set_rng_state_all(states)


def state() -> State:
    """The CPU generator's state and the current CUDA device's (`State`)."""
    import torch

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return State(torch.get_rng_state(), cuda)


def set_state(cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
    """Restore what `state` returned (the CUDA part only when there is one)."""
    import torch

    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def make_deterministic() -> None:
    """Deterministic kernels from now on: `torch.use_deterministic_algorithms`, cuDNN
    without benchmarking, and cuBLAS's fixed workspace (for cuBLAS handles made later)."""
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
