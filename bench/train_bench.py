"""Training-step benchmarks: palatine's torch-style step beside its function-style step and torchrun.

Run with the project's interpreter::

    .venv/bin/python bench/train_bench.py [--only METRIC] [--reps N]

The program (``torch_style_step_per_s``, ``torch_style_plain_step_per_s``,
``function_style_step_per_s``) is bench/_train_shape.py, the same for torchmonarch
(bench/peers/monarch_train.py), measured beside it in one run of bench/run.py. This
program measures two implementations, one after the other:

* palatine (``impl: palatine``), on ``palatine.local_mesh(hosts=1, procs_per_host=2)``
  (real system, host and controller processes, 2 CPU workers, the client here), both of
  the demo's styles on that one mesh, their repetitions interleaved:

  - function-style (``function_style_step_per_s``): as ``palatine demo`` does it,
    ``state = remote(init_state)(mesh.process_group(), seed, hidden, lr, batch)``, then
    ``remote(train_step, mutates=("state",))(state)`` per step (``palatine.cli.demo``);
  - torch-style: as ``palatine demo --style torch`` does it (``palatine.cli.demo_torch``):
    every rank's RNG seeded alike, the model built under ``mesh.activate()``, each
    step's batch from ``remote(next_batch)`` on each rank's own data stream, forward,
    backward, the gradients averaged over the mesh, ``optimizer.step()``. The gradients:
    with ``palatine.grad_generator`` where this palatine has it, else
    ``loss.backward()`` then ``palatine.reduce_(grads, (), "avg")`` (extra
    ``backward``); the step recorded once and replayed by ``palatine.compile`` where
    this palatine has that (extra ``variant``; the plain step is then
    ``torch_style_plain_step_per_s``).

* torchrun (``impl: torchrun``), after palatine's mesh is shut down:
  ``python -m torch.distributed.run --standalone --nproc-per-node 2
  bench/peers/torchrun_train.py`` with this interpreter's torch; the same model and the
  function-style step's code (``palatine.cli.demo.train_step``: gloo, one all-reduce of
  the flattened gradients and the loss), timed inside rank 0, which prints its line;
  this program passes it on. The whole torchrun run is bounded (``TORCHRUN_TIMEOUT_S``).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import parse_args, wanted  # noqa: E402
from _train_shape import (  # noqa: E402
    BATCH,
    HIDDEN,
    LR,
    PROCS,
    SEED,
    TORCH_STYLE,
    MeshTorch,
    Printer,
    run_mesh,
    threads_per_rank,
    unavailable,
)
from tensor_bench import _close as close_mesh  # noqa: E402 - the same mesh, stopped alike

import palatine  # noqa: E402
from palatine.cli import demo, demo_torch  # noqa: E402
from palatine.cli.demo_common import IN_FEATURES  # noqa: E402

IMPL = "palatine"
VERSION = metadata.version("palatine")
STARTUP_TIMEOUT_S = 120.0
TORCHRUN_SCRIPT = Path(__file__).resolve().parent / "peers" / "torchrun_train.py"
TORCHRUN_TIMEOUT_S = 150.0


def log(msg: str) -> None:
    print(f"[train_bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ palatine


def _open() -> Any:
    return palatine.local_mesh(hosts=1, procs_per_host=PROCS, startup_timeout_s=STARTUP_TIMEOUT_S)


def _seed_ranks(seed: int) -> None:
    palatine.remote(torch.manual_seed)(seed)


def _batches(seed: int, batch: int) -> Any:
    """Each step's inputs: the torch-style demo's own data streams, one per rank."""
    gen = palatine.remote(demo_torch.data_stream)(seed)
    next_batch = palatine.remote(
        demo_torch.next_batch, propagate=lambda gen, b: torch.empty(b, IN_FEATURES)
    )
    return lambda: next_batch(gen, batch)


def _reduce_avg(tree: Any) -> Any:
    return palatine.reduce_(tree, (), "avg")


def _fetch(value: Any, timeout_s: float) -> float:
    return float(palatine.fetch(value).result(timeout=timeout_s))


def _function_style(mesh: Any) -> Any:
    """The function-style demo's state on every rank; its step, as a function."""
    state = palatine.remote(demo.init_state)(mesh.process_group(), SEED, HIDDEN, LR, BATCH)
    step = palatine.remote(demo.train_step, mutates=("state",))
    return lambda: step(state)


# ------------------------------------------------------------------------------ torchrun


def run_torchrun(description: str) -> None:
    """Start torchrun on bench/peers/torchrun_train.py; pass its line on (or an error)."""
    args = parse_args(description)
    if not wanted(args, TORCH_STYLE):
        return
    version = metadata.version("torch")
    out = Printer(args, "torchrun", version)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(PROCS), "--max-restarts", "0", str(TORCHRUN_SCRIPT),
        "--reps", str(args.reps), "--rep-seconds", str(args.rep_seconds),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank())}
    log(f"torchrun: {' '.join(cmd[1:])}")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    why = None
    try:
        stdout, stderr = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=10)
        why = f"torchrun gave no result within {TORCHRUN_TIMEOUT_S:.0f} s (killed)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its ranks, if any are left
        except ProcessLookupError:
            pass
    sys.stderr.write(stderr[-4000:])
    for line in stdout.splitlines():
        rec = _record(line)
        if rec is not None and rec["metric"] == TORCH_STYLE:
            out.emit(TORCH_STYLE, functools.partial(print, line, flush=True))
            return
    said = [ln.strip() for ln in stderr.splitlines() if "Error" in ln]
    why = why or f"torchrun exited with status {proc.returncode} and printed no result"
    out.error(TORCH_STYLE, RuntimeError(f"{why}: {said[-1][-300:] if said else 'no error'}"))


def _record(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("impl") == "torchrun" else None


def main() -> int:
    description = __doc__.splitlines()[0]
    tensor = getattr(palatine, "Tensor", None)
    if not isinstance(tensor, type):
        status = unavailable(
            description,
            IMPL,
            VERSION,
            RuntimeError(f"palatine {VERSION} has no palatine.Tensor: no torch-style step"),
        )
    else:
        grad_generator = getattr(palatine, "grad_generator", None)
        coalescing = getattr(palatine, "coalescing", None)
        status = run_mesh(
            description,
            MeshTorch(
                impl=IMPL,
                version=VERSION,
                open_mesh=_open,
                close_mesh=close_mesh,
                tensor_type=tensor,
                seed_ranks=_seed_ranks,
                batches=_batches,
                reduce_avg=_reduce_avg,
                fetch=_fetch,
                grad_generator=grad_generator,
                coalescing=coalescing,
                compile=getattr(palatine, "compile", None),
                mesh_text=f"palatine.local_mesh(hosts=1, procs_per_host={PROCS}), CPU workers",
            ),
            function_style=_function_style,
        )
    run_torchrun(description)
    return status


if __name__ == "__main__":
    sys.exit(main())
