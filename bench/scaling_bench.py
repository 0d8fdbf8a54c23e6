"""Scaling benchmarks for palatine: how the actor API's costs grow with procs and sizes.

Run with the project's interpreter::

    .venv/bin/python bench/scaling_bench.py [--only METRIC] [--reps N]

The goals ask that each metric grow "linear or better" with the number of procs (4 → 64)
and the message size (64 B → 64 MiB). Each metric below measures a series and reports
its worst *local exponent*: between two neighbouring points (x₁, t₁) and (x₂, t₂) of the
series, ``log(t₂ / t₁) / log(x₂ / x₁)``. 1 means the time grows in proportion to x
(linear), less than 1 better than linear, more than 1 worse. The value is the largest
exponent of any segment, so no part of the range may be worse than linear.

* ``scaling_cast_procs_exponent``: ``mesh.ping.call(i).get()`` (call every actor of the
  mesh, gather the replies, one operation at a time; ``cast_gather_4``'s shape) on meshes
  of 4, 8, 16, 32 and 64 real procs on this host (``this_host().spawn_procs``); time per
  operation at each size. Above ``cast_fanout`` procs (config, 8) the request travels
  down the cast tree, so the caller writes at most ``cast_fanout`` messages per cast and
  the tree is ⌈log_fanout(n)⌉ levels deep (``tree_depth``); the replies come back to the
  caller directly. All procs share this machine's cores, so the total work, and with it
  the time, grows at least linearly with n here: the target is the linear bound.
* ``scaling_msg_size_exponent``: one actor in another proc; ``call_one(payload).get()``
  with a ``bytes`` payload the endpoint returns (the size travels both ways), for 64 B,
  4 KiB, 256 KiB, 4 MiB and 64 MiB; time per call at each size, and the payload
  bandwidth (2 × size / time) in ``GBps``. The machine's own cost of moving bytes is not
  linear in the size (a copy that fits the CPU caches is an order of magnitude cheaper
  per byte), so each time is first divided by the time of one plain copy of the payload
  (``copy_ms``, ``call_in_copies``): the exponent is that of the call's time *relative
  to the machine's copy*, plus 1. 1 means the call grows exactly as moving the bytes
  does; the raw exponents are shown too (``local_exponents_raw``, and the copy's own,
  ``local_exponents_of_copy``).

Repetitions: every point is measured ``--reps`` times; each repetition's series gives
one worst exponent (``reps``), and the value is their median. The extras show the
series of medians and its local exponents.
"""

from __future__ import annotations

import math
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, parse_args, rate_rep, run_metric  # noqa: E402

from palatine import Actor, config, endpoint, this_host  # noqa: E402

IMPL = "palatine"
VERSION = metadata.version("palatine")

PROC_COUNTS = (4, 8, 16, 32, 64)
SIZES = (64, 4 << 10, 256 << 10, 4 << 20, 64 << 20)
WARMUP_OPS = 20
STOP_TIMEOUT_S = 60.0


class Echo(Actor):
    @endpoint
    def ping(self, x: Any) -> Any:
        return x


def log(msg: str) -> None:
    print(f"[scaling_bench] {msg}", file=sys.stderr, flush=True)


def worst_exponent(xs: tuple[int, ...], ts: list[float]) -> tuple[float, list[float]]:
    """The largest local exponent of the series ``(xs[i], ts[i])``, and every one of them."""
    local = [math.log(ts[i + 1] / ts[i]) / math.log(xs[i + 1] / xs[i]) for i in range(len(xs) - 1)]
    return max(local), local


def _per_op_ms(op: Any, seconds: float) -> float:
    """Mean milliseconds per ``op()`` over about ``seconds`` (at least 3 operations)."""
    t0 = time.perf_counter()
    for _ in range(3):
        op()
    first = time.perf_counter() - t0
    if first >= seconds:
        return first / 3 * 1e3
    return 1e3 / rate_rep(op, seconds - first)


def _series(
    points: tuple[int, ...], reps: int, measure_point: Any
) -> tuple[list[float], list[list[float]]]:
    """``measure_point(x, reps)`` → that point's ``reps`` times (ms); the medians per point
    and the times as ``[rep][point]``."""
    by_point = [measure_point(x, reps) for x in points]
    medians = [median(times) for times in by_point]
    by_rep = [[by_point[p][r] for p in range(len(points))] for r in range(reps)]
    return medians, by_rep


