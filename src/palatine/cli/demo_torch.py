"""The demo in plain torch (``palatine demo --style torch``): the same data-parallel training
of the same MLP as the function-style demo, written as a single-node torch program on
mesh tensors.

The model, the teacher and the optimizer are built under ``mesh.activate()``, so their
parameters live on every rank; the forward, the backward and ``optimizer.step()`` are
plain torch on the client, each op run by the workers. Gradients are averaged over the
whole mesh as the backward produces them: `palatine.grad_generator` yields each one in
execution order, and its ``reduce_`` is issued before the rest of the backward, so the
reduction overlaps it. Only the data comes from remote functions: each rank draws its own
batches from its own generator (the same streams as the function-style demo's).

The same seed gives the same initial model (the workers' RNG is seeded alike, and the
layers draw their weights in the same order), the same data and the same updates, hence
the same held-out loss as ``palatine demo``.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from palatine.cli.demo_common import HELD_OUT, IN_FEATURES, data_seed, mlp, report

__all__ = ["data_stream", "next_batch", "held_out", "run"]


# --------------------------------------------------------------------------- worker side


def data_stream(seed: int) -> Any:
    """This rank's batch generator (held on the worker by ref)."""
    import torch

    from palatine.tensor.worker import worker_info

    return torch.Generator().manual_seed(data_seed(seed, worker_info()["rank"]))


def next_batch(gen: Any, batch: int) -> Any:
    """This rank's next batch of inputs."""
    import torch

    return torch.randn(batch, IN_FEATURES, generator=gen)


def held_out(seed: int) -> Any:
    """The held-out inputs, alike on every rank."""
    import torch

    return torch.randn(HELD_OUT, IN_FEATURES, generator=torch.Generator().manual_seed(
        data_seed(seed, None)))  # fmt: skip


# --------------------------------------------------------------------------- client side


def run(mesh: Any, args: argparse.Namespace, console: Any, t0: float) -> int:
    """Build, train and evaluate on ``mesh``; print as the function-style demo does. The
    exit code: 0 when the held-out loss halved and every replica ends identical."""
    import torch
    import torch.nn.functional as F

    import palatine
    from palatine import grad_generator, inspect, reduce, reduce_, remote

    n = len(mesh)
    batch = remote(next_batch, propagate=lambda gen, b: torch.empty(b, IN_FEATURES))
    with mesh.activate():
        palatine.random.set_manual_seed_remote(args.seed)  # every rank alike: identical replicas
        model = mlp(args.hidden)
        teacher = mlp(32)
        for p in teacher.parameters():
            p.requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        params = list(model.parameters())
        backward_order = list(reversed(params))  # the order the backward produces them
        gen = remote(data_stream)(args.seed)
        x_held = remote(held_out, propagate=lambda s: torch.empty(HELD_OUT, IN_FEATURES))(args.seed)
        y_held = teacher(x_held)

        def evaluate() -> list[tuple[float, float]]:
            """Each rank's held-out loss and parameter checksum."""
            with torch.no_grad():
                loss = F.mse_loss(model(x_held), y_held)
                checksum = sum(p.double().sum() for p in params)
            return [
                (float(inspect(loss, shard=r)), float(inspect(checksum, shard=r))) for r in range(n)
            ]

        first_eval = evaluate()[0][0]
        console.print(f"mesh ready in {time.monotonic() - t0:.1f} s; model built on the mesh")
        first_loss = last_loss = math.nan
        t_train = time.monotonic()
        for step in range(1, args.steps + 1):
            x = batch(gen, args.batch_size)
            loss = F.mse_loss(model(x), teacher(x))
            opt.zero_grad()
            for p, g in zip(backward_order, grad_generator(loss, backward_order), strict=True):
                reduce_(g, (), "avg")  # issued before the rest of the backward: overlapped
                p.grad = g
            opt.step()
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                last_loss = float(inspect(reduce(loss, (), "avg")))
                if step == 1:
                    first_loss = last_loss
                if step % max(1, args.steps // 10) == 0:
                    print(f"step {step}/{args.steps} loss {last_loss:.4f}", flush=True)
        train_s = time.monotonic() - t_train
        results = evaluate()
    return report(console, args, (first_loss, last_loss), first_eval, results, train_s, t0)
