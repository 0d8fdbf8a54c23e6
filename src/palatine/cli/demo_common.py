"""What both styles of the demo share: the model, the data streams' seeds, the report."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["IN_FEATURES", "HELD_OUT", "data_seed", "mlp", "header", "report", "verdict"]

IN_FEATURES = 16
HELD_OUT = 512  # held-out examples, alike on every rank


def data_seed(seed: int, rank: int | None) -> int:
    """The seed of ``rank``'s data stream (None: of the held-out set, alike everywhere)."""
    return seed * 1000 + (999_999 if rank is None else rank)


def mlp(hidden: int) -> Any:
    """The demo's model (and, smaller, its teacher): both styles build this one."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


def header(mesh: Any, args: argparse.Namespace, console: Any) -> None:
    """The demo's first line: the mesh it trains on."""
    n = len(mesh)
    hosts, per_host = mesh.size("host"), mesh.size("proc")
    console.print(
        f"mesh: {hosts} host(s) × {per_host} procs = {n} workers "
        f"(dims {dict(zip(mesh.names, mesh.sizes, strict=True))}), device {args.device}, "
        f"{args.style} style"
    )


def report(
    console: Any,
    args: argparse.Namespace,
    losses: tuple[float | None, float],
    first_eval: float,
    results: list[tuple[float, float]],
    train_s: float,
    t0: float,
) -> int:
    """The demo's last lines (both styles): the losses, the speed, whether the replicas
    agree (``results``: each rank's held-out loss and parameter checksum); its exit code."""
    n = len(results)
    held = results[0][0]
    sums = [c for _, c in results]
    agree = sum(1 for c in sums if abs(c - sums[0]) <= 1e-6 * max(1.0, abs(sums[0])))
    first_loss, last_loss = losses
    console.print(
        f"loss {first_loss:.3f} → {last_loss:.3f} (held-out {first_eval:.3f} → {held:.3f})"
    )
    console.print(
        f"{args.steps} steps in {train_s:.1f} s ({args.steps / train_s:.1f} steps/s, "
        f"{train_s / args.steps * 1000:.1f} ms/step); total {time.monotonic() - t0:.1f} s including start-up"
    )
    console.print(f"replicas identical on {agree}/{n} ranks")
    return verdict(held, first_eval, sums, agree, n)


def verdict(held: float, first: float, sums: list[float], agree: int, n: int) -> int:
    """The demo's exit code: 0 when the held-out loss fell to half and every replica
    ended identical; else 1, with the reason on stderr."""
    if held > first / 2:
        print(
            f"demo failed: held-out loss {held:.4f} did not fall to half of {first:.4f}",
            file=sys.stderr,
        )
        return 1
    if agree != n:
        print(f"demo failed: parameter checksums differ across ranks: {sums}", file=sys.stderr)
        return 1
    return 0
