"""Actor benchmarks for Dask ``distributed`` actors, in the same shape as the others.

Run with the peers' interpreter (see bench/requirements-peers.txt)::

    bench/.peers-venv/bin/python bench/peers/dask_actors.py [--only METRIC] [--reps N]

A ``LocalCluster`` (scheduler in this process, worker processes with one thread each, on
127.0.0.1, no dashboard); one actor per worker, placed with ``workers=[addr]``.

* ``1_1_actor_calls_sync``: one actor; ``a.ping(i).result()`` one at a time.
* ``1_1_actor_calls_async``: same actor; 1,000 ``a.ping(i)`` issued, then every ``.result()``.
* ``cast_gather_4``: 4 actors on 4 workers; call all, then every ``.result()``, one at a time.
* ``spawn_4_to_first_call_s``: ``cluster.scale(4)`` + 4 actors + the first call on all 4
  returning (the scheduler is already up).
* ``detect_sigkill_s``: 4 actors, a pending call to actor 1, its worker process SIGKILLed;
  time until that ``.result()`` raises (capped at 30 s).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import parse_args, rate_rep, run_metric  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

IMPL = "distributed"
VERSION = metadata.version("distributed")
IN_FLIGHT = 1000
DETECT_CAP_S = 30.0
WARMUP_CALLS = 50


class Echo:
    def ping(self, x: int) -> int:
        return x

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    secs = args.rep_seconds
    # The detect benchmark makes the scheduler and nanny log a killed worker; that is expected.
    logging.getLogger("distributed").setLevel(logging.CRITICAL)

    cluster = LocalCluster(
        n_workers=0, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
    )
    client = Client(cluster)

    def up(n: int) -> list[Any]:
        cluster.scale(n)
        client.wait_for_workers(n)
        workers = sorted(client.scheduler_info()["workers"])[:n]
        futs = [client.submit(Echo, actor=True, workers=[w], pure=False) for w in workers]
        return [f.result() for f in futs]

    def down() -> None:
        cluster.scale(0)
        deadline = time.monotonic() + 30
        while client.scheduler_info()["workers"] and time.monotonic() < deadline:
            time.sleep(0.05)

    def gather(actors: list[Any], x: int) -> list[int]:
        return [f.result() for f in [a.ping(x) for a in actors]]

    try:
        one_metrics = {"1_1_actor_calls_sync", "1_1_actor_calls_async"}
        if not args.only or args.only & one_metrics:
            [a] = up(1)
            for i in range(WARMUP_CALLS):
                a.ping(i).result()

            def sync() -> tuple[list[float], dict[str, Any]]:
                return [rate_rep(lambda: a.ping(1).result(), secs) for _ in range(args.reps)], {}

            def async_() -> tuple[list[float], dict[str, Any]]:
                def batch() -> None:
                    futs = [a.ping(i) for i in range(IN_FLIGHT)]
                    for f in futs:
                        f.result()

                return [rate_rep(batch, secs, ops_per_call=IN_FLIGHT) for _ in range(args.reps)], {
                    "in_flight": IN_FLIGHT
                }

            run_metric(args, "1_1_actor_calls_sync", IMPL, "calls/s", True, VERSION, sync)
            run_metric(args, "1_1_actor_calls_async", IMPL, "calls/s", True, VERSION, async_)
            del a
            down()

        def cast_gather() -> tuple[list[float], dict[str, Any]]:
            actors = up(4)
            try:
                for i in range(WARMUP_CALLS):
                    gather(actors, i)
                return [
                    1e3 / rate_rep(lambda: gather(actors, 1), secs) for _ in range(args.reps)
                ], {"procs": 4}
            finally:
                actors = None  # the actors go with their last reference
                down()

        run_metric(args, "cast_gather_4", IMPL, "ms", False, VERSION, cast_gather)

        def spawn() -> tuple[list[float], dict[str, Any]]:
            reps = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                actors = up(4)
                gather(actors, 0)
                reps.append(time.perf_counter() - t0)
                del actors
                down()
            return reps, {"procs": 4}

        run_metric(args, "spawn_4_to_first_call_s", IMPL, "s", False, VERSION, spawn)

        def detect() -> tuple[list[float], dict[str, Any]]:
            reps, errors, capped = [], set(), 0
            for _ in range(args.reps):
                actors = up(4)
                pid = actors[1].pid().result()
                pending = actors[1].sleep(DETECT_CAP_S * 2)
                time.sleep(0.2)  # the call is running in the victim
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                try:
                    value = pending.result(timeout=DETECT_CAP_S)
                except TimeoutError:
                    capped += 1
                    reps.append(DETECT_CAP_S)
                except Exception as exc:  # noqa: BLE001 - every failure of a detection is counted by its type
                    reps.append(time.monotonic() - t0)
                    errors.add(type(exc).__name__)
                else:
                    raise AssertionError(f"a call to a SIGKILLed actor returned {value!r}")
                del actors, pending
                down()
            return reps, {"errors": sorted(errors), "cap_s": DETECT_CAP_S, "capped_reps": capped}

        run_metric(args, "detect_sigkill_s", IMPL, "s", False, VERSION, detect)
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
