"""The actor benchmarks' one program shape, shared by palatine and Monarch (same API).

`run` is called by bench/actor_calls.py (palatine) and bench/peers/monarch_actors.py
(torchmonarch) with their own ``Echo`` actor and ``this_host``; stdlib only, so it runs
under the peers' interpreter too. Metrics:

* ``1_1_actor_calls_sync``: a 1-proc mesh; the caller does ``call_one(i).get()`` one at a time.
* ``1_1_actor_calls_async``: same actor; 1,000 ``call_one`` futures issued, then all gathered.
* ``cast_gather_4``: a 4-proc mesh; ``mesh.ping.call(i).get()`` one at a time (ms per op).
* ``spawn_4_to_first_call_s``: ``spawn_procs`` (4 procs) + ``spawn`` + the first ``call().get()``.
* ``detect_sigkill_s``: a pending call to rank 1, rank 1's process SIGKILLed; time until
  that call raises in the caller (capped at 30 s).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from _common import parse_args, rate_rep, run_metric

IN_FLIGHT = 1000
DETECT_CAP_S = 30.0
WARMUP_CALLS = 50

_fw: dict[str, Any] = {}


def _spawn(n: int, name: str) -> tuple[Any, Any]:
    procs = _fw["this_host"]().spawn_procs(per_host={"procs": n})
    mesh = procs.spawn(name, _fw["echo"])
    return procs, mesh


def _stop(procs: Any) -> None:
    try:
        procs.stop().get(timeout=20)
    except Exception as exc:  # noqa: BLE001 - a broken mesh (after a kill) may refuse a clean stop
        print(f"stop: {type(exc).__name__}: {exc}", file=sys.stderr)


def run(
    description: str, impl: str, version: str, echo: Any, this_host: Any, fault_times: list[float]
) -> None:
    """Measure every actor metric for one framework (its ``Echo`` actor and ``this_host``).

    ``fault_times`` collects the times the framework's unhandled-fault hook fired.
    """
    _fw["this_host"], _fw["echo"] = this_host, echo
    args = parse_args(description)
    secs = args.rep_seconds

    one_metrics = {"1_1_actor_calls_sync", "1_1_actor_calls_async"}
    if not args.only or args.only & one_metrics:
        procs, mesh = _spawn(1, "echo1")
        one = mesh.slice(procs=0)
        for i in range(WARMUP_CALLS):
            one.ping.call_one(i).get()

        def sync() -> tuple[list[float], dict[str, Any]]:
            return [
                rate_rep(lambda: one.ping.call_one(1).get(), secs) for _ in range(args.reps)
            ], {}

        def async_() -> tuple[list[float], dict[str, Any]]:
            def batch() -> None:
                futs = [one.ping.call_one(i) for i in range(IN_FLIGHT)]
                for f in futs:
                    f.get()

            return [rate_rep(batch, secs, ops_per_call=IN_FLIGHT) for _ in range(args.reps)], {
                "in_flight": IN_FLIGHT
            }

        run_metric(args, "1_1_actor_calls_sync", impl, "calls/s", True, version, sync)
        run_metric(args, "1_1_actor_calls_async", impl, "calls/s", True, version, async_)
        _stop(procs)

    def cast_gather() -> tuple[list[float], dict[str, Any]]:
        procs, mesh = _spawn(4, "echo4")
        try:
            for i in range(WARMUP_CALLS):
                mesh.ping.call(i).get()
            return [
                1e3 / rate_rep(lambda: mesh.ping.call(1).get(), secs) for _ in range(args.reps)
            ], {"procs": 4}
        finally:
            _stop(procs)

    run_metric(args, "cast_gather_4", impl, "ms", False, version, cast_gather)

    def spawn() -> tuple[list[float], dict[str, Any]]:
        reps = []
        for r in range(args.reps):
            t0 = time.perf_counter()
            procs, mesh = _spawn(4, f"spawn{r}")
            mesh.ping.call(0).get()
            reps.append(time.perf_counter() - t0)
            _stop(procs)
        return reps, {"procs": 4}

    run_metric(args, "spawn_4_to_first_call_s", impl, "s", False, version, spawn)

    def detect() -> tuple[list[float], dict[str, Any]]:
        reps, hook_s, errors, capped = [], [], set(), 0
        for r in range(args.reps):
            procs, mesh = _spawn(4, f"victim{r}")
            pids = list(mesh.pid.call().get().values())
            pending = mesh.slice(procs=1).sleep.call_one(DETECT_CAP_S * 2)
            time.sleep(0.2)  # the call is running in the victim
            fault_times.clear()
            t0 = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            try:
                value = pending.get(timeout=DETECT_CAP_S)
            except TimeoutError:
                capped += 1
                reps.append(DETECT_CAP_S)
            except Exception as exc:  # noqa: BLE001 - every failure of a detection is counted by its type
                reps.append(time.monotonic() - t0)
                errors.add(type(exc).__name__)
            else:
                raise AssertionError(f"a call to a SIGKILLed actor returned {value!r}")
            if fault_times:
                hook_s.append(round(min(fault_times) - t0, 4))
            _stop(procs)
        extra: dict[str, Any] = {
            "errors": sorted(errors),
            "fault_hook_s": hook_s,
            "cap_s": DETECT_CAP_S,
            "capped_reps": capped,
        }
        return reps, extra

    run_metric(args, "detect_sigkill_s", impl, "s", False, version, detect)
