"""The training script of bench/spmd_bench.py, run unchanged under ``torchrun`` and under
``palatine torchrun``: a plain torchrun script (torch only, env://, gloo, DDP).

The demo's MLP shape (hidden 128, batch 64 per rank, SGD), one all-reduce of the
gradients per step (DDP), a checkpoint by rank 0 after every step, resumed from after a
restart. Rank 0 appends ``<event> <step> <wall time>`` lines to ``--events`` (``step``
when a step has completed; ``kill`` just before rank ``--kill-rank`` SIGKILLs itself at
step ``--kill-at`` of the first attempt), so the timings do not depend on how either
launcher forwards output. Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``)
it keys the process group's store by attempt, as a torchrun script that restarts must.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--dir", required=True)
p.add_argument("--events", required=True)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--kill-delay", type=float, default=0.0)
a = p.parse_args()

restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
    # torchrun's agent keeps one store across restarts, where a restarted rank reads the
    # gloo addresses of the first attempt's ranks: each attempt gets keys of its own.
    store = dist.PrefixStore(
        f"attempt{restart}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False),
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
else:
    dist.init_process_group("gloo")  # env://
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
ckpt = os.path.join(a.dir, "ckpt.pt")
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]


def event(what: str, step: int) -> None:
    with open(a.events, "a") as f:
        f.write(f"{what} {step} {time.time()}\n")


for step in range(start, a.steps):
    if restart == 0 and rank == a.kill_rank and step == a.kill_at:
        time.sleep(a.kill_delay)  # (the others wait in the step's all-reduce meanwhile)
        with open(a.events, "a") as f:  # (any rank may write it: the file is shared)
            f.write(f"kill {step} {time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 32, generator=g)
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}
        torch.save(state, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
        event("step", step)
dist.barrier()
del model, opt  # (DDP's reducer holds the group: gloo aborts at exit when it outlives it)
dist.destroy_process_group()
