"""Run every benchmark program, side by side with the peers, and record the results.

``make bench`` runs this file. Each benchmark program is run as a subprocess with a
timeout and prints one JSON line per metric (format in ``bench/_common.py``). palatine's
programs run with this interpreter; the peers' programs (``bench/peers/``) with
``bench/.peers-venv/bin/python`` when that virtualenv exists.

The results go to ``bench/results/<YYYY-MM-DD>.json`` (merged into the file of the day, so a
partial run with ``--only`` updates only what it measured; a partial run on a day with no
file yet updates the newest one) and ``BENCHMARKS.md`` at the
repository root is regenerated from it.

    python bench/run.py                       # everything
    python bench/run.py --only cast_gather_4  # one metric (repeatable)
    python bench/run.py --skip-peers          # palatine only; peer numbers from the last results
    python bench/run.py --setup-peers         # create bench/.peers-venv first, then run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PEERS_VENV = BENCH / ".peers-venv"
PEERS_PY = PEERS_VENV / "bin" / "python"
REQUIREMENTS_PEERS = BENCH / "requirements-peers.txt"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
TORCH_PIN = "torch==2.13.0"

OURS = "palatine"
# column order; a peer shows once measured (torchrun: bench/recovery_bench.py measures
# its restart beside palatine's recovery, with this interpreter's torch)
PEERS = ("torchmonarch", "ray", "distributed", "torchrun")
PEER_METRICS = {
    "1_1_actor_calls_sync",
    "1_1_actor_calls_async",
    "cast_gather_4",
    "spawn_4_to_first_call_s",
    "detect_sigkill_s",
}
# The tensor engine's program shape (bench/_tensor_shape.py): palatine's
# bench/tensor_bench.py and Monarch's bench/peers/monarch_tensors.py, the one peer with one.
TENSOR_METRICS = frozenset({"tensor_ops_per_s", "tensor_fetch_roundtrip_ms"})
# The training step's program shape (bench/_train_shape.py): palatine's bench/train_bench.py
# (both of its styles, and torchrun beside them) and Monarch's bench/peers/monarch_train.py.
TRAIN_METRICS = frozenset(
    {"torch_style_step_per_s", "torch_style_plain_step_per_s", "function_style_step_per_s"}
)

# One-sided buffers (bench/_rdma_shape.py): palatine's bench/rdma_bench.py (1 GiB) and
# Monarch's bench/peers/monarch_rdma.py (64 MiB: its TCP fallback), each with a memcpy.
RDMA_METRICS = frozenset({"rdma_read_1GiB_GBps", "memcpy_GBps"})


@dataclass(frozen=True)
class Program:
    path: str  # relative to the repository root
    peer: str | None  # None: palatine's own program, run with this interpreter
    metrics: frozenset[str] | None = None  # known metrics, to skip it under --only


PROGRAMS = (
    Program("bench/actor_calls.py", None),
    Program("bench/system_bench.py", None),
    Program("bench/controller_bench.py", None),
    Program(
        "bench/fault_bench.py",
        None,
        frozenset({"detect_sigstop_s", "detect_hang_s", "tensor_transfer_GBps"}),
    ),
    Program(
        "bench/scaling_bench.py",
        None,
        frozenset({"scaling_cast_procs_exponent", "scaling_msg_size_exponent"}),
    ),
    Program(
        "bench/cross_node.py",
        None,
        frozenset(
            {
                "cross_node_1_1_calls_unix",
                "cross_node_1_1_calls_tcp",
                "cross_node_1_1_calls_tls",
                "cross_node_bare_echo_unix_us",
                "cross_node_bare_echo_tcp_us",
                "cross_node_bare_echo_tls_us",
                "cross_node_fetch_64MiB_GBps",
                "cross_node_fetch_64MiB_tls_GBps",
                "cross_node_detect_sigkill_s",
                "cross_node_detect_link_cut_s",
            }
        ),
    ),
    Program("bench/tensor_bench.py", None, TENSOR_METRICS),
    Program("bench/train_bench.py", None, TRAIN_METRICS),
    Program("bench/recovery_bench.py", None, frozenset({"recover_after_sigkill_s"})),
    Program(
        "bench/spmd_bench.py",
        None,
        frozenset(
            {"spmd_start_to_first_step_s", "spmd_restart_after_sigkill_s", "spmd_steps_per_s"}
        ),
    ),
    Program(
        "bench/control_plane_bench.py",
        None,
        frozenset(
            {
                "detect_system_loss_s",
                "system_restart_job_continues_s",
                "teardown_after_sigint_s",
                "fetch_1GiB_peak_ratio",
            }
        ),
    ),
    Program("bench/peers/monarch_actors.py", "torchmonarch", frozenset(PEER_METRICS)),
    Program("bench/peers/ray_actors.py", "ray", frozenset(PEER_METRICS)),
    Program("bench/peers/dask_actors.py", "distributed", frozenset(PEER_METRICS)),
    Program("bench/peers/monarch_tensors.py", "torchmonarch", TENSOR_METRICS),
    Program("bench/peers/monarch_train.py", "torchmonarch", TRAIN_METRICS),
    Program(
        "bench/rdma_bench.py",
        None,
        RDMA_METRICS | {"cross_node_rdma_read_64MiB_GBps", "cross_node_rdma_read_64MiB_tls_GBps"},
    ),
    Program("bench/peers/monarch_rdma.py", "torchmonarch", RDMA_METRICS),
)


@dataclass(frozen=True)
class Target:
    text: str  # as written in the goals
    limit: float | None = None  # absolute bound in the metric's unit
    peer_factor: float | None = None  # ours must also be this many times better than the best peer
    # ours must be this many times better than each of these peers (where it was measured)
    peer_factors: tuple[tuple[str, float], ...] = ()


# Metric -> (unit, higher is better, target). The targets are those of the project's goals
# (performance table); a metric a program prints that is not listed here is still recorded.
METRICS: dict[str, tuple[str, bool, Target]] = {
    "1_1_actor_calls_sync": (
        "calls/s",
        True,
        Target("≥ 10× the better peer (≥ 10,000/s)", 10_000, 10),
    ),
    "1_1_actor_calls_async": (
        "calls/s",
        True,
        Target("≥ 10× the better peer (≥ 30,000/s)", 30_000, 10),
    ),
    "cast_gather_4": ("ms", False, Target("≤ 0.3 ms", 0.3)),
    "spawn_4_to_first_call_s": ("s", False, Target("≤ 0.5 s", 0.5)),
    "controller_invocations_per_s": ("calls/s", True, Target("≥ 20,000/s", 20_000)),
    # every call printing one line, which reaches the client (bench/controller_bench.py);
    # its extras give the ratio to the silent figure (goal: ≥ 0.5)
    "controller_invocations_printing_per_s": (
        "calls/s",
        True,
        Target("≥ 50 % of the silent figure (≥ 10,000/s)", 10_000),
    ),
    "fetch_roundtrip_ms": ("ms", False, Target("≤ 1 ms", 1.0)),
    # The same round trip with a mesh tensor (bench/tensor_bench.py): inspect(x + i).
    "tensor_fetch_roundtrip_ms": ("ms", False, Target("≤ 1 ms (as fetch_roundtrip_ms)", 1.0)),
    # Mesh-tensor operations on a 2-proc CPU mesh, beside torchmonarch's tensor engine.
    "tensor_ops_per_s": ("ops/s", True, Target("≥ 10× torchmonarch", None, 10)),
    # The demo's data-parallel training step on 2 CPU ranks (bench/train_bench.py): plain
    # torch on mesh tensors (coalesced where palatine has it), beside the function-style
    # step of the same run (its target_value: 0.9× that), torchrun and torchmonarch.
    "torch_style_step_per_s": (
        "steps/s",
        True,
        Target(
            "≥ 0.9× the function-style step, ≥ 1.0× torchrun, ≥ 5× torchmonarch",
            peer_factors=(("torchrun", 1.0), ("torchmonarch", 5.0)),
        ),
    ),
    "torch_style_plain_step_per_s": (
        "steps/s",
        True,
        Target("none in the goals (recorded: the step without coalescing)"),
    ),
    "function_style_step_per_s": (
        "steps/s",
        True,
        Target("none in the goals (the reference of torch_style_step_per_s)"),
    ),
    # SIGKILL of 1 of 4 ranks to the first step completed after it (bench/recovery_bench.py)
    "recover_after_sigkill_s": (
        "s",
        False,
        Target("≤ 2 s and ≥ 10× faster than torchrun --max-restarts=1", 2.0, 10),
    ),
    # A torchrun script under palatine torchrun and torchrun (bench/spmd_bench.py): start
    # to first step, SIGKILL of a rank to the first step after the group's restart, steps/s
    "spmd_start_to_first_step_s": (
        "s",
        False,
        Target("≥ 2× faster than torchrun", peer_factors=(("torchrun", 2.0),)),
    ),
    "spmd_restart_after_sigkill_s": (
        "s",
        False,
        Target("≥ 10× faster than torchrun --max-restarts=1", peer_factors=(("torchrun", 10.0),)),
    ),
    "spmd_steps_per_s": (
        "steps/s",
        True,
        Target("≥ 1.0× torchrun", peer_factors=(("torchrun", 1.0),)),
    ),
    # Control-plane faults and big values (bench/control_plane_bench.py): a SIGKILLed
    # system seen by a pending fetch; Ctrl-C to the script's exit; the whole job's peak
    # memory for a 1 GiB fetch, in units of the value.
    "detect_system_loss_s": ("s", False, Target("≤ 1 s (system on the same host)", 1.0)),
    "system_restart_job_continues_s": (
        "s",
        False,
        Target("within the heartbeat timeout (10 s), no call failed", 10.0),
    ),
    "teardown_after_sigint_s": ("s", False, Target("≤ 2 s", 2.0)),
    "fetch_1GiB_peak_ratio": ("x the value", False, Target("≤ 2× the value", 2.0)),
    # The client API's start-up and SIGKILL detection (bench/controller_bench.py); the
    # goals have no start-up target for it (spawn_4_to_first_call_s is the actor API's).
    "local_mesh_4_to_first_fetch_s": ("s", False, Target("none in the goals (recorded)")),
    "detect_sigkill_s": ("s", False, Target("≤ 0.5 s", 0.5)),
    # The same fault seen by the system (snapshot shows the proc Exited, signal 9);
    # bench/system_bench.py. detect_sigkill_s above is measured from the actor caller.
    "detect_sigkill_system_s": ("s", False, Target("≤ 0.5 s", 0.5)),
    # The same fault seen by a client's pending fetch (DeviceException); controller_bench.py.
    "detect_sigkill_client_s": ("s", False, Target("≤ 0.5 s", 0.5)),
    "detect_sigstop_s": ("s", False, Target("≤ heartbeat timeout + 1 interval")),
    "detect_hang_s": ("s", False, Target("≤ operation_timeout + check interval, with the stack")),
    "system_1k_procs_cpu": ("% of one core", False, Target("≤ 10 % of one core", 10.0)),
    "snapshot_1k_procs_ms": ("ms", False, Target("≤ 20 ms", 20.0)),
    "tensor_transfer_GBps": ("GB/s", True, Target("≥ 1 GB/s", 1.0)),
    # The goals' scaling row ("linear or better"), as the worst local exponent of a series
    # (bench/scaling_bench.py): 1 is linear; 10 % is left for this machine's noise.
    "scaling_cast_procs_exponent": (
        "exponent",
        False,
        Target("≤ 1.1: linear or better in procs, 4 → 64", 1.1),
    ),
    # Across nodes of a namespace test bed (bench/cross_node.py; needs root): the same
    # loop as 1_1_actor_calls_sync over unix here, and to a proc on the other node.
    "cross_node_1_1_calls_unix": ("calls/s", True, Target("the reference for the two below")),
    "cross_node_1_1_calls_tcp": ("calls/s", True, Target("≥ 70 % of the unix figure")),
    "cross_node_1_1_calls_tls": ("calls/s", True, Target("≥ 70 % of the unix figure")),
    # A bare echo (bench/_echo.py): what the transport alone costs per round trip.
    "cross_node_bare_echo_unix_us": ("µs", False, Target("reference: unix on this machine")),
    "cross_node_bare_echo_tcp_us": ("µs", False, Target("reference: tcp to the other node")),
    "cross_node_bare_echo_tls_us": ("µs", False, Target("reference: tls to the other node")),
    "cross_node_fetch_64MiB_GBps": ("GB/s", True, Target("≥ 1 GB/s", 1.0)),
    "cross_node_fetch_64MiB_tls_GBps": ("GB/s", True, Target("none in the goals (recorded)")),
    "cross_node_detect_sigkill_s": ("s", False, Target("≤ 0.5 s", 0.5)),
    "cross_node_detect_link_cut_s": (
        "s",
        False,
        Target("≤ heartbeat timeout + 1 interval (3.5 s)", 3.5),
    ),
    # One actor's CPU buffer read whole by 3 others on this host, all at once: bytes read
    # over the round's wall time (bench/_rdma_shape.py); memcpy_GBps is one thread's copy
    # in the same run, the reference of the second goal.
    "rdma_read_1GiB_GBps": (
        "GB/s",
        True,
        Target("≥ 3× torchmonarch, ≥ 0.5 of memcpy_GBps", None, 3),
    ),
    "memcpy_GBps": ("GB/s", True, Target("reference: one thread's memcpy in the same run")),
    # The owner on one node of the test bed, one reader on the other (bench/rdma_bench.py).
    "cross_node_rdma_read_64MiB_GBps": (
        "GB/s",
        True,
        Target("≥ cross_node_fetch_64MiB_GBps (≥ 1 GB/s)", 1.0),
    ),
    "cross_node_rdma_read_64MiB_tls_GBps": (
        "GB/s",
        True,
        Target("none in the goals (recorded)"),
    ),
    "scaling_msg_size_exponent": (
        "exponent",
        False,
        Target("≤ 1.1: linear or better in size, 64 B → 64 MiB, relative to a memory copy", 1.1),
    ),
}


# --------------------------------------------------------------------------------------
# running programs


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@dataclass
class RunOutcome:
    program: str
    impl: str
    records: list[dict[str, Any]]
    rc: int | None
    seconds: float
    note: str | None
    stderr_tail: str


def _run_once(
    cmd: list[str], timeout_s: float
) -> tuple[int | None, list[dict[str, Any]], str, bool]:
    """Run ``cmd``; return (rc, JSON records, stderr tail, timed out)."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    records: list[dict[str, Any]] = []
    err_lines: list[str] = []

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "metric" in rec and "impl" in rec:
                records.append(rec)
                v = rec.get("value")
                shown = (
                    f"{v:.6g} {rec.get('unit', '')}"
                    if isinstance(v, (int, float))
                    else f"error: {rec.get('error', '?')}"
                )
                log(f"  {rec['impl']:>12}  {rec['metric']:<28} {shown}")

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line.rstrip("\n"))
            if len(err_lines) > 400:
                del err_lines[:200]

    readers = [
        threading.Thread(target=read_out, daemon=True),
        threading.Thread(target=read_err, daemon=True),
    ]
    for t in readers:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except KeyboardInterrupt:
        # The program runs in a session of its own, so ^C reaches only this harness.
        _kill_group(proc, signal.SIGKILL)
        raise
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
            proc.wait()
    # The program may leave helpers of its own behind (Ray's node, Monarch's procs) in its
    # session; they share its process group, which this harness created for it.
    _kill_group(proc, signal.SIGTERM)
    for t in readers:
        t.join(timeout=5)
    return (None if timed_out else proc.returncode), records, "\n".join(err_lines[-40:]), timed_out