def _result(
    points: tuple[int, ...], medians: list[float], by_rep: list[list[float]]
) -> tuple[list[float], list[float]]:
    """Each repetition's worst exponent (the metric is their median) and the local
    exponents of the series of medians (shown beside it)."""
    return [worst_exponent(points, times)[0] for times in by_rep], worst_exponent(points, medians)[
        1
    ]


def bench_cast_procs(args: Any) -> tuple[list[float], dict[str, Any]]:
    fanout = config.get().cast_fanout

    def point(n: int, reps: int) -> list[float]:
        t0 = time.perf_counter()
        procs = this_host().spawn_procs(per_host={"procs": n})
        try:
            mesh = procs.spawn(f"scale{n}", Echo)
            for i in range(WARMUP_OPS):
                mesh.ping.call(i).get()
            log(f"{n} procs up in {time.perf_counter() - t0:.1f} s")
            return [
                _per_op_ms(lambda: mesh.ping.call(1).get(), args.rep_seconds) for _ in range(reps)
            ]
        finally:
            procs.stop().get(timeout=STOP_TIMEOUT_S)

    medians, by_rep = _series(PROC_COUNTS, args.reps, point)
    rep_values, local = _result(PROC_COUNTS, medians, by_rep)
    extra = {
        "proc_counts": list(PROC_COUNTS),
        "ms_per_op": [round(m, 4) for m in medians],
        "local_exponents": [round(e, 3) for e in local],
        "cast_fanout": fanout,
        "tree_depth": [max(1, math.ceil(round(math.log(n, fanout), 9))) for n in PROC_COUNTS],
    }
    return rep_values, extra


def _copy_ms(size: int) -> float:
    """This machine's cost of moving ``size`` bytes: one copy into a reused buffer (ms,
    best of several). It is far from linear itself: a copy that fits the CPU caches
    runs an order of magnitude faster per byte than one that does not."""
    src = b"x" * size
    dst = bytearray(size)
    n = max(3, min(1000, (64 << 20) // size))
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            dst[:] = src
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e3


def bench_msg_size(args: Any) -> tuple[list[float], dict[str, Any]]:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        one = procs.spawn("sizes", Echo).slice(procs=0)
        for i in range(WARMUP_OPS):
            one.ping.call_one(i).get()

        def point(size: int, reps: int) -> list[float]:
            payload = b"x" * size
            one.ping.call_one(payload).get()  # warm this size's buffers
            return [
                _per_op_ms(lambda: one.ping.call_one(payload).get(), args.rep_seconds)
                for _ in range(reps)
            ]

        medians, by_rep = _series(SIZES, args.reps, point)
    finally:
        procs.stop().get(timeout=STOP_TIMEOUT_S)
    copies = [_copy_ms(s) for s in SIZES]
    # In copies of the payload on this machine: the exponent of that, plus 1, is how the
    # call's time grows compared with the machine's own cost of moving the bytes.
    rep_values, _ = _result(
        SIZES,
        [1.0] * len(SIZES),
        [[t / c for t, c in zip(times, copies, strict=True)] for times in by_rep],
    )
    rep_values = [v + 1 for v in rep_values]
    _, raw_local = worst_exponent(SIZES, medians)
    _, copy_local = worst_exponent(SIZES, copies)
    _, rel_local = worst_exponent(SIZES, [t / c for t, c in zip(medians, copies, strict=True)])
    extra = {
        "bytes": list(SIZES),
        "ms_per_call": [round(m, 4) for m in medians],
        "GBps": [round(2 * s / (m * 1e-3) / 1e9, 3) for s, m in zip(SIZES, medians, strict=True)],
        "copy_ms": [round(c, 5) for c in copies],
        "call_in_copies": [round(m / c, 1) for m, c in zip(medians, copies, strict=True)],
        "local_exponents_raw": [round(e, 3) for e in raw_local],
        "local_exponents_of_copy": [round(e, 3) for e in copy_local],
        "local_exponents": [round(e + 1, 3) for e in rel_local],
    }
    return rep_values, extra


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    run_metric(
        args,
        "scaling_cast_procs_exponent",
        IMPL,
        "exponent",
        False,
        VERSION,
        lambda: bench_cast_procs(args),
    )
    run_metric(
        args,
        "scaling_msg_size_exponent",
        IMPL,
        "exponent",
        False,
        VERSION,
        lambda: bench_msg_size(args),
    )


if __name__ == "__main__":
    main()
