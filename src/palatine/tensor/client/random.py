"""`palatine.random`: seeding and saving the random generators of a mesh's workers.

The names are Monarch's (``monarch.builtins.random`` and ``monarch.random``), with the
same meaning, so a Monarch program's seeding carries over unchanged.

**Which generators.** Random ops run on the workers: ``torch.rand(3)`` under
``mesh.activate()``, ``dropout`` of a mesh tensor, a remote function's own draws. Each
draws from torch's process-wide generators of its worker (``torch.default_generator``
for CPU ops, one generator per CUDA device for CUDA ops), whichever stream runs it, and
these functions act on exactly those. Each is one call on every rank of the mesh, issued
on the active stream like an op, so it comes in order with that stream's ops; ops on
*other* streams share the generators, and how their draws interleave with this stream's
is not defined unless the streams are ordered (a borrow). A worker starts with a seed
torch picks at random: until a program seeds, ranks differ and runs differ.

**Seeds per rank.** A seed function seeds each rank with ``seed ^ process_idx``
(Monarch's arithmetic), each an int or a 0-dim integer tensor:

* ``process_idx=None`` (the default, as Monarch's 0): every rank gets ``seed``, and
  draws the same numbers: identical replicas (a data-parallel model initialized alike);
* an int: every rank gets ``seed ^ process_idx``;
* a mesh tensor, such as ``mesh.rank(("host", "proc"))``: each rank gets ``seed ^`` its
  own value, here its row-major index ``r``, so every rank draws its own numbers;
  ``mesh.rank("dp")`` makes them differ along ``dp`` only.

After a seed, a rank draws exactly what local torch draws after
``torch.manual_seed(seed ^ process_idx)`` and the same calls, so two runs that seed
alike get the same values.

**States.** `get_rng_state_remote` returns each rank's CPU generator state as a mesh
tensor (uint8); ``palatine.inspect(state, proc=1)`` brings one rank's back, and
`set_rng_state_remote` puts them back, after which the ranks draw the same numbers
again. A state held locally goes back through ``palatine.to_mesh(state, mesh)``.
`get_state` / `set_state` / `new_state` do the same for the CPU generator and the
current CUDA device's together (a `State`; its ``cuda`` is ``None`` on CPU workers).
Whether workers have CUDA is learned once per session from the mesh's first rank (one
round trip at the first `get_state` or `get_rng_state_all_cuda_remote` of a session,
``propagate="cached"``); the mesh's workers are assumed alike.

Importing this module does not load torch; the first call does.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Final

from palatine.tensor.client.context import get_active_mesh
from palatine.tensor.client.propagation import remote
from palatine.tensor.worker.random_state import State

if TYPE_CHECKING:
    import torch

__all__ = [
    "State",
    "get_rng_state_all_cuda_remote",
    "get_rng_state_remote",
    "get_state",
    "make_deterministic",
    "manual_seed_all_cuda_remote",
    "manual_seed_cuda_remote",
    "new_state",
    "random_seed_remote",
    "seed_remote",
    "set_manual_seed_remote",
    "set_rng_state_all_cuda_remote",
    "set_rng_state_remote",
    "set_state",
]

_WORKER: Final = "palatine.tensor.worker.random_state"

_SEED_MIN: Final = -(2**63)
_SEED_END: Final = 2**64  # torch.manual_seed takes [-2**63, 2**64)


# ---------------------------------------------------------------------------- plumbing


def _nothing(*args: Any, **kwargs: Any) -> None:
    """The propagation of a function that returns nothing."""
    return None


@functools.cache
def _cpu_state_bytes() -> int:
    """The size of a CPU generator's state: the client's torch is the workers' torch."""
    import torch

    return torch.get_rng_state().numel()


def _cpu_state_like() -> torch.Tensor:
    import torch

    return torch.empty(_cpu_state_bytes(), dtype=torch.uint8)


@functools.cache
def _fixed(name: str) -> Any:
    """The worker function ``name`` as a tensor remote function of a known result:
    ``cpu_state`` a state tensor, every other nothing (built on first use: it loads torch)."""
    return remote(
        f"{_WORKER}.{name}", propagate=_cpu_state_like if name == "cpu_state" else _nothing
    )


# Per session: a function whose result depends on the workers (their CUDA devices) is
# learned on that session's first rank, once (a new session may have other workers).
_learned: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _learned_function(name: str, caller: str) -> Any:
    mesh = get_active_mesh()
    if mesh is None:
        raise TypeError(f"palatine.random.{caller}: no mesh is active: use 'with mesh.activate():'")
    table = _learned.setdefault(mesh.session, {})
    fn = table.get(name)
    if fn is None:
        fn = table[name] = remote(f"{_WORKER}.{name}", propagate="cached")
    return fn


def _check_seed(caller: str, what: str, value: Any, optional: bool = False) -> None:
    """A seed or process index: an int, or a 0-dim integer tensor (a mesh tensor's
    value differs per rank). Anything else is a `TypeError` here, not on the workers."""
    if value is None and optional:
        return
    if isinstance(value, int) and not isinstance(value, bool):
        return
    import torch

    if isinstance(value, torch.Tensor):
        dt = value.dtype
        if value.dim() == 0 and not (dt.is_floating_point or dt.is_complex or dt == torch.bool):
            return
        raise TypeError(
            f"palatine.random.{caller}: {what} must be a 0-dim integer tensor, got "
            f"shape {list(value.shape)} of {dt}"
        )
    raise TypeError(
        f"palatine.random.{caller}: {what} must be an int or a 0-dim integer tensor"
        f"{' (or None)' if optional else ''}, got {type(value).__name__}"
    )