def _kill_group(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(prog: Program, args: argparse.Namespace) -> RunOutcome | None:
    impl = prog.peer or OURS
    path = ROOT / prog.path
    if args.only and prog.metrics is not None and not (set(args.only) & prog.metrics):
        return None
    if not path.exists():
        return RunOutcome(prog.path, impl, [], None, 0.0, "program not written yet; skipped", "")
    if prog.peer is None:
        python = sys.executable
    else:
        if not PEERS_PY.exists():
            return RunOutcome(
                prog.path,
                impl,
                [],
                None,
                0.0,
                "peer not installed (no bench/.peers-venv; see --setup-peers)",
                "",
            )
        python = str(PEERS_PY)
    extra: list[str] = []
    for m in args.only:
        extra += ["--only", m]
    if args.reps is not None:
        extra += ["--reps", str(args.reps)]
    cmd = [python, prog.path, *extra]
    log(f"running {prog.path} ({impl}), timeout {args.timeout:.0f} s")
    t0 = time.monotonic()
    rc, records, err, timed_out = _run_once(cmd, args.timeout)
    note = None
    if rc == 2 and extra and "unrecognized arguments" in err:
        # A program without --only/--reps: run it plainly and keep what was asked for.
        log(f"  {prog.path} takes no --only/--reps; running it without them")
        rc, records, err, timed_out = _run_once([python, prog.path], args.timeout)
        note = "program takes no --only/--reps"
    seconds = time.monotonic() - t0
    if args.only:
        records = [r for r in records if r["metric"] in args.only]
    if timed_out:
        note = f"timed out after {args.timeout:.0f} s; kept {len(records)} metric(s) printed before"
    elif rc != 0:
        if prog.peer is not None and "ModuleNotFoundError" in err and not records:
            note = f"peer not installed ({err.strip().splitlines()[-1]})"
        else:
            note = f"exit status {rc}"
        log(f"  {prog.path}: {note}\n{err}")
    for r in records:
        r.setdefault("program", prog.path)
        r["measured_at"] = dt.datetime.now().isoformat(timespec="seconds")
    return RunOutcome(prog.path, impl, records, rc, round(seconds, 2), note, err[-2000:])


# --------------------------------------------------------------------------------------
# machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _peer_versions() -> dict[str, Any]:
    if not PEERS_PY.exists():
        return {}
    code = (
        "import importlib.metadata as m, json, platform\n"
        "def v(d):\n"
        "    try: return m.version(d)\n"
        "    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{'python': platform.python_version(), **{{d: v(d) for d in "
        f"{list(PEERS) + ['torch']!r}}}}}))"
    )
    try:
        out = subprocess.run(
            [str(PEERS_PY), "-c", code], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return {}


def cpu_ticks() -> list[int] | None:
    """The aggregate ``cpu`` line of /proc/stat (user ... steal), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    return [int(x) for x in fields[1:9]]


def steal_percent(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of CPU time the hypervisor took from this machine between two samples."""
    if before is None or after is None:
        return None
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta)
    return round(100.0 * delta[7] / total, 1) if total > 0 else None


def machine_info() -> dict[str, Any]:
    loop = "asyncio"
    uv = _version("uvloop")
    if uv:
        loop = f"uvloop {uv}"
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _mem_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "event_loop": loop,
        "palatine": _version("palatine"),
        "peers": _peer_versions(),
        "loadavg_at_start": load,
    }


