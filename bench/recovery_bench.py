"""Recovering from a lost rank: palatine's `DeviceMesh.recover` against torchrun's restart.

Run with the project's interpreter::

    .venv/bin/python bench/recovery_bench.py [--only recover_after_sigkill_s] [--reps N]

The same job on both sides: the demo's data-parallel MLP (``palatine.cli.demo``: same
model, data, all-reduce per step) on 4 CPU ranks with gloo, SIGKILL of rank 2 from
outside once training runs, and the time from the kill until the first training step
after it has completed on every rank.

* palatine (``impl: palatine``): ``local_mesh(1, 4)``; the client trains, and when the
  kill surfaces as a `palatine.DeviceException` it does what the demo does:
  ``mesh.recover()``, a new process group, ``state.restore(init_state, ...)`` on the new
  rank, its data position, ``resync(state)`` from a survivor, then the step again. The
  value ends when that step's loss is fetched. Each repetition kills rank 2 of the same
  mesh again (a rank lost repeatedly); the extras give the part in ``recover()`` itself.
* torchrun (``impl: torchrun``, ``torch.distributed.run --max-restarts=1``): the same
  model and step in a plain script; rank 0 saves a checkpoint (model and optimizer)
  after every step, as such jobs must to survive a restart; after a restart every rank
  loads it. torchrun notices the death, stops the other ranks, starts all 4 again; the
  value ends when the first step after the restart has completed (the time a rank writes
  down). One fresh torchrun per repetition.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_args, run_metric

from palatine import DeviceException, fetch, local_mesh, remote
from palatine.cli import demo

METRIC = "recover_after_sigkill_s"
VICTIM = 2
SEED, HIDDEN, LR, BATCH = 0, 128, 0.05, 64
STEPS_BEFORE = 20  # steps trained before each kill


def log(msg: str) -> None:
    print(f"[recovery_bench] {msg}", file=sys.stderr, flush=True)


def _pid() -> int:
    return os.getpid()


# ------------------------------------------------------------------------------ palatine


def measure_palatine(reps: int) -> tuple[list[float], dict[str, Any]]:
    values: list[float] = []
    in_recover: list[float] = []
    with local_mesh(1, 4) as mesh:
        with mesh.activate():
            state = remote(demo.init_state)(mesh.process_group(), SEED, HIDDEN, LR, BATCH)
            step = remote(demo.train_step, mutates=("state",))
            for _ in range(reps):
                for _ in range(STEPS_BEFORE):
                    loss = step(state)
                fetch(loss).result(timeout=60)
                pid = fetch(remote(_pid)(), shard=VICTIM).result(timeout=60)
                t_kill = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                while True:  # train on until the loss surfaces
                    try:
                        fetch(step(state)).result(timeout=60)
                    except DeviceException:
                        break
                rec = mesh.recover()
                in_recover.append(rec.seconds)
                demo.rebuild(mesh, state, rec.ranks, SEED, HIDDEN, LR, BATCH)
                fetch(step(state)).result(timeout=60)
                values.append(time.monotonic() - t_kill)
                log(f"palatine: {values[-1]:.2f} s (recover() {rec.seconds:.2f} s)")
    return values, {
        "victim": VICTIM,
        "procs": 4,
        "recover_call_s": [round(x, 3) for x in in_recover],
    }


# ------------------------------------------------------------------------------ torchrun

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist
    from palatine.cli import demo

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun's agent keeps one store across restarts; a restarted rank could read a
    # dead rank's gloo address from the first attempt, so each attempt has its own keys.
    store = dist.PrefixStore(
        f"attempt{restart}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)  # demo.init_state, with torch's rank instead of palatine's
    model, teacher = demo.mlp(128), demo.mlp(32)
    for p in teacher.parameters():
        p.requires_grad_(False)
    state = {
        "model": model,
        "teacher": teacher,
        "opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        "gen": torch.Generator().manual_seed(rank),
        "pg": dist.group.WORLD,
        "world": dist.get_world_size(),
        "batch": 64,
        "steps": 0,
    }
    ckpt = os.path.join(out, "ckpt.pt")
    if restart and os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=False)
        state["model"].load_state_dict(saved["model"])
        state["opt"].load_state_dict(saved["opt"])
        for _ in range(saved["steps"]):
            torch.randn(64, demo.IN_FEATURES, generator=state["gen"])
        state["steps"] = saved["steps"]
    with open(os.path.join(out, f"pid{rank}.{restart}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        demo.train_step(state)
        if rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": state["model"].state_dict(), "opt": state["opt"].state_dict(),
                        "steps": state["steps"]}, tmp)
            os.replace(tmp, ckpt)
        if restart:
            with open(os.path.join(out, f"first{rank}"), "w") as f:
                f.write(repr(time.time()))
            dist.barrier()
            break
        with open(os.path.join(out, f"steps{rank}"), "w") as f:
            f.write(str(state["steps"]))
    dist.destroy_process_group()
    """
)


def _wait_file(path: Path, timeout_s: float, check: Any = None) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
            if text and (check is None or check(text)):
                return text
        except OSError:
            pass
        time.sleep(0.005)
    raise TimeoutError(f"{path.name} not written within {timeout_s} s")


def measure_torchrun(reps: int) -> tuple[list[float], dict[str, Any]]:
    values: list[float] = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d)
            script = out / "train.py"
            script.write_text(TRAIN)
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                "127.0.0.1:0", str(script), str(out),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            errors = out / "torchrun.err"
            with open(errors, "wb") as err:
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
            try:
                _wait_file(out / "steps0", 120, lambda t: int(t) >= STEPS_BEFORE)
                pid = int(_wait_file(out / f"pid{VICTIM}.0", 30))
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                try:
                    firsts = [float(_wait_file(out / f"first{r}", 120)) for r in range(4)]
                except TimeoutError:
                    said = [
                        line.strip()
                        for line in errors.read_text(errors="replace").splitlines()
                        if "Error" in line and "failed" in line
                    ]
                    why = said[-1][-300:] if said else "no error printed"
                    raise RuntimeError(
                        f"the restarted job completed no step within 120 s of the kill: {why}"
                    ) from None
                values.append(max(firsts) - t_kill)
                log(f"torchrun: {values[-1]:.2f} s")
                proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    return values, {"victim": VICTIM, "procs": 4, "max_restarts": 1, "checkpoint": "every step"}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    reps = max(3, args.reps or 3)
    run_metric(
        args, METRIC, "palatine", "s", False, metadata.version("palatine"),
        lambda: measure_palatine(reps),
    )  # fmt: skip
    run_metric(
        args, METRIC, "torchrun", "s", False, metadata.version("torch"),
        lambda: measure_torchrun(reps),
    )  # fmt: skip


if __name__ == "__main__":
    main()
