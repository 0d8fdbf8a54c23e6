"""Fault-detection and tensor-transfer benchmarks for palatine, through the client API.

Run with the project's interpreter::

    .venv/bin/python bench/fault_bench.py [--only METRIC] [--reps N]

Every mesh is ``local_mesh(hosts=1, procs_per_host=4)`` (real ``palatine system``,
``host`` and ``controller`` processes and 4 exec'd workers; the client in this process).
A detection ends the mesh's session, so each repetition of the two detection metrics
starts a fresh mesh (not timed) and shuts it down afterwards.

Metrics (targets in ``bench/run.py``):

* ``detect_sigstop_s``: the mesh runs with ``supervision_update_timeout_in_sec =
  STOP_TIMEOUT_S`` and ``supervision_update_interval_in_sec = STOP_INTERVAL_S``. After a
  warm-up call on every rank, a long ``time.sleep`` is issued on rank ``STOP_VICTIM``
  only and fetched; once it runs, that worker is SIGSTOPped; the value is the time from
  the SIGSTOP until the pending fetch raises ``palatine.DeviceException`` in the client.
  The worker is SIGCONTed right after (and in any case before the shutdown). If the
  fetch has not raised after ``DETECT_CAP_S`` the client was never told: the metric is
  printed as an error, not as a number. The target is timeout + one interval; the
  record carries it as ``target_value`` (with both settings) so ``bench/run.py`` judges
  it against the settings actually used.
* ``detect_hang_s``: the mesh runs with ``operation_timeout_in_sec = HANG_TIMEOUT_S``,
  ``worker_progress_check_interval_in_sec = HANG_CHECK_S`` and
  ``fail_on_worker_timeout=True``. After a warm-up of the same remote function on every
  rank (nobody spins), one call is issued on all ranks in which rank ``HANG_VICTIM``
  spins in a pure-Python busy loop (no sleep, no I/O: it holds the GIL) and the others
  return at once; its value is fetched from rank 0. The value is the time from issuing
  the call until the fetch raises ``palatine.StuckWorkersException``. The extras record
  whether the exception names the rank (``names_rank``), the op (``names_op``: the
  remote function's name on the rank's line) and carries a Python stack with a frame of
  the stuck function (``stack_has_call_frame``) and of the busy loop itself
  (``stack_has_loop_frame``); ``bench/run.py`` counts the target as met only when all
  of them hold and the time is within timeout + one check interval.
  ``op_age_in_report_s`` is the op's age as the report states it (when it was made).
* ``tensor_transfer_GBps``: a 64 MiB float32 tensor made on every rank by one remote
  call (not timed), then ``fetch(t, shard=1).result()`` of the same value repeatedly;
  each repetition is one fetch, GB/s = 67,108,864 bytes / seconds / 1e9. One untimed
  fetch first checks type, shape and contents. The median of ``max(5, reps)``
  repetitions; the extras give each process's CPU time per fetch.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from _common import median, parse_args, run_metric

from palatine import (
    DeviceException,
    StuckWorkersException,
    fetch,
    inspect,
    local_mesh,
    remote,
)

IMPL = "palatine"
VERSION = metadata.version("palatine")

PROCS = 4
STARTUP_TIMEOUT_S = 120.0
FETCH_TIMEOUT_S = 120.0
DETECT_CAP_S = 20.0
SETTLE_S = 0.3  # after issuing the long call, before the fault: it is running

STOP_TIMEOUT_S = 1.0
STOP_INTERVAL_S = 0.2
STOP_VICTIM = 2

HANG_TIMEOUT_S = 1.0
HANG_CHECK_S = 0.2
HANG_VICTIM = 3
HANG_SPIN_S = 30.0  # the stuck rank gives up by itself after this

TENSOR_BYTES = 64 * 2**20
TENSOR_SHARD = 1
MIN_TRANSFER_REPS = 5


def log(msg: str) -> None:
    print(f"[fault_bench] {msg}", file=sys.stderr, flush=True)


def _shutdown(mesh: Any) -> None:
    try:
        mesh.shutdown(timeout=20)
    except Exception as exc:  # noqa: BLE001 - a failed session may refuse a clean stop
        log(f"shutdown: {type(exc).__name__}: {exc}")


def _worker_pids(mesh: Any) -> list[int]:
    with mesh.activate():
        pid = remote(os.getpid)()
        pids = [int(inspect(pid, shard=k)) for k in range(PROCS)]
    if len(set(pids)) != PROCS or os.getpid() in pids:
        raise AssertionError(f"unexpected worker pids {pids}")
    return pids


# ------------------------------------------------------------------------------ remote functions
# Defined in __main__, so shipped to the workers by value (cloudpickle).


def spin_loop(seconds: float) -> int:
    """A pure-Python busy loop: no sleep, no I/O, the GIL held between switches."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def stuck_on_rank(victim: int, seconds: float) -> int:
    # the worker's own rank, not mesh.rank(): a mesh tensor would make each worker load
    # torch inside the measured 1 s operation timeout
    from palatine import worker_info

    rank = int(worker_info()["rank"])
    if rank == victim:
        return spin_loop(seconds)
    return rank


