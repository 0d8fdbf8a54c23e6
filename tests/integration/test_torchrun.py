"""``palatine torchrun`` runs a script written for torchrun, as torchrun would: the same
losses and final model as ``torchrun`` itself, a SIGKILLed rank named and the group
restarted from the script's checkpoint, a raising rank's traceback (and where the ranks
waiting for it are stuck), torchrun's exit status and failure summary."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

#: A typical DDP script: torch only, env://, gloo, a checkpoint every --ckpt-every steps
#: (resumed from when it exists), rank 0 prints the mean loss of every step. A rank may be
#: told to SIGKILL itself (first attempt only) or to raise, at a step.
DDP_SCRIPT = """
import argparse, os, signal
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--ckpt-every", type=int, default=4)
p.add_argument("--dir", required=True)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--raise-rank", type=int, default=-1)
p.add_argument("--at", type=int, default=-1)
a = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = os.path.join(a.dir, "ckpt.pt")
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]
    if rank == 0:
        print(f"resumed at step {start} (restart {restart})", flush=True)
for step in range(start, a.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"step {step} loss {mean.item() / world:.6f}", flush=True)
    if (step + 1) % a.ckpt_every == 0:
        if rank == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}
            torch.save(state, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
    if restart == 0 and rank == a.kill_rank and step == a.at:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == a.raise_rank and step == a.at:
        raise RuntimeError(f"rank {rank} gives up at step {step}")
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(a.dir, "final.pt"))
dist.barrier()
del model, opt  # (DDP's reducer holds the group: gloo aborts at exit when it outlives it)
dist.destroy_process_group()
"""

_LOSS = re.compile(r"step (\d+) loss (\S+)")


def run(
    command: list[str], tmp: Path, flags: tuple[str, ...] = (), args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run the DDP script on 4 ranks under ``command`` with launcher ``flags`` and script
    ``args`` (its checkpoints and final model in ``tmp``)."""
    script = tmp / "train.py"
    script.write_text(DDP_SCRIPT)
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    return subprocess.run(
        [*command, "--nproc-per-node", "4", *flags, str(script), "--dir", str(tmp), *args],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=tmp,
    )


def palatine_torchrun() -> list[str]:
    return [sys.executable, "-m", "palatine", "torchrun"]


def losses(text: str) -> dict[int, str]:
    """Step -> the loss rank 0 printed (a restart prints the resumed steps again)."""
    return {int(m.group(1)): m.group(2) for m in _LOSS.finditer(text)}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    """The script without faults under ``palatine torchrun``: its directory, its losses."""
    tmp = tmp_path_factory.mktemp("clean")
    out = run(palatine_torchrun(), tmp)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    seen = losses(out.stderr)  # (the ranks' output comes on stderr, behind their rank)
    assert sorted(seen) == list(range(12)), out.stderr[-4000:]
    assert "[mesh0 0] step 11 loss " in out.stderr
    return tmp, seen


