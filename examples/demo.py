"""The demo as a readable script: data-parallel training with gradients all-reduced by
the workers (``palatine demo`` runs the same thing with a progress bar).

Run: python examples/demo.py
"""

import torch
import torch.distributed as dist

from palatine import fetch, local_mesh, remote, worker_info


def init_state(pg, seed: int = 0, hidden: int = 128, batch: int = 64):
    torch.manual_seed(seed)  # the same seed on every rank: identical replicas
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    )
    teacher = torch.nn.Linear(16, 1).requires_grad_(False)  # defines the regression target
    gen = torch.Generator().manual_seed(seed * 1000 + worker_info()["rank"])  # own data per rank
    return {
        "model": model,
        "teacher": teacher,
        "gen": gen,
        "pg": pg,
        "batch": batch,
        "opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
    }


def train_step(state) -> float:
    x = torch.randn(state["batch"], 16, generator=state["gen"])
    loss = torch.nn.functional.mse_loss(state["model"](x), state["teacher"](x))
    state["opt"].zero_grad()
    loss.backward()
    params = list(state["model"].parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
    dist.all_reduce(flat, group=state["pg"])  # one all-reduce per step
    flat /= dist.get_world_size(state["pg"])
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    state["opt"].step()
    return float(flat[-1])


def main() -> None:
    with local_mesh(hosts=1, procs_per_host=4) as mesh:
        state = remote(init_state)(mesh.process_group())
        step = remote(train_step, mutates=("state",))
        for i in range(1, 201):
            loss = step(state)  # returns at once; the workers run ahead
            if i % 50 == 0:
                print(f"step {i}: loss {fetch(loss).result():.4f}")


if __name__ == "__main__":
    main()
