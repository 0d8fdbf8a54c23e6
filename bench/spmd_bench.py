"""A torchrun script under ``palatine torchrun`` and under ``torchrun``, in one run.

Run with the project's interpreter::

    .venv/bin/python bench/spmd_bench.py [--only spmd_restart_after_sigkill_s] [--reps N]

The same script (bench/peers/torchrun_spmd_train.py: DDP on the demo's MLP shape, gloo,
4 CPU ranks, a checkpoint after every step) under both launchers, each run a fresh
launcher process. Rank 0 writes down when each step completed, so neither launcher's
output forwarding is measured.

* ``spmd_start_to_first_step_s``: from starting the launcher to the first step
  completed (interpreters, torch's import, the rendezvous, the first step).
* ``spmd_restart_after_sigkill_s``: rank 2 SIGKILLs itself at step 10, 6 s after reaching
  it (``--max-restarts 1``); from just before the kill to the first step completed after
  the restart (the group's stop, new procs, torch, the rendezvous, the checkpoint).
* ``spmd_steps_per_s``: steps/s from step 750 to the last (1500 steps), no fault.

``impl: palatine`` is ``python -m palatine torchrun``, ``impl: torchrun`` this
interpreter's ``torchrun`` (torch's own elastic agent).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_args, run_metric

BENCH = Path(__file__).resolve().parent
SCRIPT = BENCH / "peers" / "torchrun_spmd_train.py"
NPROC, KILL_RANK, KILL_AT = 4, 2, 10
# The clean run: steps/s from STEADY_FROM on, once palatine's fork server has imported
# torch for later restarts (it does so beside the first group, ≈ 3 s of one core here).
STEPS, STEADY_FROM = 1500, 750
FAULT_STEPS = 60
# How long rank 2 waits at step 10 before its SIGKILL: a job dies minutes into training,
# after palatine's fork server has imported torch (it does so once the first group runs).
KILL_DELAY_S = 6.0
RUN_TIMEOUT_S = 300.0

LAUNCHERS = {
    "palatine": [sys.executable, "-m", "palatine", "torchrun"],
    # (--standalone: a free rendezvous port, not 29500, which another job may hold)
    "torchrun": [str(Path(sys.executable).parent / "torchrun"), "--standalone"],
}


def log(msg: str) -> None:
    print(f"[spmd_bench] {msg}", file=sys.stderr, flush=True)


def run_once(impl: str, fault: bool) -> tuple[float, list[tuple[str, int, float]]]:
    """One fresh launch of the script; (when it started, its events)."""
    with tempfile.TemporaryDirectory(prefix="spmd-bench-") as tmp:
        events = Path(tmp) / "events"
        cmd = [*LAUNCHERS[impl], "--nproc-per-node", str(NPROC)]
        if fault:
            cmd += ["--max-restarts", "1"]
        steps = FAULT_STEPS if fault else STEPS
        cmd += [str(SCRIPT), "--steps", str(steps), "--dir", tmp, "--events", str(events)]
        if fault:
            cmd += ["--kill-rank", str(KILL_RANK), "--kill-at", str(KILL_AT)]
            cmd += ["--kill-delay", str(KILL_DELAY_S)]
        started = time.time()
        # In a session of its own: whatever way it ends, none of its ranks outlives it.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if proc.returncode != 0:
            errors = [line for line in stderr.splitlines() if "Error" in line]
            raise RuntimeError(f"{impl} exited {proc.returncode}: {errors[:3]}")
        seen = []
        for line in events.read_text().splitlines():
            what, step, at = line.split()
            seen.append((what, int(step), float(at)))
        return started, seen


def first_step(events: list[tuple[str, int, float]], after: float = 0.0, step: int = 0) -> float:
    """When the first step (numbered ``step`` or later) completed after ``after``."""
    return min(at for what, n, at in events if what == "step" and at > after and n >= step)


def measure(impl: str, reps: int) -> dict[str, tuple[list[float], dict[str, Any]]]:
    start_s, rates, restart_s = [], [], []
    for _ in range(reps):
        started, events = run_once(impl, fault=False)
        start_s.append(first_step(events) - started)
        steps = {step: at for what, step, at in events if what == "step"}
        rates.append((STEPS - 1 - STEADY_FROM) / (steps[STEPS - 1] - steps[STEADY_FROM]))
        _, events = run_once(impl, fault=True)
        (killed,) = [at for what, _, at in events if what == "kill"]
        restart_s.append(first_step(events, after=killed, step=KILL_AT) - killed)
        log(f"{impl}: start {start_s[-1]:.2f} s, {rates[-1]:.0f} steps/s, "
            f"restart {restart_s[-1]:.2f} s")  # fmt: skip
    return {
        "spmd_start_to_first_step_s": (start_s, {}),
        "spmd_steps_per_s": (rates, {}),
        "spmd_restart_after_sigkill_s": (restart_s, {}),
    }


def main() -> None:
    args = parse_args(__doc__ or "")
    reps = args.reps if args.reps != 5 else 3  # each rep is 2 launches of a training run
    version = {"palatine": metadata.version("palatine"), "torchrun": metadata.version("torch")}
    for impl in LAUNCHERS:
        results: dict[str, tuple[list[float], dict[str, Any]]] = {}
        for metric, unit, higher in (
            ("spmd_start_to_first_step_s", "s", False),
            ("spmd_restart_after_sigkill_s", "s", False),
            ("spmd_steps_per_s", "steps/s", True),
        ):
            run_metric(
                args,
                metric,
                impl,
                unit,
                higher,
                version[impl],
                functools.partial(_measured, results, impl, reps, metric),
            )


def _measured(
    results: dict[str, tuple[list[float], dict[str, Any]]], impl: str, reps: int, metric: str
) -> tuple[list[float], dict[str, Any]]:
    """``metric`` of ``impl``, all three measured by the first metric asked for."""
    if not results:
        results.update(measure(impl, reps))
    return results[metric]


if __name__ == "__main__":
    main()
