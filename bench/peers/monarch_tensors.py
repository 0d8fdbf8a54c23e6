"""Tensor-engine benchmarks for Monarch (``pip install torchmonarch``), on CPU.

Run with the peers' interpreter (see bench/requirements-peers.txt)::

    bench/.peers-venv/bin/python bench/peers/monarch_tensors.py [--only METRIC] [--reps N]

The program (``tensor_ops_per_s``, ``tensor_fetch_roundtrip_ms``) is bench/_tensor_shape.py,
the same for palatine (bench/tensor_bench.py). Monarch's side:

* The mesh: ``this_host().spawn_procs(per_host={"gpus": 2})`` (2 procs on this host),
  activated with ``procs.activate()``, which in torchmonarch 0.7 spawns the tensor engine
  on those procs (``monarch.mesh_controller.spawn_tensor_engine``) the first time. Nothing
  has to be set for CPU: a worker without CUDA makes torch's factories' tensors on the CPU
  (``torch.zeros(64, 64)`` under the mesh is a ``monarch.common.tensor.Tensor`` on ``cpu``).
* ``monarch.inspect(t)`` fetches rank 0's value (``fetch_shard(t).result()``).
* The procs are stopped at the end (``procs.stop()``).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import monarch  # noqa: E402
from _tensor_shape import PROCS, Framework, run  # noqa: E402
from monarch.actor import this_host  # noqa: E402
from monarch.common.tensor import Tensor  # noqa: E402

IMPL = "torchmonarch"
VERSION = metadata.version("torchmonarch")
STOP_TIMEOUT_S = 20.0


def _open() -> Any:
    return this_host().spawn_procs(per_host={"gpus": PROCS})


def _close(procs: Any) -> None:
    try:
        procs.stop().get(timeout=STOP_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a failed mesh may refuse a clean stop
        print(f"stop: {type(exc).__name__}: {exc}", file=sys.stderr)


FRAMEWORK = Framework(
    impl=IMPL,
    version=VERSION,
    open_mesh=_open,
    close_mesh=_close,
    inspect=monarch.inspect,
    tensor_type=Tensor,
    mesh_text=f'this_host().spawn_procs(per_host={{"gpus": {PROCS}}}), CPU tensors',
)


if __name__ == "__main__":
    sys.exit(run(__doc__.splitlines()[0], FRAMEWORK))
