"""Client/controller benchmarks for palatine: remote calls through a real local mesh.

Run with the project's interpreter::

    .venv/bin/python bench/controller_bench.py [--only METRIC] [--reps N]

Every mesh is ``local_mesh(hosts=1, procs_per_host=4)``: real ``palatine system``,
``palatine host`` and ``palatine controller`` processes and 4 exec'd workers, the client
in this process (the same code paths as a user script). The no-op function is
``palatine.tensor.worker.functions.identity``, shipped by import path.

Metrics (targets in ``bench/run.py``):

* ``controller_invocations_per_s``: N ``remote(identity)(i)`` calls on all 4 ranks (each
  result discarded, so its ``DeleteRefs`` rides along with a later call), then one
  ``fetch`` of the last value, which completes only once every earlier seq has completed
  on every rank (completion accounting); timed from the first issue until the fetch
  returns. The value is N / time. N is calibrated after a warm-up so that one repetition
  takes about 2 x ``--rep-seconds`` (1 s by default). The extras break a repetition into
  issuing (``issue_s``) and draining (``drain_s``), and show the CPU seconds each process
  spent per 1,000 calls (``cpu_ms_per_1k_calls``: client, controller, workers, system,
  host).
* ``controller_invocations_printing_per_s``: the same, with a function that prints one
  line per call (``identity_printing``): every rank's line travels from its host to this
  client, where the four identical lines of a call are shown once. The extras give the
  ratio to the silent figure of the same run (``vs_silent``; goal ≥ 0.5). The lines go
  to this process's stderr.
* ``fetch_roundtrip_ms``: ``fetch(remote(identity)(i), shard=0).result()`` one at a time,
  on the same mesh; mean milliseconds per round trip over one repetition of
  ``--rep-seconds``.
* ``local_mesh_4_to_first_fetch_s``: ``local_mesh`` (4 workers) + the first remote call
  + its ``fetch`` returning, in seconds from a running client interpreter (palatine
  imported). ``spawn_4_to_first_call_s`` (bench/actor_calls.py) is the actor API's
  counterpart. The extras give the part spent inside ``local_mesh`` (``local_mesh_s``).
* ``detect_sigkill_client_s``: on a fresh mesh (the one just timed), the workers' pids
  via ``inspect(remote(os.getpid)(), shard=r)``; a long call (``time.sleep``) issued on
  rank 0 only and fetched; once it is running, rank 2's worker is SIGKILLed; the time
  until the pending fetch raises ``palatine.DeviceException`` (capped at ``DETECT_CAP_S``).

The last two share their meshes: each repetition starts a mesh (timed), kills a worker
in it (timed), and shuts it down.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from _common import median, parse_args, rate_rep, run_metric, wanted  # noqa: E402

from palatine import DeviceException, fetch, inspect, local_mesh, remote  # noqa: E402

IMPL = "palatine"
VERSION = metadata.version("palatine")

PROCS = 4
IDENTITY = "palatine.tensor.worker.functions.identity"
WARMUP_CALLS = 200
CALIBRATE_CALLS = 500
MIN_CALLS, MAX_CALLS = 200, 500_000
FETCH_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 120.0
DETECT_VICTIM = 2
DETECT_CAP_S = 30.0
DETECT_SETTLE_S = 0.2

THROUGHPUT = (
    "controller_invocations_per_s",
    "controller_invocations_printing_per_s",
    "fetch_roundtrip_ms",
)
IDENTITY_PRINTING = "palatine.tensor.worker.functions.identity_printing"
LIFECYCLE = ("local_mesh_4_to_first_fetch_s", "detect_sigkill_client_s")


def log(msg: str) -> None:
    print(f"[controller_bench] {msg}", file=sys.stderr, flush=True)


def _new_mesh() -> Any:
    return local_mesh(hosts=1, procs_per_host=PROCS, startup_timeout_s=STARTUP_TIMEOUT_S)


def _shutdown(mesh: Any) -> None:
    try:
        mesh.shutdown(timeout_s=20)
    except Exception as exc:  # noqa: BLE001 - a failed session may refuse a clean stop
        log(f"shutdown: {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------ CPU accounting


class CpuMeter:
    """CPU seconds (user + system) of each process of a local mesh, by role."""

    def __init__(self, mesh: Any) -> None:
        self.roles: dict[str, list[psutil.Process]] = {"client": [psutil.Process()]}
        local = getattr(mesh, "_local", None)
        for rp in getattr(local, "procs", []):
            role = rp.args[0]
            proc = psutil.Process(rp.popen.pid)
            self.roles.setdefault(role, []).append(proc)
            if role == "host":  # the host starts the workers
                try:
                    self.roles.setdefault("workers", []).extend(proc.children(recursive=True))
                except psutil.Error:
                    pass

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, procs in self.roles.items():
            total = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            out[role] = total
        return out


# ------------------------------------------------------------------------------ throughput


def bench_throughput(args: Any) -> None:
    if not any(wanted(args, m) for m in THROUGHPUT):
        return
    results: dict[str, Any] = {}
    mesh = None
    try:
        mesh = _new_mesh()
        _measure_throughput(mesh, args, results)
    except Exception as exc:  # noqa: BLE001 - reported per metric below
        for m in THROUGHPUT:
            results.setdefault(m, exc)
    finally:
        if mesh is not None:
            _shutdown(mesh)
    _report(args, "controller_invocations_per_s", "calls/s", True, results)
    _report(args, "controller_invocations_printing_per_s", "calls/s", True, results)
    _report(args, "fetch_roundtrip_ms", "ms", False, results)


def _measure_throughput(mesh: Any, args: Any, results: dict[str, Any]) -> None:
    identity = remote(IDENTITY)
    meter = CpuMeter(mesh)
    rep_s = 2 * args.rep_seconds

    printing = remote(IDENTITY_PRINTING)

    def burst(n: int, fn: Any = identity) -> tuple[float, float]:
        """n no-op calls then one fetch of the last; (issue seconds, total seconds)."""
        v = None
        t0 = time.perf_counter()
        for i in range(n):
            v = fn(i)
        t1 = time.perf_counter()
        got = fetch(v, shard=0).result(timeout=FETCH_TIMEOUT_S)
        t2 = time.perf_counter()
        if got != n - 1:
            raise AssertionError(f"fetched {got!r}, expected {n - 1}")
        return t1 - t0, t2 - t0

    with mesh.activate():
        burst(WARMUP_CALLS)
        total = min(burst(CALIBRATE_CALLS)[1] for _ in range(2))
        n = int(min(MAX_CALLS, max(MIN_CALLS, CALIBRATE_CALLS / total * rep_s)))
        log(f"invocations: {n} calls per repetition")

        if wanted(args, "controller_invocations_per_s"):
            try:
                reps: list[float] = []
                issue: list[float] = []
                drain: list[float] = []
                cpu: list[dict[str, float]] = []
                for _ in range(args.reps):
                    c0 = meter.sample()
                    i_s, t_s = burst(n)
                    c1 = meter.sample()
                    reps.append(n / t_s)
                    issue.append(round(i_s, 4))
                    drain.append(round(t_s - i_s, 4))
                    cpu.append({k: (c1[k] - c0[k]) * 1e6 / n for k in c0})
                cpu_med = {k: round(median(c[k] for c in cpu), 1) for k in cpu[0]}
                results["controller_invocations_per_s"] = (
                    reps,
                    {
                        "procs": PROCS,
                        "calls_per_rep": n,
                        "issue_s": issue,
                        "drain_s": drain,
                        "issue_calls_per_s": round(n / median(issue), 1),
                        "cpu_ms_per_1k_calls": cpu_med,
                    },
                )
            except Exception as exc:  # noqa: BLE001 - one metric must not end the other
                results["controller_invocations_per_s"] = exc

        if wanted(args, "controller_invocations_printing_per_s"):
            try:
                burst(WARMUP_CALLS, printing)
                loud: list[float] = []
                silent: list[float] = []
                for _ in range(args.reps):  # interleaved with silent runs of the same size
                    loud.append(n / burst(n, printing)[1])
                    silent.append(n / burst(n)[1])
                results["controller_invocations_printing_per_s"] = (
                    loud,
                    {
                        "procs": PROCS,
                        "calls_per_rep": n,
                        "silent_calls_per_s": [round(x, 1) for x in silent],
                        "vs_silent": round(median(loud) / median(silent), 3),
                    },
                )
            except Exception as exc:  # noqa: BLE001
                results["controller_invocations_printing_per_s"] = exc

        if wanted(args, "fetch_roundtrip_ms"):
            try:
                counter = iter(range(1 << 62))

                def roundtrip() -> None:
                    i = next(counter)
                    got = fetch(identity(i), shard=0).result(timeout=FETCH_TIMEOUT_S)
                    if got != i:
                        raise AssertionError(f"fetched {got!r}, expected {i}")

                for _ in range(50):
                    roundtrip()
                reps = []
                cpu = []
                for _ in range(args.reps):
                    c0 = meter.sample()
                    before = next(counter)
                    rate = rate_rep(roundtrip, args.rep_seconds)
                    calls = next(counter) - before - 1
                    c1 = meter.sample()
                    reps.append(1e3 / rate)
                    cpu.append({k: (c1[k] - c0[k]) * 1e3 / max(1, calls) for k in c0})
                cpu_med = {k: round(median(c[k] for c in cpu), 3) for k in cpu[0]}
                results["fetch_roundtrip_ms"] = (
                    reps,
                    {
                        "procs": PROCS,
                        "cpu_ms_per_roundtrip": cpu_med,
                    },
                )
            except Exception as exc:  # noqa: BLE001
                results["fetch_roundtrip_ms"] = exc


# ------------------------------------------------------------------------------ spawn + SIGKILL


def bench_lifecycle(args: Any) -> None:
    want_spawn = wanted(args, "local_mesh_4_to_first_fetch_s")
    want_kill = wanted(args, "detect_sigkill_client_s")
    if not (want_spawn or want_kill):
        return
    results: dict[str, Any] = {}
    spawn: list[float] = []
    in_local_mesh: list[float] = []
    detect: list[float] = []
    kinds: set[str] = set()
    capped = 0
    wrong: list[str] = []
    try:
        identity = remote(IDENTITY)
        for r in range(args.reps):
            t0 = time.perf_counter()
            mesh = _new_mesh()
            t1 = time.perf_counter()
            try:
                with mesh.activate():
                    got = fetch(identity(r), shard=0).result(timeout=FETCH_TIMEOUT_S)
                    t2 = time.perf_counter()
                    if got != r:
                        raise AssertionError(f"first fetch returned {got!r}, expected {r}")
                    spawn.append(t2 - t0)
                    in_local_mesh.append(round(t1 - t0, 4))
                    if not want_kill:
                        continue
                    pid = remote(os.getpid)()
                    pids = [inspect(pid, shard=k) for k in range(PROCS)]
                    if len(set(pids)) != PROCS or os.getpid() in pids:
                        raise AssertionError(f"unexpected worker pids {pids}")
                    with mesh.slice(proc=0).activate():
                        pending = fetch(remote("time.sleep")(DETECT_CAP_S * 4), shard=0)
                    time.sleep(DETECT_SETTLE_S)  # the call is running on rank 0
                    k0 = time.perf_counter()
                    os.kill(pids[DETECT_VICTIM], signal.SIGKILL)
                    try:
                        value = pending.result(timeout=DETECT_CAP_S)
                    except DeviceException as exc:
                        detect.append(time.perf_counter() - k0)
                        kinds.add(str(getattr(exc, "kind", "?")))
                        if (
                            getattr(exc, "rank", None) != DETECT_VICTIM
                            or getattr(exc, "exit_signal", None) != 9
                        ):
                            wrong.append(
                                f"rank={getattr(exc, 'rank', None)} "
                                f"signal={getattr(exc, 'exit_signal', None)}"
                            )
                    except TimeoutError:
                        capped += 1
                        detect.append(DETECT_CAP_S)
                    else:
                        raise AssertionError(f"a fetch pending on a killed mesh returned {value!r}")
            finally:
                _shutdown(mesh)
    except Exception as exc:  # noqa: BLE001 - reported per metric below
        if len(spawn) < args.reps:
            results["local_mesh_4_to_first_fetch_s"] = exc
        results["detect_sigkill_client_s"] = exc
    results.setdefault(
        "local_mesh_4_to_first_fetch_s",
        (
            spawn,
            {
                "procs": PROCS,
                "local_mesh_s": in_local_mesh,
            },
        ),
    )
    results.setdefault(
        "detect_sigkill_client_s",
        (
            detect,
            {
                "procs": PROCS,
                "victim_rank": DETECT_VICTIM,
                "kinds": sorted(kinds),
                "wrong_details": wrong,
                "cap_s": DETECT_CAP_S,
                "capped_reps": capped,
            },
        ),
    )
    _report(args, "local_mesh_4_to_first_fetch_s", "s", False, results)
    _report(args, "detect_sigkill_client_s", "s", False, results)


# ------------------------------------------------------------------------------


def _report(args: Any, metric: str, unit: str, hib: bool, results: dict[str, Any]) -> None:
    def get() -> tuple[list[float], dict[str, Any]]:
        r = results.get(metric)
        if r is None:
            raise RuntimeError("not measured (an earlier step failed)")
        if isinstance(r, BaseException):
            raise r
        return r

    run_metric(args, metric, IMPL, unit, hib, VERSION, get)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    bench_throughput(args)
    bench_lifecycle(args)


if __name__ == "__main__":
    main()
