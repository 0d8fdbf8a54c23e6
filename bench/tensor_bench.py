"""Tensor-engine benchmarks for palatine: mesh tensors on a real local mesh, on CPU.

Run with the project's interpreter::

    .venv/bin/python bench/tensor_bench.py [--only METRIC] [--reps N]

The program (``tensor_ops_per_s``, ``tensor_fetch_roundtrip_ms``) is bench/_tensor_shape.py,
the same for torchmonarch (bench/peers/monarch_tensors.py), measured beside it in one run
of bench/run.py. palatine's side:

* The mesh: ``palatine.local_mesh(hosts=1, procs_per_host=2)``: real ``palatine system``,
  ``palatine host`` and ``palatine controller`` processes and 2 CPU workers, the client in
  this process, shut down at the end.
* Under ``with mesh.activate():`` torch's factories return ``palatine.Tensor`` mesh
  tensors (``torch.zeros(64, 64)``), and ``x + 1`` / ``x.sum()`` on them are operations
  on every rank of the mesh.
* ``palatine.inspect(t)`` fetches rank 0's value as a local torch tensor.

Without ``palatine.Tensor`` (a palatine from before the tensor API) both metrics are
printed as errors saying so, and the program exits with status 1.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tensor_shape import PROCS, Framework, run, unavailable  # noqa: E402

import palatine  # noqa: E402

IMPL = "palatine"
VERSION = metadata.version("palatine")
STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 20.0


def _open() -> Any:
    return palatine.local_mesh(hosts=1, procs_per_host=PROCS, startup_timeout_s=STARTUP_TIMEOUT_S)


def _close(mesh: Any) -> None:
    try:
        mesh.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a failed session may refuse a clean stop
        print(f"shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)


def main() -> int:
    description = __doc__.splitlines()[0]
    tensor = getattr(palatine, "Tensor", None)
    if not isinstance(tensor, type):
        return unavailable(
            description,
            IMPL,
            VERSION,
            RuntimeError(
                f"palatine {VERSION} has no palatine.Tensor: the tensor API (torch "
                "factories under `with mesh.activate():` returning mesh tensors, "
                "palatine.inspect of them) is not in this build; nothing to measure"
            ),
        )
    return run(
        description,
        Framework(
            impl=IMPL,
            version=VERSION,
            open_mesh=_open,
            close_mesh=_close,
            inspect=palatine.inspect,
            tensor_type=tensor,
            mesh_text=f"palatine.local_mesh(hosts=1, procs_per_host={PROCS}), CPU workers",
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
