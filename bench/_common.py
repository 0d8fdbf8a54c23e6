"""Small stdlib-only helpers shared by every benchmark program (palatine's and the peers').

A benchmark program measures one or more metrics and prints one JSON line per metric on
stdout (anything else it prints goes to stderr or is ignored by ``bench/run.py``)::

    {"metric": "1_1_actor_calls_sync", "impl": "palatine", "value": 12345.6,
     "unit": "calls/s", "higher_is_better": true, "reps": [..], "version": "0.1.0"}

``value`` is the median of ``reps``. A metric that could not be measured is printed with
``"value": null`` and an ``"error"`` string. Extra keys are allowed and kept by the harness.

Programs accept ``--only METRIC`` (repeatable, or comma separated) and ``--reps N``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

DEFAULT_REPS = 5
# Wall time one repetition of a throughput/latency loop aims for: reps x this ~ 2.5 s.
REP_SECONDS = 0.5


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="METRIC",
        help="run only this metric (repeatable, or comma separated)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=DEFAULT_REPS,
        help=f"repetitions per metric (default {DEFAULT_REPS}); the median is reported",
    )
    p.add_argument(
        "--rep-seconds",
        type=float,
        default=REP_SECONDS,
        help=f"target wall time of one repetition of a loop (default {REP_SECONDS})",
    )
    args = p.parse_args(argv)
    args.only = {m.strip() for item in args.only for m in item.split(",") if m.strip()}
    args.reps = max(1, args.reps)
    return args


def wanted(args: argparse.Namespace, metric: str) -> bool:
    return not args.only or metric in args.only


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def emit(
    metric: str,
    impl: str,
    value: float | None,
    unit: str,
    higher_is_better: bool,
    reps: list[float],
    version: str,
    **extra: Any,
) -> None:
    rec: dict[str, Any] = {
        "metric": metric,
        "impl": impl,
        "value": value,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "reps": reps,
        "version": version,
    }
    rec.update(extra)
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


def emit_error(
    metric: str, impl: str, unit: str, higher_is_better: bool, version: str, exc: BaseException
) -> None:
    traceback.print_exception(exc, file=sys.stderr)
    emit(
        metric,
        impl,
        None,
        unit,
        higher_is_better,
        [],
        version,
        error=f"{type(exc).__name__}: {exc}"[:500],
    )


def rate_rep(op: Callable[[], Any], seconds: float, ops_per_call: int = 1) -> float:
    """Run ``op`` repeatedly for about ``seconds``; return operations per second."""
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        op()
        n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n * ops_per_call / (now - t0)


def latency_rep_ms(op: Callable[[], Any], seconds: float) -> float:
    """Run ``op`` repeatedly for about ``seconds``; return the mean milliseconds per call."""
    return 1e3 / rate_rep(op, seconds)


def run_metric(
    args: argparse.Namespace,
    metric: str,
    impl: str,
    unit: str,
    higher_is_better: bool,
    version: str,
    measure: Callable[[], tuple[list[float], dict[str, Any]]],
) -> None:
    """Run ``measure`` (returning the per-rep values and extra keys) and print its line."""
    if not wanted(args, metric):
        return
    try:
        reps, extra = measure()
    except Exception as exc:  # noqa: BLE001 - one failing metric must not end the others
        emit_error(metric, impl, unit, higher_is_better, version, exc)
        return
    reps = [round(r, 6) for r in reps]
    emit(metric, impl, round(median(reps), 6), unit, higher_is_better, reps, version, **extra)
