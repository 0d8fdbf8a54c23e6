"""torchrun's side of ``torch_style_step_per_s``: the training step as a plain torch.distributed script.

Started by bench/train_bench.py with the project's interpreter (its torch, and the model
and step from palatine's demo), never alone by bench/run.py::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/peers/torchrun_train.py [--reps N] [--rep-seconds S]

The program is bench/_train_shape.py's (`measure`: warm-up, calibration, repetitions).
Each rank joins the gloo group torchrun set up, builds the same replica (same seed) and
its own data stream, and trains with ``palatine.cli.demo.train_step``: forward,
backward, one all-reduce of the flattened gradients and the loss, the average written
back, ``optimizer.step()``: what a DDP-style script does, and the very code the
function-style demo runs on palatine's workers. The step is synchronous, so a round ends
with its last step. Rank 0 times the rounds, and rank 0's calibrated step count is every
rank's (one broadcast). Rank 0 prints the JSON line (``impl: torchrun``).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import parse_args  # noqa: E402
from _train_shape import (  # noqa: E402
    BATCH,
    HIDDEN,
    JOB,
    LR,
    MIN_REP_S,
    MOMENTUM,
    SEED,
    TEACHER_HIDDEN,
    TORCH_STYLE,
    Printer,
    Side,
    measure,
    threads_per_rank,
)

from palatine.cli import demo  # noqa: E402
from palatine.cli.demo_common import data_seed, mlp  # noqa: E402


def _state(rank: int) -> dict[str, Any]:
    """What ``demo.train_step`` trains: ``demo.init_state``'s, with torch's rank."""
    torch.manual_seed(SEED)
    model, teacher = mlp(HIDDEN), mlp(TEACHER_HIDDEN)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return {
        "model": model,
        "teacher": teacher,
        "opt": torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        "gen": torch.Generator().manual_seed(data_seed(SEED, rank)),
        "pg": dist.group.WORLD,
        "world": dist.get_world_size(),
        "batch": BATCH,
        "steps": 0,
    }


def _agree(n: int) -> int:
    """Rank 0's step count, on every rank."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = _state(rank)
    side = Side("torchrun", lambda: demo.train_step(state), float)
    measure([side], args.reps, max(MIN_REP_S, 2 * args.rep_seconds), _agree)
    if rank == 0:
        Printer(args, "torchrun", metadata.version("torch")).side(
            TORCH_STYLE,
            side,
            {
                **JOB,
                "variant": "plain",
                "step": "palatine.cli.demo.train_step: gloo, one all_reduce of the "
                "flattened gradients and the loss",
                "threads_per_rank": threads_per_rank(),
                "launcher": f"torch.distributed.run --standalone --nproc-per-node "
                f"{dist.get_world_size()}",
            },
        )
    dist.destroy_process_group()
    return 0 if side.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
