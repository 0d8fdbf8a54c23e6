"""The tensor-engine benchmarks' one program shape, shared by palatine and Monarch.

`run` is called by bench/tensor_bench.py (palatine) and bench/peers/monarch_tensors.py
(torchmonarch), each with a `Framework`: how to open its 2-proc CPU mesh and close it, its
``inspect`` and its mesh tensor type. Everything else (the loop, the check of the value,
warm-up, calibration, repetitions) is here once, so both sides run the same program. Needs
torch and ``bench/_common.py``; nothing of either framework, so it runs under both
interpreters. Metrics:

* ``tensor_ops_per_s``: ``with mesh.activate(): x = torch.zeros(64, 64)`` (float32), then
  N times ``x = x + 1``, then one ``inspect(x.sum())``, which must equal 64 * 64 * N. The
  value is N / (first ``x + 1`` issued → ``inspect`` returned): the whole loop, so the
  operations are counted only once they have run. One short round first (warm-up), then
  a timed calibration round sizes N so a repetition takes at least
  max(1 s, 2 x ``--rep-seconds``); a repetition that comes in shorter (the machine sped
  up) is dropped and redone with a larger N. The extras give N (``ops_per_rep``) and each
  repetition's seconds (``rep_s``).
* ``tensor_fetch_roundtrip_ms``: on the same mesh, ``x = torch.zeros(8)``, then
  ``inspect(x + i)`` one at a time (one operation on every rank, then its value from
  rank 0 back to the caller), each checked; mean milliseconds per round trip over one
  repetition of ``--rep-seconds``, median of the repetitions. The counterpart of
  ``fetch_roundtrip_ms`` (bench/controller_bench.py) with a mesh tensor instead of a
  remote call.

The median of ``--reps`` repetitions (default 5) is reported for each.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _common import emit_error, parse_args, rate_rep, run_metric, wanted

SIDE = 64  # x is SIDE x SIDE
PROCS = 2
WARMUP_OPS = 50
CALIBRATE_OPS = 200
MIN_REP_S = 1.0
MAX_OPS = 4_000_000  # every element stays an exact float32 integer (< 2**24)
MAX_REDOS = 3  # repetitions that came in too short and were redone, at most
FETCH_WARMUP = 20
FETCH_SIZE = 8

# metric -> (unit, higher is better)
METRICS = {"tensor_ops_per_s": ("ops/s", True), "tensor_fetch_roundtrip_ms": ("ms", False)}


@dataclass(frozen=True)
class Framework:
    """One implementation's side of the program."""

    impl: str  # the results' name for it ("palatine", "torchmonarch")
    version: str
    open_mesh: Callable[[], Any]  # a 2-proc CPU mesh with .activate(), on this host
    close_mesh: Callable[[Any], None]
    inspect: Callable[[Any], Any]  # a mesh tensor → its local torch tensor, from rank 0
    tensor_type: type  # what torch factories return under mesh.activate()
    mesh_text: str  # how the mesh was made, for the extras


def log(msg: str) -> None:
    print(f"[tensor_shape] {msg}", file=sys.stderr, flush=True)


def _mesh_zeros(fw: Framework, *shape: int) -> Any:
    """``torch.zeros(*shape)`` inside an active mesh, checked to be a mesh tensor.

    A local torch tensor here would mean the framework did not take the factory over, and
    the loop would measure local torch instead of the mesh: refused.
    """
    x = torch.zeros(*shape)
    if not isinstance(x, fw.tensor_type):
        raise TypeError(
            f"{fw.impl}: torch.zeros under mesh.activate() returned {type(x).__module__}."
            f"{type(x).__qualname__}, not {fw.tensor_type.__module__}."
            f"{fw.tensor_type.__qualname__}: no mesh tensor to measure"
        )
    return x


