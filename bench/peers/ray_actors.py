"""Actor benchmarks for Ray core actors (``pip install ray``), in the same shape as the others.

Run with the peers' interpreter (see bench/requirements-peers.txt)::

    bench/.peers-venv/bin/python bench/peers/ray_actors.py [--only METRIC] [--reps N]

A local Ray node is started once (``ray.init``, on the loopback address, no dashboard, usage
stats off); its start-up time is reported as ``ray_init_s`` next to the spawn metric.

* ``1_1_actor_calls_sync``: one actor; ``ray.get(a.ping.remote(i))`` one at a time.
* ``1_1_actor_calls_async``: same actor; ``ray.get([a.ping.remote(i) for 1,000 i])``.
* ``cast_gather_4``: 4 actors; ``ray.get([a.ping.remote(i) for a in actors])`` one at a time.
* ``spawn_4_to_first_call_s``: 4 ``Echo.remote()`` + the first call on all 4 returning
  (a warm node: ``ray.init`` is not included).
* ``detect_sigkill_s``: 4 actors, a pending call to actor 1, actor 1's process SIGKILLed;
  time until that ``ray.get`` raises (capped at 30 s).

Every method is a plain ``def`` taking and returning a small int; actors ask for 0 CPUs so
four fit on a 2-core node.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Before importing ray: no usage reporting, no network beyond this machine.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Makes Ray pick the loopback address for its node (it otherwise binds the host's interface).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DISABLE_DOCKER_CPU_WARNING", "1")

import ray  # noqa: E402
from _common import parse_args, rate_rep, run_metric  # noqa: E402

IMPL = "ray"
VERSION = metadata.version("ray")
IN_FLIGHT = 1000
DETECT_CAP_S = 30.0
WARMUP_CALLS = 50


@ray.remote(num_cpus=0)
class Echo:
    def ping(self, x: int) -> int:
        return x

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def _spawn(n: int) -> list[Any]:
    return [Echo.remote() for _ in range(n)]  # type: ignore[attr-defined]


def _stop(actors: list[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a)
        except Exception as exc:  # noqa: BLE001 - a killed actor may be gone already: said, not raised
            print(f"kill: {type(exc).__name__}: {exc}", file=sys.stderr)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    secs = args.rep_seconds

    t0 = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    ray_init_s = round(time.perf_counter() - t0, 4)

    try:
        one_metrics = {"1_1_actor_calls_sync", "1_1_actor_calls_async"}
        if not args.only or args.only & one_metrics:
            [a] = _spawn(1)
            for i in range(WARMUP_CALLS):
                ray.get(a.ping.remote(i))

            def sync() -> tuple[list[float], dict[str, Any]]:
                return [
                    rate_rep(lambda: ray.get(a.ping.remote(1)), secs) for _ in range(args.reps)
                ], {}

            def async_() -> tuple[list[float], dict[str, Any]]:
                def batch() -> None:
                    ray.get([a.ping.remote(i) for i in range(IN_FLIGHT)])

                return [rate_rep(batch, secs, ops_per_call=IN_FLIGHT) for _ in range(args.reps)], {
                    "in_flight": IN_FLIGHT
                }

            run_metric(args, "1_1_actor_calls_sync", IMPL, "calls/s", True, VERSION, sync)
            run_metric(args, "1_1_actor_calls_async", IMPL, "calls/s", True, VERSION, async_)
            _stop([a])

        def cast_gather() -> tuple[list[float], dict[str, Any]]:
            actors = _spawn(4)
            try:
                for i in range(WARMUP_CALLS):
                    ray.get([b.ping.remote(i) for b in actors])
                return [
                    1e3 / rate_rep(lambda: ray.get([b.ping.remote(1) for b in actors]), secs)
                    for _ in range(args.reps)
                ], {"procs": 4}
            finally:
                _stop(actors)

        run_metric(args, "cast_gather_4", IMPL, "ms", False, VERSION, cast_gather)

        def spawn() -> tuple[list[float], dict[str, Any]]:
            reps = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                actors = _spawn(4)
                ray.get([b.ping.remote(0) for b in actors])
                reps.append(time.perf_counter() - t0)
                _stop(actors)
                time.sleep(0.2)  # let the killed workers go before the next rep
            return reps, {"procs": 4, "ray_init_s": ray_init_s}

        run_metric(args, "spawn_4_to_first_call_s", IMPL, "s", False, VERSION, spawn)

        def detect() -> tuple[list[float], dict[str, Any]]:
            reps, errors, capped = [], set(), 0
            for _ in range(args.reps):
                actors = _spawn(4)
                pids = ray.get([b.pid.remote() for b in actors])
                pending = actors[1].sleep.remote(DETECT_CAP_S * 2)
                time.sleep(0.2)  # the call is running in the victim
                t0 = time.monotonic()
                os.kill(pids[1], signal.SIGKILL)
                try:
                    value = ray.get(pending, timeout=DETECT_CAP_S)
                except ray.exceptions.GetTimeoutError:
                    capped += 1
                    reps.append(DETECT_CAP_S)
                except Exception as exc:  # noqa: BLE001 - every failure of a detection is counted by its type
                    reps.append(time.monotonic() - t0)
                    errors.add(type(exc).__name__)
                else:
                    raise AssertionError(f"a call to a SIGKILLed actor returned {value!r}")
                _stop(actors)
            return reps, {"errors": sorted(errors), "cap_s": DETECT_CAP_S, "capped_reps": capped}

        run_metric(args, "detect_sigkill_s", IMPL, "s", False, VERSION, detect)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