# --------------------------------------------------------------------------------------
# results


def _today() -> str:
    return dt.date.today().isoformat()


def _latest_results(exclude: Path | None = None) -> Path | None:
    files = sorted(p for p in RESULTS.glob("????-??-??.json") if p != exclude)
    return files[-1] if files else None


def _load(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _ratio(ours: float, peer: float, higher_is_better: bool) -> float | None:
    if ours <= 0 or peer <= 0:
        return None
    return ours / peer if higher_is_better else peer / ours


def _value(rec: dict[str, Any] | None) -> float | None:
    v = rec.get("value") if rec else None
    return float(v) if isinstance(v, (int, float)) else None


def summarize(metric: str, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One metric's entry: ours, each peer, the ratios (>1: palatine better), the target."""
    any_rec = next(iter(records.values()), {})
    unit, hib, target = METRICS.get(
        metric, (any_rec.get("unit", ""), bool(any_rec.get("higher_is_better", True)), Target("—"))
    )
    ours = records.get(OURS)
    peers = {k: v for k, v in records.items() if k != OURS}
    ours_v = _value(ours)
    ratios: dict[str, float | None] = {}
    for name, rec in peers.items():
        pv = _value(rec)
        ratios[name] = None if ours_v is None or pv is None else _ratio(ours_v, pv, hib)
    peer_vals = {k: _value(v) for k, v in peers.items() if _value(v) is not None}
    best_peer = None
    if peer_vals:
        best_peer = (max if hib else min)(peer_vals, key=lambda k: peer_vals[k])
    vs_best = ratios.get(best_peer) if best_peer else None

    met: bool | None = None
    checks: list[str] = []
    if ours_v is not None:
        oks: list[bool] = []
        if target.limit is not None:
            ok = ours_v >= target.limit if hib else ours_v <= target.limit
            oks.append(ok)
            checks.append(f"{'≥' if hib else '≤'} {target.limit:g}: {'yes' if ok else 'no'}")
        if target.peer_factor is not None and vs_best is not None:
            ok = vs_best >= target.peer_factor
            oks.append(ok)
            checks.append(f"≥ {target.peer_factor:g}× {best_peer}: {'yes' if ok else 'no'}")
        for name, factor in target.peer_factors:
            r = ratios.get(name)
            if r is None:  # that peer measured nothing: no check either way
                checks.append(f"≥ {factor:g}× {name}: not measured")
                continue
            ok = r >= factor
            oks.append(ok)
            checks.append(f"≥ {factor:g}× {name}: {'yes' if ok else 'no'}")
        own_target = ours.get("target_value") if ours else None  # for run-dependent targets
        if isinstance(own_target, (int, float)):
            ok = ours_v >= own_target if hib else ours_v <= own_target
            oks.append(ok)
            checks.append(
                f"{'≥' if hib else '≤'} {own_target:g} (from the run): {'yes' if ok else 'no'}"
            )
        # Conditions that are not numbers ("with the stack"): booleans the program checked.
        requires = ours.get("requires") if ours else None
        if isinstance(requires, dict):
            for name, ok in requires.items():
                oks.append(ok is True)
                checks.append(f"{name}: {'yes' if ok is True else 'no'}")
        if oks:
            met = all(oks)
    return {
        "unit": unit,
        "higher_is_better": hib,
        "target": target.text,
        "palatine": ours,
        "peers": peers,
        "ratios": ratios,
        "best_peer": best_peer,
        "ratio_vs_best_peer": vs_best,
        "met": met,
        "checks": checks,
    }


def build_results(
    previous: dict[str, Any],
    fallback_peers: dict[str, Any] | None,
    outcomes: list[RunOutcome],
    machine: dict[str, Any],
    argv: list[str],
) -> dict[str, Any]:
    # (metric -> impl -> record), starting from what the day's file already holds.
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for metric, entry in previous.get("metrics", {}).items():
        recs: dict[str, dict[str, Any]] = {}
        if entry.get("palatine"):
            recs[OURS] = entry["palatine"]
        recs.update(entry.get("peers") or {})
        table[metric] = recs
    if fallback_peers:
        src = fallback_peers["_source"]
        for metric, entry in fallback_peers.get("metrics", {}).items():
            for name, rec in (entry.get("peers") or {}).items():
                if name not in table.setdefault(metric, {}):
                    table[metric][name] = {**rec, "carried_from": rec.get("carried_from", src)}
    for out in outcomes:
        for rec in out.records:
            table.setdefault(rec["metric"], {})[rec["impl"]] = rec

    # Every metric of the goals gets a row, measured or not, then any others printed.
    order = list(METRICS) + sorted(m for m in table if m not in METRICS)
    metrics = {m: summarize(m, table.get(m, {})) for m in order}
    runs = [
        {
            "program": o.program,
            "impl": o.impl,
            "rc": o.rc,
            "seconds": o.seconds,
            "note": o.note,
            "metrics": [r["metric"] for r in o.records],
        }
        for o in outcomes
    ]
    return {
        "date": previous.get("date", _today()) if previous else _today(),  # (the file's day)
        "generated_at": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["bench/run.py", *argv]),
        "machine": machine,
        "metrics": metrics,
        "runs": runs,
        # what earlier runs of the same day did (their records were merged above)
        "earlier_runs": (previous.get("runs", []) + previous.get("earlier_runs", []))[:50],
    }


# --------------------------------------------------------------------------------------
# BENCHMARKS.md


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if abs(v) >= 1000:
        s = f"{v:,.0f}"
    elif abs(v) >= 100:
        s = f"{v:.0f}"
    elif abs(v) >= 10:
        s = f"{v:.1f}"
    elif abs(v) >= 0.1:
        s = f"{v:.2f}"
    else:
        s = f"{v:.3g}"
    return f"{s} {unit}"


def _cell(rec: dict[str, Any] | None, unit: str) -> str:
    if not rec:
        return "—"
    v = _value(rec)
    if v is None:
        return "error"
    s = _fmt(v, unit)
    if rec.get("capped_reps"):
        s = f"≥ {s} (cap)"
    if rec.get("carried_from"):
        s += " †"
    return s


def _machine_line(m: dict[str, Any]) -> str:
    peers = m.get("peers") or {}
    pv = ", ".join(f"{k} {peers[k]}" for k in (*PEERS, "torch") if peers.get(k))
    parts = [
        f"{m.get('cpu_model')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB",
        str(m.get("os")),
        f"Python {m.get('python')} ({m.get('event_loop')})",
        f"palatine {m.get('palatine') or '—'}",
    ]
    if pv:
        parts.append(f"peers: {pv} (Python {peers.get('python', '?')})")
    if m.get("loadavg_at_start") is not None:
        parts.append(f"load average at start {m['loadavg_at_start'][0]}")
    if m.get("steal_pct") is not None:
        parts.append(f"CPU time taken by the hypervisor during the run (steal) {m['steal_pct']} %")
    return "; ".join(parts)


def _target_cell(e: dict[str, Any]) -> str:
    """The goal's text, plus the bound it gives at the settings the program used."""
    own = (e.get("palatine") or {}).get("target_value")
    if not isinstance(own, (int, float)):
        return e["target"]
    return f"{e['target']} (here {'≥' if e['higher_is_better'] else '≤'} {_fmt(own, e['unit'])})"


def render_markdown(res: dict[str, Any]) -> str:
    metrics: dict[str, Any] = res["metrics"]
    shown_peers = [p for p in PEERS if any(p in e["peers"] for e in metrics.values())]
    shown_peers += sorted({p for e in metrics.values() for p in e["peers"]} - set(shown_peers))
    head = ["metric", "palatine", *shown_peers, "ratio (palatine vs best peer)", "target", "met?"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run.py`); do not edit by hand. Latest run: "
        f"{res['generated_at']}, recorded in `bench/results/{res['date']}.json`.",
        "",
        f"**Machine:** {_machine_line(res['machine'])}.",
        "",
        "Every number is the median of ≥ 5 repetitions, measured side by side in one run on the "
        "same machine. The ratio is oriented so that **> 1 means palatine is better** (ours/peer "
        'for rates, peer/ours for times). A target written as "N× the better peer (≥ X)" is '
        "met only when both hold.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    notes: list[str] = []
    for metric, e in metrics.items():
        unit = e["unit"]
        ratio = e["ratio_vs_best_peer"]
        ratio_s = f"{ratio:.2f}× vs {e['best_peer']}" if ratio is not None else "—"
        met = {True: "yes", False: "no", None: "—"}[e["met"]]
        row = [
            f"`{metric}`",
            _cell(e["palatine"], unit),
            *(_cell(e["peers"].get(p), unit) for p in shown_peers),
            ratio_s,
            _target_cell(e),
            met,
        ]
        lines.append("| " + " | ".join(row) + " |")
        for impl, rec in [(OURS, e["palatine"]), *e["peers"].items()]:
            if not rec:
                continue
            if rec.get("error"):
                notes.append(f"`{metric}` / {impl}: error: {rec['error'].splitlines()[0]}")
            extra = {k: v for k, v in rec.items() if k not in _STD_KEYS}
            if extra:
                notes.append(
                    f"`{metric}` / {impl}: "
                    + ", ".join(
                        f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in extra.items()
                    )
                )
    if any(rec.get("carried_from") for e in metrics.values() for rec in e["peers"].values()):
        notes.append("† carried over from an earlier results file (run with `--skip-peers`).")
    run_notes = [
        f"`{r['program']}` ({r['impl']}): {r['note']}" for r in res.get("runs", []) if r.get("note")
    ]
    lines += [""]
    if notes or run_notes:
        lines += ["Notes:", ""] + [f"* {n}" for n in notes + run_notes] + [""]
    lines += [
        "## How to run",
        "",
        "```",
        "make bench                                           # everything",
        ".venv/bin/python bench/run.py --only cast_gather_4   # one metric (repeatable)",
        ".venv/bin/python bench/run.py --skip-peers           # peers from the last results",
        ".venv/bin/python bench/run.py --setup-peers          # make bench/.peers-venv first",
        ".venv/bin/python bench/run.py --reps 7 --timeout 600 # reps; seconds per program",
        "```",
        "",
        "The peers live in their own virtualenv, `bench/.peers-venv` (git-ignored), made from "
        "`bench/requirements-peers.txt`: `torch==2.13.0` is installed first, then the rest. "
        "Each program can also be run alone and prints one JSON line per metric, e.g. "
        "`bench/.peers-venv/bin/python bench/peers/ray_actors.py --only cast_gather_4 --reps 5`.",
        "",
        "## What is measured",
        "",
        "The same program shape for every implementation (an actor with plain `def` endpoints "
        "taking and returning a small int):",
        "",
        "* `1_1_actor_calls_sync`: one caller, one actor in another process; call → reply, one at "
        "a time (calls/s).",
        "* `1_1_actor_calls_async`: the same actor, 1,000 calls issued before any reply is "
        "awaited, then all gathered (calls/s).",
        "* `cast_gather_4`: call every actor of a 4-process mesh and gather the 4 replies, one "
        "operation at a time (ms per operation).",
        "* `spawn_4_to_first_call_s`: start 4 processes with an actor each until a first call to "
        "all of them has returned; the caller's own runtime (Ray's local node) is already up.",
        "* `detect_sigkill_s`: a call pending on one actor of a 4-process mesh, that actor's "
        "process SIGKILLed; time until the pending call raises in the caller (capped at 30 s).",
        "",
        "palatine's system-level metrics (`bench/system_bench.py`; a real `palatine system` "
        "process, no peer equivalent):",
        "",
        "* `system_1k_procs_cpu`: the system process serving 1,000 simulated procs (joined "
        "ManagedBySystem from one client process, which sends each a `SupervisionUpdate` at "
        "1 Hz, spread evenly); the system's CPU time over a 2 s steady-state window divided by "
        "the window (% of one core).",
        "* `snapshot_1k_procs_ms`: the same 1,000 labelled procs, heartbeats running; a "
        "`Snapshot` filtered on a proc label that all of them carry, request → reply from the "
        "client (median of ≥ 20 requests).",
        "* `detect_sigkill_system_s`: `palatine system` + `palatine host` + a world of 4 "
        "exec'd workers; one worker SIGKILLed; time until a snapshot (polled every 5 ms) shows "
        "it `Exited` with signal 9.",
        "",
        "palatine's client-API metrics (`bench/controller_bench.py`; `local_mesh(hosts=1, "
        "procs_per_host=4)`: real system, host and controller processes and 4 exec'd workers, "
        "the client in the benchmark process; the no-op is "
        '`remote("palatine.tensor.worker.functions.identity")`):',
        "",
        "* `controller_invocations_per_s`: N no-op remote calls on all 4 ranks (each result "
        "discarded), then one `fetch` of the last value, which completes only after every "
        "earlier call has completed on every rank; N / (first issue → fetch returned), N sized "
        "so a repetition takes about 1 s. The extras split a repetition into issuing and "
        "draining and give each process's CPU time per 1,000 calls.",
        "* `controller_invocations_printing_per_s`: the same with a function that prints one "
        "line per call, every line streamed to the client (four identical lines per call "
        "shown once); runs interleaved with silent ones, `vs_silent` is the ratio.",
        "* `fetch_roundtrip_ms`: `fetch(remote(identity)(i), shard=0).result()` one at a time "
        "on the same mesh (ms per round trip).",
        "* `local_mesh_4_to_first_fetch_s`: `local_mesh` (4 workers) + the first remote call "
        "+ its fetch returning, from a running interpreter with palatine imported "
        "(`local_mesh_s`: the part inside `local_mesh`).",
        "* `detect_sigkill_client_s`: on that fresh mesh, a long call (`time.sleep`) on rank 0 "
        "fetched; rank 2's worker SIGKILLed; time until the pending fetch raises "
        "`palatine.DeviceException` (capped at 30 s).",
        "",
        "Mesh tensors, side by side with torchmonarch's tensor engine (one program shape, "
        "`bench/_tensor_shape.py`; palatine: `bench/tensor_bench.py` on `local_mesh(hosts=1, "
        "procs_per_host=2)`; torchmonarch: `bench/peers/monarch_tensors.py` on "
        '`this_host().spawn_procs(per_host={"gpus": 2})`; both on CPU):',
        "",
        "* `tensor_ops_per_s`: `with mesh.activate(): x = torch.zeros(64, 64)`, then N times "
        "`x = x + 1`, then one `inspect(x.sum())`, checked to be 64 · 64 · N; N / (first op "
        "issued → inspect returned), N sized after a warm-up so a repetition takes ≥ 1 s "
        "(`ops_per_rep`, `rep_s`).",
        "* `tensor_fetch_roundtrip_ms`: on the same mesh, `inspect(x + i)` of an 8-element "
        "mesh tensor one at a time, each value checked (ms per round trip): "
        "`fetch_roundtrip_ms` with a mesh tensor.",
        "",
        "The demo's training step (one program shape, `bench/_train_shape.py`): the MLP of "
        "`palatine demo` (`mlp(128)`, teacher `mlp(32)`, MSE, SGD lr 0.05 momentum 0.9, batch "
        "64 per rank) data parallel on 2 CPU ranks of one host, gradients averaged over the "
        "ranks every step; N steps ended by one fetch of the last loss, N sized so a "
        "repetition takes about 1 s (`steps_per_rep`, `rep_s`); the styles of one mesh "
        "interleaved:",
        "",
        "* `torch_style_step_per_s`: palatine (`bench/train_bench.py`, `local_mesh(hosts=1, "
        "procs_per_host=2)`): plain torch on mesh tensors as `palatine demo --style torch` "
        "does it (model built under `mesh.activate()`, batch from a remote function, "
        "forward, backward, each gradient's `reduce_` over the mesh, `optimizer.step()`; "
        "inside `palatine.coalescing()` where it exists: extra `variant`). torchmonarch "
        "(`bench/peers/monarch_train.py`): the same on its tensor engine. torchrun: "
        "`torch.distributed.run --standalone --nproc-per-node 2 "
        "bench/peers/torchrun_train.py` (gloo, the demo's `train_step`), timed in rank 0. "
        "The run's function-style figure ×0.9 is the `target_value`.",
        '* `function_style_step_per_s`: `remote(train_step, mutates=("state",))(state)` of '
        "`palatine demo` on the same mesh.",
        "* `torch_style_plain_step_per_s`: the torch-style step without coalescing, where the "
        "headline is the coalesced one.",
        "",
        "palatine's fault-detection and transfer metrics (`bench/fault_bench.py`; the same "
        "`local_mesh(hosts=1, procs_per_host=4)`; a detection ends the session, so each "
        "repetition starts a fresh mesh, not timed). Where a target depends on settings, the "
        'program records them and the bound they give (`target_value`, shown as "here ≤ …"):',
        "",
        "* `detect_sigstop_s`: `supervision_update_timeout_s=1.0`, "
        "`supervision_update_interval_s=0.2`; a long `time.sleep` on rank 2 fetched; rank "
        "2's worker SIGSTOPped (SIGCONTed afterwards); time from the SIGSTOP until the pending "
        "fetch raises `palatine.DeviceException`. A fetch that has not raised after 20 s "
        "(client never told) is reported as an error, not a number.",
        "* `detect_hang_s`: `operation_timeout_s=1.0`, "
        "`worker_progress_check_interval_s=0.2`, `fail_on_worker_timeout=True`; one call "
        "on all ranks in which rank 3 spins in a pure-Python busy loop, fetched from rank 0; "
        "time from issuing the call until `palatine.StuckWorkersException` is raised. Met only "
        "if the exception also names the rank, the op (the remote function) and has a Python "
        "stack with frames of the stuck function and its loop (`requires`).",
        "* `tensor_transfer_GBps`: a 64 MiB float32 tensor made on every rank (not timed), then "
        "`fetch(t, shard=1).result()` of it repeatedly; 67,108,864 bytes / seconds of one "
        "fetch / 1e9 (median of ≥ 5 fetches; `cpu_ms_per_fetch` per process).",
        "",
        "palatine's scaling metrics (`bench/scaling_bench.py`; the goals ask that costs grow "
        "linearly or better with the number of procs, 4 → 64, and the message size, 64 B → "
        "64 MiB). Each measures a series and reports its worst *local exponent*: between two "
        "neighbouring points, log(t₂/t₁) / log(x₂/x₁); 1 is linear, less is better, and no "
        "segment of the range may be worse:",
        "",
        "* `scaling_cast_procs_exponent`: `mesh.ping.call(i).get()` (`cast_gather_4`'s shape) "
        "on meshes of 4, 8, 16, 32 and 64 real procs on this host; ms per operation at each "
        "size. Up to `cast_fanout` (8) procs the caller writes one request per rank itself; "
        "above it the request goes down the cast tree (⌈log₈ n⌉ levels, `tree_depth`), and "
        "the replies come straight back. All procs share the 2 cores, so the total work, and "
        "the time, grows at least linearly here.",
        "* `scaling_msg_size_exponent`: one actor in another proc, `call_one(payload).get()` "
        "with a `bytes` payload it returns, for 64 B, 4 KiB, 256 KiB, 4 MiB and 64 MiB. This "
        "machine's own cost of moving bytes is far from linear (a copy that fits the CPU "
        "caches is an order of magnitude cheaper per byte), so each time is divided by one "
        "plain copy of the payload (`copy_ms`; `call_in_copies`), and the exponent is that of "
        "the ratio, plus 1: 1 means the call grows exactly as copying the bytes does. The raw "
        "exponents are in the extras too.",
        "",
        "Recovery and the control plane (`bench/recovery_bench.py`, "
        "`bench/control_plane_bench.py`):",
        "",
        "* `recover_after_sigkill_s`: the demo's data-parallel MLP on 4 CPU ranks (gloo); one "
        "rank SIGKILLed from outside; time from the kill until the first training step after "
        "it has completed on every rank. palatine: `mesh.recover()`, a new process group, the "
        "state made again on the new rank and resynced from a survivor. torchrun: "
        "`--max-restarts=1`, a checkpoint after every step, every rank restarted and loading it.",
        "* `detect_system_loss_s`: `local_mesh(1, 2, system_restarts=0)`, a fetch pending when "
        "the `palatine system` process is SIGKILLed and stays down; time until the fetch "
        "raises `DeviceException` (`system_lost`); `teardown_s`: leaving the `with` block "
        "after it.",
        "* `system_restart_job_continues_s`: `local_mesh(1, 2)` (it starts its system again); "
        "calls keep running while the `palatine system` process is SIGKILLed; time until the "
        "new system has every proc of the job back (both worlds Live, same pids); "
        "`longest_call_gap_s`: the longest wait between two completed calls across it; "
        "`failed_calls`: calls that failed (0 wanted).",
        "* `teardown_after_sigint_s`: a script with `local_mesh(1, 2)` and a pending fetch gets "
        "SIGINT; time until its process has exited (`roles_left_after_5s`: roles still running).",
        "* `fetch_1GiB_peak_ratio`: a remote function makes a 1 GiB float32 tensor, which is "
        "fetched; the sum over the job's processes of each one's peak memory growth (kernel "
        "high-water mark), divided by 1 GiB; a fresh interpreter and job per repetition.",
        "",
        "Loops run about 0.5 s per repetition after a warm-up; the value is the median of the "
        "repetitions (all of them are in the results file). The other metrics and their "
        "targets are those of the project's goals; their programs are `bench/system_bench.py`, "
        "`bench/controller_bench.py` and `bench/fault_bench.py`.",
        "",
    ]
    lines += _where_time_goes(metrics)
    return "\n".join(lines)


# Profiles of the metrics that are far from their targets (py-spy on the controller and a
# worker, cProfile on the client's issuing thread, psutil CPU per process), written by
# hand when the profile was taken; BENCHMARKS.md shows them under the current numbers.
WHERE_TIME_GOES: dict[str, list[str]] = {
    "1_1_actor_calls_sync": [
        "Measured 2026-12-03: a plain thread's blocking call now writes the request and reads "
        "the reply on its own unix connection to the actor's proc (a lane, "
        "`palatine/fastpath/lane.py`), so the palatine loop thread is no longer in the path. The "
        "caller's system time fell from ≈ 100-200 to ≈ 13-30 µs per call (context switches "
        "from ≈ 4.3 to ≈ 1 per call), and the actor's proc runs a plain `def` endpoint "
        "inline from the read callback (epoll, read, write: 3 syscalls per call). Per call "
        "the caller spends ≈ 41-60 µs user and the actor's proc ≈ 36-55 µs user + 11-38 µs "
        "system.",
        "Left: this VM's floor. A blocking C-level echo between two processes takes 51-74 µs "
        "per round trip and a blocking client against a uvloop echo server 67-86 µs; the "
        "same program swings 3× over the day (5,300/s in a slow hour, 9,000-9,800/s in a "
        "quiet one). What remains is Python on both sides (frame decode, unpickle, "
        "dispatch, pickle, encode: ≈ 30-40 µs each).",
        "Measured 2026-12-03, later: most of that floor was waking idle vCPUs. This VM "
        "halts an idle vCPU at once (guest halt-polling is off), and waking one costs "
        "≈ 20-40 µs, once on each side of a round trip; a C echo that polls for 20 µs "
        "before blocking takes ≈ 7 µs per round trip against ≈ 45-55 µs. The idle spin "
        "(`palatine/channel/spin.py`, `PALATINE_IDLE_SPIN_US`, default 100) does the same: "
        "a thread waiting for a lane reply polls its socket for up to 100 µs before it "
        "blocks, and a proc whose loop just read a lane request keeps polling for 100 µs, "
        "yielding the CPU on every round. Interleaved runs: 16,700-22,700/s with it against "
        "4,200-5,600/s without.",
    ],
    "cast_gather_4": [
        "Measured 2026-12-03: `mesh.call(...).get()` from a plain thread sends one request "
        "per rank over the thread's lanes and polls the four sockets for the replies "
        "(`palatine/fastpath/lane.py`); before, each gather cost two loop-thread hops on the caller "
        "(≈ 280 µs of system time per call in a slow hour).",
        "The idle spin (see `1_1_actor_calls_sync`) also serves the four lanes of a gather "
        "(the caller polls them for up to 100 µs before blocking): reps 0.29-0.36 ms, "
        "0.20-0.34 ms in a quiet hour; 5 processes share the 2 cores.",
    ],
    "1_1_actor_calls_async": [
        "Futures that are not waited on at once go through the loop as before (a lane "
        "future is sent the ordinary way on its thread's next palatine operation): 1,000 "
        "calls in flight are throughput-bound, ≈ 36 µs of caller CPU and ≈ 20 µs of actor "
        "CPU per call.",
        "Measured 2026-12-03, later, per thread: the caller's main thread spends ≈ 14 µs per "
        "call issuing and waiting, its loop thread ≈ 23-25 µs sending and receiving (the "
        "largest single item is decoding each reply frame's header, ≈ 1.3 µs alone and ≈ 3 µs "
        "in the busy loop), and both share one GIL; the actor's proc spends ≈ 21 µs. Saved "
        "≈ 3 µs of loop time per call: long deadlines (the call default is an hour) share "
        "one sweep per loop instead of a timer each (arming and cancelling a uvloop timer "
        "costs ≈ 2 µs), and a mesh call's payload is no longer pickled a second time on the "
        "loop path. The idle spin does not help here: the caller is busy, not waiting.",
        "Measured 2026-12-03, later still: `call_one` futures that a thread makes for one "
        "actor before it waits now form a batch on its lane (`palatine/fastpath/lane.py`): waiting "
        "on any of them writes all the requests at once and reads until each has its "
        "outcome, so the loop thread is out of the path (its CPU per call fell from ≈ 24 "
        "to ≈ 2 µs). The first try gained little (22,000-26,000/s): the garbage collector "
        "took ≈ 7 µs per call, as each call in flight held 18 collectable objects "
        "(closures, cells, lists), and a full collection ran about once per 1,000 calls. "
        "Each call is now one object (`Call`: 4 collectable objects per call in flight), "
        "a batch joins a call to its actor without routing it again, and the actor's proc "
        "writes the replies of one read in one write. Per call: caller ≈ 12-14 µs (≈ 7 µs "
        "making the future, the rest writing, reading and decoding), the actor's proc ≈ "
        "12-15 µs. Left: the caller and the actor's proc work in turn, not at once (the "
        "requests leave only when the caller waits), and frame header decoding (≈ 1.3 µs "
        "per message on each side).",
        "Measured 2026-12-03, night: a batch's requests now leave in chunks of 16, 32, … "
        "up to 256 as they are encoded (`palatine/fastpath/lane.py`), so the actor's proc starts "
        "on the first ones while the caller encodes the rest, and the proc writes a lane's "
        "replies every 32 instead of once per read, so the caller decodes the first replies "
        "while later requests are still being handled. Interleaved runs of this program: "
        "median 39,500-50,700/s before, 48,500-57,700/s after. Choosing between the stdlib "
        "pickler and cloudpickle no longer scans each pickle with a regular expression "
        "(the picklers note it as they meet `__main__`, lambdas and local code): ≈ 0.5 µs "
        "less per call on each side. Left: this VM's stalls of 2-5 ms in either process "
        "during a batch (seen in timelines of both sides; not the garbage collector).",
    ],
    "scaling_msg_size_exponent": [
        "Measured 2026-12-03: a 64 MiB round trip took ≈ 1.4 s; 0.7 s of it were two scans "
        "of the pickle with a regular expression, to decide whether the value needs "
        "cloudpickle (≈ 190 MB/s). The picklers now decide from the objects they meet "
        "(`refers_by_value`), and a lane receives the rest of a big frame straight into its "
        "pooled buffer. What is left is copying: a `bytes` payload travels in band, so each "
        "way it is pickled, encoded into the msgpack header, joined to the length prefix, "
        "copied by the kernel, received, decoded out of the header and unpickled: ≈ 20 "
        "copies' worth at 64 MiB (`call_in_copies`), and beyond the CPU caches this VM "
        "copies at only 1.2-1.7 GB/s. Next: carry a large in-band pickle as a raw buffer "
        "beside the header (as out-of-band buffers already are), which saves about three "
        "copies each way.",
    ],
    "scaling_cast_procs_exponent": [
        "Measured 2026-12-03: the series is sublinear except for one step, at 8 → 16 procs, "
        "where the cast changes form: up to `cast_fanout` (8) ranks "
        "the calling thread writes one request per rank on its own lanes and polls their "
        "replies; above it the request goes through the loop thread and down the cast tree, "
        "with one more hop (the heads' comm actors) on the way. With `PALATINE_CAST_FANOUT=16`, "
        "9 procs take ≈ 0.65 ms against ≈ 1.3 ms through the tree. From 16 to 64 procs (the "
        "tree throughout) the time grows more slowly than the number of procs.",
        "CPU per operation (psutil, all processes, a quiet hour): 8 procs 0.67 ms wall, "
        "≈ 0.35 ms in the caller and ≈ 0.8 ms in the procs; 16 procs 1.74 ms wall, ≈ 0.7 ms "
        "in the caller (16 replies through its loop thread) and ≈ 2.1 ms in the procs (the 8 "
        "heads also decode and forward the cast): ≈ 2.8 ms of CPU on 2 cores, so the wall "
        "time is CPU-bound.",
        "Measured 2026-12-04 (psutil, CPU per operation divided by the procs addressed): "
        "4 procs 85 µs per proc, 8 (lanes) 87, 16 (tree) 158, 64 (tree) 225. Not the tree: "
        "with `PALATINE_CAST_FANOUT=16` (16 lanes, no tree) 16 procs take 2.3 ms and 158 µs "
        "per proc as well, and with `PALATINE_CAST_FANOUT=64` 64 procs take 9.8 ms. What "
        "grows is the cost of each wake-up with the number of live processes on the 2 cores: "
        "the same 4-rank call over lanes takes 0.28 ms with 4 procs alive and 0.67 ms when "
        "the 4 are a slice of 64 live procs (the caller's CPU per call doubles too, "
        "0.15 → 0.29 ms, for the same work); the 60 idle procs take ≈ 10 % of one core "
        "between them (heartbeats). So on this machine the series measures the scheduler "
        "and the caches as much as the cast; a machine with a core per proc would show the "
        "cast's own growth.",
    ],
    "controller_invocations_per_s": [
        "Measured 2026-12-03 (`cpu_ms_per_1k_calls`): client ≈ 22-30 µs, the 4 workers "
        "together ≈ 25-33 µs, controller ≈ 6-8 µs per call (it was 70-95, 90-135 and "
        "100-145 µs). What changed: the client sends everything one loop wake-up collects "
        "as one `Batch` (its Nodes, its commands with consecutive commands for the same "
        "ranks merged into one `CommandGroup`, its drops as one `DeleteRefs` per slice and "
        "one `DropRefs`), so the controller decodes and casts once per flush, not 2-4 times "
        "per call; completions of one `Status` go back as one `Results`; a worker hands a "
        "whole `CommandGroup` to each stream thread as one queue item; arguments that are "
        "all plain scalars are pickled by the C pickler directly.",
        "Left: the client issuing thread (`remote.__call__`: issue site capture, ref "
        "allocation, `RemoteValue` creation and its finalizer-driven drop) is now the "
        "largest share; workers still execute each command on a stream thread.",
    ],
    "fetch_roundtrip_ms": [
        "Measured 2026-12-03: a call and its fetch now go out as one `Batch` (one flush per "
        "round trip), and the client regroups a flush that addresses several slices per "
        "rank, so each worker gets one envelope (`CallFunction`, `SendValue` on rank 0, "
        "`RequestStatus`) and runs it as one stream-queue item. What remains is latency, "
        "not CPU: py-spy shows the workers busy ≈ 5 % of the time; the critical path has "
        "≈ 8 sequential wake-ups (client user → loop thread, controller, worker loop → "
        "stream → loop thread, controller, client loop → user thread) at ≈ 60-80 µs each "
        "on this VM, and the 4 workers' wake-ups share 2 cores. The controller's remaining "
        "CPU is mostly the socket writes themselves (`NetTx._flush` ≈ 45 % of its busy "
        "samples).",
        "The VM's speed swings about 3× over a day: this metric measured 0.91-1.07 ms in a "
        "quiet hour and 2-3.7 ms in a slow one. Tried on 2026-12-03 and reverted: writing "
        "what a read callback caused at its own end instead of on the next loop turn; "
        "interleaved runs were slower (1.5-3.1 ms against 1.3-1.9 ms), as early writes wake "
        "peers while this process still has work, with 6 processes on 2 cores. Next: save "
        "the worker's stream → loop hand-off (a thread wake-up per command group).",
        "Measured 2026-12-03, later (psutil per process over 5 s of round trips): client "
        "≈ 320 µs user + 100 µs system, controller ≈ 320 + 130 µs, each worker ≈ 140-200 + "
        "60-90 µs per round trip: ≈ 1.8 ms of CPU on 2 cores, so the metric is CPU-bound "
        "in slow hours. A third of the controller's GIL-holding samples are inside the "
        "socket write itself (`NetTx._flush`): the sender pays for waking the receiver's "
        "halted vCPU. Tried and not kept: the idle spin on every loop (not only lanes), "
        "and on the controller's loop alone; interleaved runs were no faster (1.26-1.99 ms "
        "against 1.07-1.81 ms), as spinning processes take turns from the 4 workers and "
        "from the threads that share their GIL.",
        "Measured 2026-12-03, evening: a timeline of 2,800 round trips (timestamps in every "
        "process) put ≈ 200 µs of each worker's path in its two thread hand-offs and "
        "≈ 200 µs of the client's in its loop hops. Worker streams now send their results, "
        "and client threads their calls, on a direct session to the controller's proc "
        "(`palatine/fastpath/direct_tx.py`): no loop wake-up for either; a worker's loop "
        "thread blocks once per round trip instead of 2.3-3.2 times, and a round trip "
        "takes ≈ 1.1 ms of CPU instead of ≈ 1.35 ms. Tensor workers also run SCHED_BATCH: "
        "the controller had been preempted by the first worker it woke before writing to "
        "the other three (≈ 1.8 involuntary switches per round trip); interleaved runs "
        "were 6-19 % faster with it. What is left: the worker's loop → stream hand-off "
        "(the loop must stay free while a stream runs user code) and the client's loop → "
        "user-thread wake-up on the Result.",
    ],
    "local_mesh_4_to_first_fetch_s": [
        "Measured 2026-12-03: CPU workers no longer import torch before they report ready "
        "(each path that needs torch imports it on first use), and a host starts its "
        "workers by forking them from a fork server that has the worker modules imported "
        "(`palatine/hosting/forkserver.py`; `PALATINE_FORK_SERVER=0` turns it off). What is left is "
        "mostly starting the system, host and controller interpreters on 2 cores.",
        "Not in the metric: `mesh.shutdown()` takes ≈ 3 s.",
    ],
    "detect_hang_s": [
        "Measured 2026-12-03: when a deadline is armed (at the Node), the controller also "
        "schedules a one-shot progress check for 5 ms after it falls due "
        "(`CheckWorkerProgress{at_deadline}`), so the report starts at ≈ operation_timeout "
        "whatever the phase of the periodic check; what is left on top is the stall report "
        "itself (progress query and stack dump of the stuck rank) and the `Failure` to the "
        "client, ≈ 0.1-0.15 s here. Before, the report waited for the next periodic tick "
        "(anywhere in [due, due + interval]).",
        "Measured 2026-12-04: the stall report itself took 0.1-0.23 s because the stuck "
        "rank's stream spins in Python: each time the worker's loop thread gave up the GIL "
        "(a read, a write) it waited out Python's 5 ms switch interval to get it back. Worker "
        "procs now switch every 1 ms (`worker_switch_interval_us`): interleaved runs gave "
        "1.04-1.05 s against 1.10-1.22 s, and `controller_invocations_per_s` and "
        "`fetch_roundtrip_ms` measured no worse (29,600-36,700/s and 0.79-0.83 ms against "
        "28,500-29,300/s and 0.87-0.93 ms).",
    ],
    "tensor_transfer_GBps": [
        "Measured 2026-12-03: a fetched value's buffers now travel out of band end to end: "
        "`Pickled.buffers` become `Envelope.buffers` (msgpack carries only index "
        "references), the controller forwards them without decoding or copying, receivers "
        "read a big frame straight into a pooled writable buffer (`asyncio.BufferedProtocol`, "
        "`palatine/wire/buffers.py`) and the client's tensor wraps that memory. CPU per "
        "fetch fell from ≈ 0.6-0.95 s to ≈ 10-30 ms per process. Fresh memory is expensive "
        "here (the kernel zeroes pages: 30-60 ms per 64 MiB), hence the pool, and a message "
        "with buffers asks for an immediate ack so the sender's memory returns to it at once.",
        "What is left is the two socket hops (worker → controller → client, store and "
        "forward), ≈ 25 ms each when the box is quiet, plus the snapshot copy on the worker "
        "(≈ 7 ms); single repetitions range 37-180 ms depending on load. Next: send the "
        "value worker → client directly and give the controller only the completion (one "
        "hop), or shared memory between procs on one host.",
        "2026-12-03, evening: a worker now sends its results on a direct session "
        "(`palatine/fastpath/direct_tx.py`); a message with buffers asks for its ack at "
        "once there too, else the worker's 64 MiB snapshot stayed held until the lazy ack "
        "and every fetch needed fresh memory (a run at 0.30 GB/s before that fix, "
        "1.2-1.9 GB/s after, the same as through the loop).",
        "2026-12-03, night: unix connections ask for a 4 MiB send buffer "
        "(`palatine/channel/net/sockets.py`, `tune_socket`; the kernel's default is ≈ 200 KiB, and "
        "it grants at most `net.core.wmem_max`, 4 MiB on this machine but ≈ 208 KiB on a "
        "stock kernel): "
        "64 MiB moved in ≈ 300 steps, each waking the reader and then the writer, on "
        "2 cores shared by 6 processes. Alternating runs: 1.4-1.7 GB/s before, 1.8-2.0 "
        "after, and the slow repetitions (100-300 ms) mostly gone.",
    ],
}


def _where_time_goes(metrics: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for metric, paras in WHERE_TIME_GOES.items():
        e = metrics.get(metric)
        if not e or not paras:
            continue
        now = _cell(e.get("palatine"), e["unit"])
        out += [f"### `{metric}` (now {now}; target {e['target']})", ""]
        out += [f"* {p}" for p in paras] + [""]
    if out:
        out = ["## Where the time goes", ""] + out
    return out


_STD_KEYS = {
    "metric",
    "impl",
    "value",
    "unit",
    "higher_is_better",
    "reps",
    "version",
    "error",
    "program",
    "measured_at",
    "carried_from",
    "procs",
    "in_flight",
    "cap_s",
}


# --------------------------------------------------------------------------------------
# peers' virtualenv


def setup_peers() -> None:
    base = getattr(sys, "_base_executable", None) or sys.executable
    if not PEERS_PY.exists():
        log(f"creating {PEERS_VENV.relative_to(ROOT)}")
        subprocess.run([base, "-m", "venv", str(PEERS_VENV)], check=True)
    pip = [str(PEERS_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch first and pinned: a bare torch would pull a large build.
    log(f"installing {TORCH_PIN}")
    subprocess.run([*pip, TORCH_PIN], check=True)
    log(f"installing {REQUIREMENTS_PEERS.relative_to(ROOT)}")
    subprocess.run([*pip, "-r", str(REQUIREMENTS_PEERS)], check=True)


# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="METRIC",
        help="run only this metric (repeatable, or comma separated)",
    )
    p.add_argument(
        "--skip-peers",
        action="store_true",
        help="run palatine's programs only; peer numbers come from the latest results",
    )
    p.add_argument(
        "--setup-peers",
        action="store_true",
        help="create bench/.peers-venv and install the peers before running",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions, passed to each program")
    p.add_argument(
        "--timeout", type=float, default=420.0, help="seconds allowed to each program (default 420)"
    )
    p.add_argument(
        "--no-write",
        action="store_true",
        help="print the results instead of writing the results file and BENCHMARKS.md",
    )
    args = p.parse_args(argv)
    args.only = sorted({m.strip() for item in args.only for m in item.split(",") if m.strip()})

    if args.setup_peers:
        setup_peers()

    machine = machine_info()
    ticks = cpu_ticks()
    outcomes: list[RunOutcome] = []
    for prog in PROGRAMS:
        if prog.peer is not None and args.skip_peers:
            continue
        out = run_program(prog, args)
        if out is None:
            continue
        if out.note and not out.records:
            log(f"{prog.path}: {out.note}")
        outcomes.append(out)

    # On a shared VM the host may take a large share of the CPU (20-40 % has been seen
    # here), which moves every latency figure: the run records it.
    machine["steal_pct"] = steal_percent(ticks, cpu_ticks())
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{_today()}.json"
    if args.only and not path.exists():
        # A partial run updates the newest results rather than starting a day of its own
        # that would hold only what it measured.
        path = _latest_results(exclude=path) or path
    previous = _load(path)
    fallback = None
    if args.skip_peers:
        src = _latest_results(exclude=path)
        if src is not None:
            fallback = {**_load(src), "_source": src.name}
    res = build_results(previous, fallback, outcomes, machine, argv)
    if args.no_write:
        print(json.dumps(res, indent=2, ensure_ascii=False))
        return 0
    path.write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")
    BENCHMARKS_MD.write_text(render_markdown(res))
    log(f"wrote {path.relative_to(ROOT)} and {BENCHMARKS_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