def make_tensor(rank: int, numel: int) -> Any:
    import torch

    return torch.full((numel,), float(rank + 1), dtype=torch.float32)


# ------------------------------------------------------------------------------ SIGSTOP


def measure_sigstop(args: Any) -> tuple[list[float], dict[str, Any]]:
    detect: list[float] = []
    classes: set[str] = set()
    kinds: set[str] = set()
    reasons: set[str] = set()
    wrong: list[str] = []
    never_told = 0
    stuck_instead = 0
    for r in range(args.reps):
        mesh = local_mesh(
            hosts=1,
            procs_per_host=PROCS,
            startup_timeout_s=STARTUP_TIMEOUT_S,
            supervision_update_timeout_s=STOP_TIMEOUT_S,
            supervision_update_interval_s=STOP_INTERVAL_S,
        )
        victim_pid = None
        stopped = False
        try:
            pids = _worker_pids(mesh)
            victim_pid = pids[STOP_VICTIM]
            with mesh.slice(proc=STOP_VICTIM).activate():
                pending = fetch(remote("time.sleep")(DETECT_CAP_S * 4), shard=0)
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            os.kill(victim_pid, signal.SIGSTOP)
            stopped = True
            try:
                value = pending.result(timeout=DETECT_CAP_S)
            except StuckWorkersException as exc:  # the wrong detector fired
                stuck_instead += 1
                log(f"rep {r}: StuckWorkersException instead of a heartbeat expiry: {exc}")
            except DeviceException as exc:
                took = time.perf_counter() - t0
                detect.append(took)
                classes.add(type(exc).__name__)
                kinds.add(str(getattr(exc, "kind", "?")))
                details = getattr(exc, "details", {}) or {}
                reasons.add(str(details.get("reason")))
                if details.get("rank") != STOP_VICTIM or details.get("pid") != victim_pid:
                    wrong.append(f"rank={details.get('rank')} pid={details.get('pid')}")
                log(f"rep {r}: told after {took:.3f} s: {str(exc).splitlines()[0][:200]}")
            except TimeoutError:
                never_told += 1
                log(f"rep {r}: the pending fetch did not raise within {DETECT_CAP_S:g} s")
            else:
                raise AssertionError(f"a fetch pending on a SIGSTOPped worker returned {value!r}")
        finally:
            if stopped and victim_pid is not None:
                try:
                    os.kill(victim_pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            _shutdown(mesh)
    if never_told or stuck_instead:
        raise RuntimeError(
            f"client never told of the SIGSTOPped worker in {never_told} of {args.reps} "
            f"repetition(s) (no DeviceException within {DETECT_CAP_S:g} s; heartbeat timeout "
            f"{STOP_TIMEOUT_S:g} s, interval {STOP_INTERVAL_S:g} s)"
            + (f"; {stuck_instead} raised StuckWorkersException instead" if stuck_instead else "")
        )
    return detect, {
        "procs": PROCS,
        "victim_rank": STOP_VICTIM,
        "supervision_update_timeout_in_sec": STOP_TIMEOUT_S,
        "supervision_update_interval_in_sec": STOP_INTERVAL_S,
        "target_value": round(STOP_TIMEOUT_S + STOP_INTERVAL_S, 6),
        "exceptions": sorted(classes),
        "kinds": sorted(kinds),
        "reasons": sorted(reasons),
        "wrong_details": wrong,
        "cap_s": DETECT_CAP_S,
    }


# ------------------------------------------------------------------------------ hang


def _hang_checks(exc: BaseException) -> dict[str, bool]:
    text = str(exc)
    details = getattr(exc, "details", {}) or {}
    ops = details.get("ops") or {}
    op = str(ops.get(HANG_VICTIM, ops.get(str(HANG_VICTIM), "")))
    rank_lines = [ln for ln in text.splitlines() if ln.startswith(f"rank {HANG_VICTIM} ")]
    stack = (
        text.split(f"rank {HANG_VICTIM} stack", 1)[1] if f"rank {HANG_VICTIM} stack" in text else ""
    )
    return {
        "names_rank": list(details.get("ranks") or []) == [HANG_VICTIM] and bool(rank_lines),
        "names_op": stuck_on_rank.__name__ in op
        and any(stuck_on_rank.__name__ in ln for ln in rank_lines),
        "stack_has_call_frame": f"in {stuck_on_rank.__name__}" in stack,
        "stack_has_loop_frame": f"in {spin_loop.__name__}" in stack,
    }


def _op_age(exc: BaseException) -> float | None:
    """How long the stuck op had run when the report was made ("... for 1.2 s")."""
    ops = (getattr(exc, "details", {}) or {}).get("ops") or {}
    m = re.search(r"for ([0-9.]+) s", str(ops.get(HANG_VICTIM, ops.get(str(HANG_VICTIM), ""))))
    return float(m.group(1)) if m else None


def measure_hang(args: Any) -> tuple[list[float], dict[str, Any]]:
    detect: list[float] = []
    ages: list[float | None] = []
    checks: dict[str, bool] = {}
    first_text = ""
    for r in range(args.reps):
        mesh = local_mesh(
            hosts=1,
            procs_per_host=PROCS,
            startup_timeout_s=STARTUP_TIMEOUT_S,
            operation_timeout_s=HANG_TIMEOUT_S,
            worker_progress_check_interval_s=HANG_CHECK_S,
            fail_on_worker_timeout=True,
        )
        try:
            with mesh.activate():
                fn = remote(stuck_on_rank)
                # Warm-up: the same function on every rank, nobody stuck.
                got = fetch(fn(-1, 0.0), shard=HANG_VICTIM).result(timeout=FETCH_TIMEOUT_S)
                if got != HANG_VICTIM:
                    raise AssertionError(f"warm-up returned {got!r}, expected {HANG_VICTIM}")
                t0 = time.perf_counter()
                pending = fetch(fn(HANG_VICTIM, HANG_SPIN_S), shard=0)
                try:
                    value = pending.result(timeout=DETECT_CAP_S)
                except StuckWorkersException as exc:
                    took = time.perf_counter() - t0
                    detect.append(took)
                    rep_checks = _hang_checks(exc)
                    ages.append(_op_age(exc))
                    for k, v in rep_checks.items():
                        checks[k] = checks.get(k, True) and v
                    if not first_text:
                        first_text = str(exc)
                    log(f"rep {r}: StuckWorkersException after {took:.3f} s, checks {rep_checks}")
                except TimeoutError:
                    raise RuntimeError(
                        f"no StuckWorkersException within {DETECT_CAP_S:g} s of issuing a call "
                        f"stuck on rank {HANG_VICTIM} (operation timeout {HANG_TIMEOUT_S:g} s, "
                        f"check interval {HANG_CHECK_S:g} s)"
                    ) from None
                else:
                    raise AssertionError(f"a fetch behind a stuck rank returned {value!r}")
        finally:
            _shutdown(mesh)
    if first_text:
        log("exception text (first repetition):\n" + first_text)
    return detect, {
        "procs": PROCS,
        "victim_rank": HANG_VICTIM,
        "operation_timeout_in_sec": HANG_TIMEOUT_S,
        "worker_progress_check_interval_in_sec": HANG_CHECK_S,
        "target_value": round(HANG_TIMEOUT_S + HANG_CHECK_S, 6),
        "requires": checks,
        "op_age_in_report_s": ages,
        "cap_s": DETECT_CAP_S,
    }


# ------------------------------------------------------------------------------ tensor transfer


def _role_procs(mesh: Any) -> dict[str, list[psutil.Process]]:
    roles: dict[str, list[psutil.Process]] = {"client": [psutil.Process()]}
    for rp in getattr(getattr(mesh, "_local", None), "procs", []):
        try:
            proc = psutil.Process(rp.popen.pid)
        except psutil.Error:
            continue
        roles.setdefault(str(rp.args[0]), []).append(proc)
    return roles


def _cpu(roles: dict[str, list[psutil.Process]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for role, procs in roles.items():
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[role] = total
    return out


def measure_transfer(args: Any) -> tuple[list[float], dict[str, Any]]:
    numel = TENSOR_BYTES // 4
    mesh = local_mesh(hosts=1, procs_per_host=PROCS, startup_timeout_s=STARTUP_TIMEOUT_S)
    try:
        pids = _worker_pids(mesh)
        roles = _role_procs(mesh)
        roles["worker (source)"] = [psutil.Process(pids[TENSOR_SHARD])]
        with mesh.activate():
            t = remote(make_tensor)(mesh.rank("proc"), numel)
            x = fetch(t, shard=TENSOR_SHARD).result(timeout=FETCH_TIMEOUT_S)  # made + checked
            want = float(TENSOR_SHARD + 1)
            if (
                type(x).__name__ != "Tensor"
                or tuple(x.shape) != (numel,)
                or str(x.dtype) != "torch.float32"
                or float(x[0]) != want
                or float(x[-1]) != want
            ):
                raise AssertionError(
                    f"fetched {type(x).__name__} {getattr(x, 'shape', None)} "
                    f"{getattr(x, 'dtype', None)}, expected float32[{numel}]"
                )
            del x
            gbps: list[float] = []
            secs: list[float] = []
            cpu: list[dict[str, float]] = []
            for _ in range(max(MIN_TRANSFER_REPS, args.reps)):
                c0 = _cpu(roles)
                t0 = time.perf_counter()
                x = fetch(t, shard=TENSOR_SHARD).result(timeout=FETCH_TIMEOUT_S)
                dt = time.perf_counter() - t0
                c1 = _cpu(roles)
                if x.numel() != numel:
                    raise AssertionError(f"fetched {x.numel()} elements, expected {numel}")
                del x
                gbps.append(TENSOR_BYTES / dt / 1e9)
                secs.append(round(dt, 4))
                cpu.append({k: (c1[k] - c0[k]) * 1e3 for k in c0})
    finally:
        _shutdown(mesh)
    cpu_med = {k: round(median(c[k] for c in cpu), 1) for k in cpu[0]}
    return gbps, {
        "procs": PROCS,
        "bytes": TENSOR_BYTES,
        "gb": "1e9 bytes",
        "shard": TENSOR_SHARD,
        "fetch_s": secs,
        "cpu_ms_per_fetch": cpu_med,
    }


# ------------------------------------------------------------------------------


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    run_metric(args, "detect_sigstop_s", IMPL, "s", False, VERSION, lambda: measure_sigstop(args))
    run_metric(args, "detect_hang_s", IMPL, "s", False, VERSION, lambda: measure_hang(args))
    run_metric(
        args, "tensor_transfer_GBps", IMPL, "GB/s", True, VERSION, lambda: measure_transfer(args)
    )


if __name__ == "__main__":
    main()
