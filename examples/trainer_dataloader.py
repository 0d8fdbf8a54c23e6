"""A trainer mesh fed by a dataloader mesh, the shape of Monarch's getting-started
example: each trainer asks its dataloader for the next batch with a blocking call from
a plain ``def`` endpoint, takes an SGD step on a linear model, and the losses are summed
over the mesh with an `Accumulator`.

Run: python examples/trainer_dataloader.py
"""

import operator
import random

from palatine import Accumulator, Actor, ActorMesh, current_rank, endpoint, this_host


class DataLoader(Actor):
    """Endless batches of ``(x, y)`` with ``y = 3x + 1`` plus noise, seeded by rank."""

    def __init__(self, batch: int = 32) -> None:
        self.rng = random.Random(current_rank().rank)  # type: ignore[attr-defined]
        self.batch = batch

    @endpoint
    def next_batch(self) -> list[tuple[float, float]]:
        xs = [self.rng.uniform(-1, 1) for _ in range(self.batch)]
        return [(x, 3 * x + 1 + self.rng.gauss(0, 0.01)) for x in xs]


class Trainer(Actor):
    def __init__(self, loaders: ActorMesh, lr: float = 0.5) -> None:
        rank = current_rank().rank  # type: ignore[attr-defined]
        self.loader = loaders.slice(procs=rank)  # this trainer's own dataloader
        self.w = self.b = 0.0
        self.lr = lr

    @endpoint
    def step(self) -> float:
        batch = self.loader.next_batch.call_one().get()  # waits; the proc serves on
        n = len(batch)
        errors = [(self.w * x + self.b - y, x) for x, y in batch]
        self.w -= self.lr * 2 * sum(e * x for e, x in errors) / n
        self.b -= self.lr * 2 * sum(e for e, _ in errors) / n
        return sum(e * e for e, _ in errors) / n

    @endpoint
    def weights(self) -> tuple[float, float]:
        return round(self.w, 2), round(self.b, 2)


def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 2})
    loaders = procs.spawn("loader", DataLoader)
    trainers = procs.spawn("trainer", Trainer, loaders)
    total_loss = Accumulator(trainers.step, 0.0, operator.add)
    for step in range(30):
        loss = total_loss.accumulate().get()
        if step % 10 == 0:
            print(f"step {step}: summed loss {loss:.4f}")
    print(f"final summed loss {loss:.4f}")
    print("weights:", trainers.weights.call().get().values())
    procs.stop().get()


if __name__ == "__main__":
    main()