def _ops_round(fw: Framework, n: int) -> float:
    """x = zeros; n times x = x + 1; inspect(x.sum()) checked; seconds from the first op."""
    x = _mesh_zeros(fw, SIDE, SIDE)
    t0 = time.perf_counter()
    for _ in range(n):
        x = x + 1
    got = fw.inspect(x.sum()).tolist()  # (no torch op: Monarch refuses local ones in a mesh)
    seconds = time.perf_counter() - t0
    want = float(SIDE * SIDE * n)
    # float32 holds every element (n < 2**24) exactly; the sum's rounding stays far below this
    if not math.isclose(got, want, rel_tol=1e-6):
        raise AssertionError(f"{fw.impl}: inspect(x.sum()) after {n} ops is {got}, not {want}")
    return seconds


def _ops_per_s(fw: Framework, reps: int, target_s: float) -> tuple[list[float], dict[str, Any]]:
    _ops_round(fw, WARMUP_OPS)
    rate = CALIBRATE_OPS / _ops_round(fw, CALIBRATE_OPS)
    n = min(MAX_OPS, max(CALIBRATE_OPS, math.ceil(rate * target_s * 1.25)))
    log(f"{fw.impl}: calibrated {rate:.0f} ops/s; {n} ops per repetition")
    values: list[float] = []
    rep_s: list[float] = []
    redone = 0
    while len(values) < reps:
        seconds = _ops_round(fw, n)
        if seconds < target_s and n < MAX_OPS and redone < MAX_REDOS:
            redone += 1
            n = min(MAX_OPS, math.ceil(n * target_s / seconds * 1.25))
            log(f"{fw.impl}: a repetition took {seconds:.2f} s; redone with {n} ops")
            values.clear()  # every kept repetition has the same N
            rep_s.clear()
            continue
        values.append(n / seconds)
        rep_s.append(round(seconds, 3))
    return values, {
        "ops_per_rep": n,
        "rep_s": rep_s,
        "shape": [SIDE, SIDE],
        "procs": PROCS,
        "mesh": fw.mesh_text,
    }


def _fetch_ms(fw: Framework, reps: int, seconds: float) -> tuple[list[float], dict[str, Any]]:
    x = _mesh_zeros(fw, FETCH_SIZE)
    count = [0]

    def roundtrip() -> None:
        i = count[0] = count[0] + 1
        got = fw.inspect(x + i).tolist()
        if got[0] != i:
            raise AssertionError(f"{fw.impl}: inspect(x + {i})[0] is {got[0]}, not {i}")

    for _ in range(FETCH_WARMUP):
        roundtrip()
    values = [1e3 / rate_rep(roundtrip, seconds) for _ in range(reps)]
    return values, {"shape": [FETCH_SIZE], "procs": PROCS, "mesh": fw.mesh_text}


def unavailable(description: str, impl: str, version: str, exc: BaseException) -> int:
    """Print every wanted metric as an error naming ``exc``; the program's exit status."""
    args = parse_args(description)
    for metric, (unit, hib) in METRICS.items():
        if wanted(args, metric):
            emit_error(metric, impl, unit, hib, version, exc)
    return 1


def run(description: str, fw: Framework) -> int:
    """Measure both tensor metrics for one framework on one 2-proc mesh; the exit status."""
    args = parse_args(description)
    if not any(wanted(args, m) for m in METRICS):
        return 0
    target_s = max(MIN_REP_S, 2 * args.rep_seconds)
    try:
        mesh = fw.open_mesh()
    except Exception as exc:  # noqa: BLE001 - reported as each metric's error
        return unavailable(description, fw.impl, fw.version, exc)
    measures: dict[str, Callable[[], tuple[list[float], dict[str, Any]]]] = {
        "tensor_ops_per_s": lambda: _ops_per_s(fw, args.reps, target_s),
        "tensor_fetch_roundtrip_ms": lambda: _fetch_ms(fw, args.reps, args.rep_seconds),
    }
    try:
        with mesh.activate():
            for metric, (unit, hib) in METRICS.items():
                run_metric(args, metric, fw.impl, unit, hib, fw.version, measures[metric])
    finally:
        fw.close_mesh(mesh)
    return 0