def _checked(caller: str, seed: Any, process_idx: Any) -> None:
    _check_seed(caller, "seed", seed)
    _check_seed(caller, "process_idx", process_idx, optional=True)
    if isinstance(seed, int) and (process_idx is None or isinstance(process_idx, int)):
        s = seed ^ (process_idx or 0)
        if not _SEED_MIN <= s < _SEED_END:
            raise ValueError(
                f"palatine.random.{caller}: seed {seed} ^ process_idx {process_idx or 0} = "
                f"{s} is outside torch's seeds [-2**63, 2**64)"
            )


# ---------------------------------------------------------------------------- seeding


def set_manual_seed_remote(seed: Any, process_idx: Any = None) -> None:
    """Seed every rank's generators, CPU and CUDA (``torch.manual_seed``), with
    ``seed ^ process_idx``: the same seed on every rank by default, a rank's own with
    ``process_idx=mesh.rank(dims)`` (see the module). On the first mesh tensor
    argument's mesh, else the active one; on the active stream."""
    _checked("set_manual_seed_remote", seed, process_idx)
    _fixed("manual_seed")(seed, process_idx)


def manual_seed_cuda_remote(seed: Any, process_idx: Any = None) -> None:
    """As `set_manual_seed_remote`, for the current CUDA device's generator only
    (``torch.cuda.manual_seed``; nothing to seed on a worker without CUDA)."""
    _checked("manual_seed_cuda_remote", seed, process_idx)
    _fixed("manual_seed_cuda")(seed, process_idx)


def manual_seed_all_cuda_remote(seed: Any, process_idx: Any = None) -> None:
    """As `set_manual_seed_remote`, for every CUDA device's generator only
    (``torch.cuda.manual_seed_all``)."""
    _checked("manual_seed_all_cuda_remote", seed, process_idx)
    _fixed("manual_seed_all_cuda")(seed, process_idx)


def seed_remote() -> None:
    """Seed every rank's generators anew from the operating system (``torch.seed``):
    ranks differ, and runs differ. The seeds stay on the workers."""
    _fixed("reseed")()


random_seed_remote = seed_remote
"""``torch.random.seed`` is ``torch.seed``: the same call (Monarch has both names)."""


def make_deterministic() -> None:
    """Make the workers' kernels deterministic from now on, for the rest of the session:
    ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic kernel
    then fails on the workers), cuDNN deterministic without benchmarking, and cuBLAS's
    fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, which takes effect for cuBLAS handles
    made afterwards: call this before the first CUDA matmul)."""
    _fixed("make_deterministic")()


# ---------------------------------------------------------------------------- states


def get_rng_state_remote() -> Any:
    """Each rank's CPU generator state (``torch.get_rng_state``), as a uint8 mesh tensor
    of the active mesh, on the active stream."""
    return _fixed("cpu_state")()


def set_rng_state_remote(state: Any) -> None:
    """Put back the CPU generator states `get_rng_state_remote` returned: each rank
    gets its own, and draws again what it drew after the state was taken."""
    _fixed("set_cpu_state")(state)


def get_rng_state_all_cuda_remote() -> list[Any]:
    """Each rank's CUDA generator states, one uint8 mesh tensor per CUDA device a worker
    sees (``torch.cuda.get_rng_state_all``; an empty list on CPU workers)."""
    return list(_learned_function("cuda_states", "get_rng_state_all_cuda_remote")())


def set_rng_state_all_cuda_remote(states: list[Any]) -> None:
    """Put back what `get_rng_state_all_cuda_remote` returned (one per CUDA device)."""
    _fixed("set_cuda_states")(list(states))


def get_state() -> State:
    """Each rank's CPU generator state and current CUDA device's: a `State` of mesh
    tensors (``cuda`` is ``None`` on CPU workers)."""
    cpu, cuda = _learned_function("state", "get_state")()
    return State(cpu, cuda)


def set_state(state: State) -> None:
    """Put back a `State` from `get_state` or `new_state`, on its tensors' mesh."""
    _fixed("set_state")(state.cpu, state.cuda)


def new_state(seed: Any, process_idx: Any = None) -> State:
    """The `State` that `set_manual_seed_remote(seed, process_idx)` would give, made
    without changing the generators' current state (it seeds, reads, and restores, on
    the active stream). With ``seed=mesh.rank(dims)`` each rank gets its own: switch
    between per-rank and shared streams with `set_state`. On the first mesh tensor
    argument's mesh, else the active one."""
    _checked("new_state", seed, process_idx)
    from palatine.tensor.client.tensor import Tensor

    meshes = [v.mesh for v in (seed, process_idx) if isinstance(v, Tensor)]
    if not meshes:
        return _new_state(seed, process_idx)
    with meshes[0].activate():
        return _new_state(seed, process_idx)


def _new_state(seed: Any, process_idx: Any) -> State:
    current = get_state()
    set_manual_seed_remote(seed, process_idx)
    made = get_state()
    set_state(current)
    return made
