"""Weight sync for RL post-training: a trainer publishes its weights as RDMABuffers once,
and after each training step the generators pull them, the trainer's actors taking no
part in the transfers.

Run: python examples/weight_sync.py

The trainer's parameters are registered where they are (`RDMABuffer(p.detach())`):
registering moves a CPU tensor's storage into shared memory, so the optimizer's
in-place updates are what every later read sees. A generator keeps the buffers it was
handed and reads each one into its own copy of the model: on one host by shared
memory, across hosts from the trainer proc's buffer server.
"""

from __future__ import annotations

import torch

from palatine import Actor, endpoint, this_host
from palatine.rdma import RDMABuffer

STEPS = 5


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


class Trainer(Actor):
    """Fits y = sin(3x) with SGD; its weights are published once, updated in place."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.x = torch.linspace(-1, 1, 64).unsqueeze(1)
        self.y = torch.sin(3 * self.x)

    @endpoint
    def publish(self) -> dict[str, RDMABuffer]:
        return {name: RDMABuffer(p.detach()) for name, p in self.model.named_parameters()}

    @endpoint
    def train_step(self) -> float:
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return loss.item()

    @endpoint
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x)


class Generator(Actor):
    """Holds its own model (different initial weights) and pulls the trainer's."""

    def __init__(self) -> None:
        self.model = make_model()
        self.buffers: dict[str, RDMABuffer] = {}

    @endpoint
    def attach(self, buffers: dict[str, RDMABuffer]) -> None:
        self.buffers = buffers

    @endpoint
    async def pull(self) -> int:
        params = dict(self.model.named_parameters())
        pulled = 0
        for name, buf in self.buffers.items():
            await buf.read_into(params[name].detach())
            pulled += buf.size()
        return pulled

    @endpoint
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x)


def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 4})
    trainer = procs.slice(procs=0).spawn("trainer", Trainer)
    generators = procs.slice(procs=slice(1, 4)).spawn("generator", Generator)
    buffers = trainer.publish.call_one().get()
    generators.attach.call(buffers).get()
    probe = torch.linspace(-1, 1, 7).unsqueeze(1)
    for step in range(STEPS):
        loss = trainer.train_step.call_one().get()
        pulled = generators.pull.call().get().values()
        want = trainer.generate.call_one(probe).get()
        got = generators.generate.call(probe).get().values()
        same = all(torch.equal(g, want) for g in got)
        print(f"step {step}: loss {loss:.4f}; {len(got)} generators match the trainer: {same}")
    print(f"each pull: {len(buffers)} buffers, {pulled[0]} bytes")
    procs.stop().get()


if __name__ == "__main__":
    main()
