"""Training-step benchmark for Monarch (``pip install torchmonarch``): the torch-style step, on CPU.

Run with the peers' interpreter (see bench/requirements-peers.txt)::

    bench/.peers-venv/bin/python bench/peers/monarch_train.py [--only METRIC] [--reps N]

The program (``torch_style_step_per_s``, and ``torch_style_plain_step_per_s`` when the
coalesced step is the headline) is bench/_train_shape.py, the same for palatine
(bench/train_bench.py). Monarch's side:

* The mesh: ``this_host().spawn_procs(per_host={"gpus": 2})``, activated with
  ``procs.activate()``, which in torchmonarch 0.7 spawns the tensor engine on those
  procs (as bench/peers/monarch_tensors.py); the model built under it lives on the CPU.
* Every rank's RNG seeded alike by a remote function (identical replicas); each step's
  batch drawn on each rank by a remote function (``torch.randn`` of the rank's RNG).
* The gradients: ``monarch.grad_generator``, each reduced with ``reduce_`` over
  ``gpus`` (``avg``) as it is yielded, where it loads (torchmonarch 0.7 built for
  another torch refuses to: then ``loss.backward()`` and one ``reduce_`` of every
  gradient, and the extra ``grad_generator_unavailable`` says why); each step inside
  ``with monarch.coalescing():`` for the headline figure, plainly for the other.
* A fault of the mesh reaches the client through ``monarch.actor.unhandled_fault_hook``:
  recorded here (not the default exit), and the pending fetch then raises with its
  report, so the metrics are printed as errors saying what failed. In torchmonarch 0.7
  on a machine without CUDA this is what happens: the client sets up no communicator
  (``monarch.common.client.Client`` skips ``BackendNetworkInit`` and ``SplitComm`` when
  ``torch.cuda.is_available()`` is false), so the first gradient ``reduce_`` fails on
  the workers ("no comm found for stream ..."), and no step with the gradients averaged
  runs at all. The error line says so; no number is made up.
* The procs are stopped at the end (``procs.stop()``).
"""

from __future__ import annotations

import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import monarch  # noqa: E402
import monarch.actor  # noqa: E402
import torch  # noqa: E402
from _train_shape import IN_FEATURES, PROCS, MeshTorch, run_mesh  # noqa: E402
from monarch.actor import this_host  # noqa: E402
from monarch.common.tensor import Tensor  # noqa: E402

IMPL = "torchmonarch"
VERSION = metadata.version("torchmonarch")
STOP_TIMEOUT_S = 20.0
POLL_S = 0.1  # how often a pending fetch looks for a recorded fault
FAULTS_SETTLE_S = 1.0  # once one is, how long the others are waited for
DIM = "gpus"

FAULTS: list[str] = []  # the reports of the mesh's faults, as they reached the client


def _on_fault(failure: Any) -> None:
    """Monarch's unhandled-fault hook: record the report (returning drops the fault, so
    the process lives on to print the metrics as errors)."""
    FAULTS.append(" ".join(str(failure.report()).split()))


def _fault_error() -> RuntimeError:
    """The error for the faults recorded: the first one's report, or the reason
    explained where one of them (they come in any order) is the missing communicator."""
    time.sleep(FAULTS_SETTLE_S)  # the other procs' reports of the same fault
    report = next((r for r in FAULTS if "no comm found" in r), FAULTS[0])
    at = report.find("no comm found")
    if at >= 0:
        return RuntimeError(
            f"torchmonarch {VERSION}'s tensor engine ran no data-parallel step on CPU: the "
            f"gradients' reduce_ over {DIM!r} failed on the workers ({report[at : at + 60]}"
            f"...): without CUDA (torch.cuda.is_available() is {torch.cuda.is_available()}) "
            "its client sets up no communicator (monarch.common.client.Client skips "
            "BackendNetworkInit and SplitComm), so no collective of the engine runs"
        )
    return RuntimeError(f"torchmonarch: the mesh failed: {report[:400]}")


def _open() -> Any:
    monarch.actor.unhandled_fault_hook = _on_fault
    return this_host().spawn_procs(per_host={DIM: PROCS})


def _close(procs: Any) -> None:
    try:
        procs.stop().get(timeout=STOP_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a failed mesh may refuse a clean stop
        print(f"stop: {type(exc).__name__}: {exc}", file=sys.stderr)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)


def _draw(batch: int) -> Any:
    return torch.randn(batch, IN_FEATURES)


def _seed_ranks(seed: int) -> None:
    monarch.remote(_seed, propagate=lambda seed: None)(seed)


def _batches(seed: int, batch: int) -> Any:
    draw = monarch.remote(_draw, propagate=lambda b: torch.empty(b, IN_FEATURES))
    return lambda: draw(batch)


def _reduce_avg(tree: Any) -> Any:
    return monarch.reduce_(tree, DIM, "avg")


def _fetch(value: Any, timeout_s: float) -> float:
    """``fetch_shard(value)``'s result, waiting at most ``timeout_s``; a recorded fault of
    the mesh raises at once."""
    fut = monarch.fetch_shard(value)
    deadline = time.monotonic() + timeout_s
    while True:
        if FAULTS:
            raise _fault_error()
        try:
            return float(fut.result(timeout=POLL_S))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"torchmonarch: no loss within {timeout_s:.0f} s") from None


def _public(name: str) -> tuple[Any, dict[str, str]]:
    """``monarch.<name>``, or None and a note saying why it did not load (torchmonarch
    0.7 checks that its build's torch and this one match when some of it loads)."""
    try:
        return getattr(monarch, name), {}
    except Exception as exc:  # noqa: BLE001 - the reason goes into the extras
        return None, {f"{name}_unavailable": f"{type(exc).__name__}: {exc}"[:300]}


GRAD_GENERATOR, GRAD_NOTE = _public("grad_generator")
COALESCING, COALESCING_NOTE = _public("coalescing")

FRAMEWORK = MeshTorch(
    impl=IMPL,
    version=VERSION,
    open_mesh=_open,
    close_mesh=_close,
    tensor_type=Tensor,
    seed_ranks=_seed_ranks,
    batches=_batches,
    reduce_avg=_reduce_avg,
    fetch=_fetch,
    grad_generator=GRAD_GENERATOR,
    coalescing=COALESCING,
    mesh_text=f'this_host().spawn_procs(per_host={{"gpus": {PROCS}}}), CPU tensors',
    notes={**GRAD_NOTE, **COALESCING_NOTE},
)


if __name__ == "__main__":
    sys.exit(run_mesh(__doc__.splitlines()[0], FRAMEWORK))