def test_a_ddp_script_gives_torchruns_losses_and_final_model(
    clean_run: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    import torch

    torchrun = str(Path(sys.executable).parent / "torchrun")
    out = run([torchrun, "--standalone"], tmp_path)  # (a free port, not 29500)
    assert out.returncode == 0, out.stderr[-4000:]
    ours, seen = clean_run
    assert losses(out.stdout) == seen
    mine, theirs = torch.load(ours / "final.pt"), torch.load(tmp_path / "final.pt")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_sigkilled_rank_is_named_and_the_group_resumes_from_the_checkpoint(
    clean_run: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    flags, args = ("--max-restarts", "1"), ("--kill-rank", "2", "--at", "6")
    out = run(palatine_torchrun(), tmp_path, flags, args)
    assert out.returncode == 0, out.stderr[-4000:]
    err = out.stderr
    named = re.search(
        r"\[palatine torchrun\] rank 2 \(mesh0\[2\], pid (\d+), on \S+\): "
        r"killed by signal 9 \(SIGKILL\)",
        err,
    )
    assert named, err[-4000:]
    assert "restarting the group (1 of 1 restarts; TORCHELASTIC_RESTART_COUNT=1)" in err
    assert "[mesh1 0] resumed at step 4 (restart 1)" in err  # (a new group: world mesh1)
    _, seen = clean_run
    assert losses(err) == seen  # the steps after the checkpoint again, the same final loss


def test_a_rank_that_raises_exits_1_with_its_traceback_the_stuck_ranks_stacks_and_a_summary(
    tmp_path: Path,
) -> None:
    out = run(palatine_torchrun(), tmp_path, args=("--raise-rank", "1", "--at", "2"))
    assert out.returncode == 1, out.stderr[-4000:]
    err = out.stderr
    script = tmp_path / "train.py"
    # The rank's traceback as Python prints it for the script, behind its rank
    assert "[mesh0 1] Traceback (most recent call last):" in err, err[-4000:]
    assert f'[mesh0 1]   File "{script}", line ' in err
    assert "[mesh0 1] RuntimeError: rank 1 gives up at step 2" in err
    # The others wait for it in a collective: shown where, before they are stopped
    stuck = err.index("[palatine torchrun] ranks 0,2-3 still running when the group stopped")
    assert f'  File "{script}", line ' in err[stuck:], err[stuck:]
    # torchrun's summary: the program, no other failures, the root cause
    summary = err[err.index(f"{script} FAILED") :]
    assert "Failures:\n  <NO_OTHER_FAILURES>" in summary
    assert "  rank      : 1 (local_rank: 1)" in summary
    assert re.search(r"  exitcode  : 1 \(pid: \d+\)\n", summary), summary
    assert "  RuntimeError: rank 1 gives up at step 2" in summary


def test_a_rank_killed_with_no_restarts_left_exits_1_naming_the_signal(tmp_path: Path) -> None:
    out = run(palatine_torchrun(), tmp_path, args=("--kill-rank", "3", "--at", "1"))
    assert out.returncode == 1, out.stderr[-4000:]
    summary = out.stderr[out.stderr.index("FAILED") :]
    root = summary[summary.index("Root Cause") :]
    assert "  rank      : 3 (local_rank: 3)" in root, summary
    assert re.search(r"  exitcode  : -9 \(pid: \d+\) \(SIGKILL\)", root), summary
    assert "killed by signal 9 (SIGKILL)" in root


HANGS = """
import time
import torch.distributed as dist

dist.init_process_group("gloo")
print("ready", dist.get_rank(), flush=True)
if dist.get_rank() == 1:
    time.sleep(300)  # rank 1 hangs; the others wait for it in the barrier
dist.barrier()
"""


def test_a_hung_run_is_a_job_whose_stacks_show_the_stuck_rank_and_ctrl_c_stops_it(
    tmp_path: Path,
) -> None:
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    runtime = tmp_path / "run"  # (this test's job records and sockets only)
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    cmd = [*palatine_torchrun(), "--nproc-per-node", "3", str(script)]
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert launcher.stderr is not None
        ready = set()
        for line in launcher.stderr:  # (the pytest timeout bounds this)
            if "] ready " in line:
                ready.add(line.split()[-1])
            if len(ready) == 3:
                break
        ps = subprocess.run(
            [sys.executable, "-m", "palatine", "ps", "--json"],
            capture_output=True, text=True, env=env, timeout=30, check=True,
        )  # fmt: skip
        (job,) = [j["id"] for j in json.loads(ps.stdout)]
        assert job.startswith("torchrun-"), ps.stdout
        stacks = subprocess.run(
            [sys.executable, "-m", "palatine", "stacks", "--job", job],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert stacks.returncode == 0, stacks.stdout + stacks.stderr
        blocks = {b.split("\n", 1)[0]: b for b in stacks.stdout.split("=== ")[1:]}
        hung = blocks["rank 1 of mesh0 (1 proc)"]
        assert f'File "{script}", line 8 in <module>' in hung, stacks.stdout
        waiting = blocks["ranks 0,2 of mesh0 (2 procs)"]
        assert "in barrier" in waiting and f'File "{script}", line 9 in <module>' in waiting
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 128 + signal.SIGINT
        assert "[palatine torchrun] SIGINT: the group was stopped" in launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


#: Each rank writes torchrun's variables as it saw them and an all-reduce over the group.
ENV_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
keys = ["RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"]
seen = {k: os.environ.get(k) for k in keys}
seen["sum"] = total.item()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
"""


def test_local_nnodes_runs_one_group_whose_ranks_see_torchruns_node_variables(
    tmp_path: Path,
) -> None:
    # --nnodes 2 --nproc-per-node 2 on one machine: 4 ranks as torchrun numbers them over
    # 2 nodes of 2 (node-major), in one process group.
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    out = subprocess.run(
        [*palatine_torchrun(), "--nnodes", "2", "--nproc-per-node", "2", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        node, local = divmod(rank, 2)
        assert seen == {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "GROUP_RANK": str(node),
            "NODE_RANK": str(node),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "2",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "4",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "sum": 6.0,
        }, (rank, out.stderr[-3000:])
