"""Faults of the control plane and big values, through the client API.

Run with the project's interpreter::

    .venv/bin/python bench/control_plane_bench.py [--only METRIC] [--reps N]

Metrics (targets in ``bench/run.py``):

* ``detect_system_loss_s``: ``local_mesh(1, 2, system_restarts=0)`` (a system that
  stays down); a fetch of a remote function that sleeps is pending when the ``palatine
  system`` process is SIGKILLed; the value is the time from the kill until the fetch
  raises `palatine.DeviceException` (kind ``system_lost``). The extras give the time to
  leave the ``with`` block after it (``teardown_s``). Every repetition starts a fresh
  mesh (not timed).
* ``system_restart_job_continues_s``: ``local_mesh(1, 2)`` with its defaults (the mesh
  starts its system again); a thread keeps calling a remote function (one fetch after
  another) while the ``palatine system`` process is SIGKILLed. The value is the time
  from the kill until the new system's registry has every proc of the job back (the
  worker world and the controller's world Live, with the same pids): from then on it
  supervises the job as before. The extras give the longest wait between two completed
  calls across the restart (``longest_call_gap_s``) and the calls that failed
  (``failed_calls``, 0 wanted).
* ``teardown_after_sigint_s``: a script (a fresh interpreter) with ``local_mesh(1, 2)``
  and a pending fetch of a sleeping remote function gets SIGINT (Ctrl-C); the value is
  the time from the signal until the script's process has exited. The extras say how
  many of its roles (system, host, controller) were still running 5 s later (0 wanted).
* ``fetch_1GiB_peak_ratio``: ``local_mesh(1, 1)``; a remote function makes a 1 GiB
  float32 tensor, which is then fetched. The value is the sum, over every process of
  the job (client, system, host, controller, worker), of its peak resident memory
  during the fetch above its resident memory before, divided by 1 GiB: 1 is the value
  held once; the worker's and the client's copies make at least 2. The peak is the
  kernel's high-water mark (``VmHWM`` in ``/proc/PID/status``), reset before each
  repetition (``/proc/PID/clear_refs``) and after a warm-up fetch of a small tensor (so
  that torch's import in the worker and the client is not counted), so it needs Linux and permission to write
  there (root, or the processes' owner). Each repetition runs in a fresh interpreter and
  job. The job runs with ``PALATINE_MAX_VALUE`` at
  2 GiB: 1 GiB of data pickles to a little more than the default limit.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from _common import parse_args, run_metric

from palatine import DeviceException, fetch, local_mesh, remote
from palatine.channel.addr import parse
from palatine.core import runtime
from palatine.protocol.system import Snapshot
from palatine.system.service import System

VERSION = metadata.version("palatine")
GIB = 1 << 30
CAP_S = 60.0  # a detection not seen within this is an error, not a number


def log(msg: str) -> None:
    print(f"[control_plane_bench] {msg}", file=sys.stderr, flush=True)


def _sleep(seconds: float) -> int:
    import time

    time.sleep(seconds)
    return 1


def _ones(n: int) -> Any:
    import torch

    return torch.ones(n, dtype=torch.float32)


def _ones_gib() -> Any:
    import torch

    return torch.ones(GIB // 4, dtype=torch.float32)


# ---------------------------------------------------------------------- system loss


def measure_system_loss(reps: int) -> tuple[list[float], dict[str, Any]]:
    values: list[float] = []
    teardowns: list[float] = []
    for _ in range(reps):
        t_kill = t_seen = 0.0
        with local_mesh(1, 2, system_restarts=0) as mesh:
            with mesh.activate():
                fetch(remote(_sleep)(0.0)).result(timeout=60)  # up and importing done
                pending = fetch(remote(_sleep)(600.0))
                time.sleep(0.3)
                system = mesh._local.system.popen
                t_kill = time.monotonic()
                os.kill(system.pid, signal.SIGKILL)
                try:
                    pending.result(timeout=CAP_S)
                except DeviceException as e:
                    if e.kind != "system_lost":
                        raise RuntimeError(f"expected system_lost, got {e.kind}: {e}") from e
                    t_seen = time.monotonic()
                if not t_seen:
                    raise RuntimeError(f"the system's loss was not reported within {CAP_S} s")
        teardowns.append(round(time.monotonic() - t_seen, 3))
        values.append(t_seen - t_kill)
        log(f"system loss seen in {values[-1]:.2f} s, left in {teardowns[-1]:.2f} s")
    return values, {"teardown_s": teardowns}


# ---------------------------------------------------------------------- system restart


def _rebuilt(client: Any, pids: list[int]) -> bool:
    """Whether the system behind ``client`` has the job's procs back (bounded ask)."""

    async def ask() -> Any:
        return await client.ask(Snapshot(), 0.5)

    try:
        snap = runtime.submit(ask).get(2.0)
    except Exception:  # noqa: BLE001 - not back yet
        return False
    worker, ctl = snap.worlds.get("worker"), snap.worlds.get("controller")
    if worker is None or ctl is None or worker.status != "Live" or ctl.status != "Live":
        return False
    return sorted(e.pid for e in worker.procs.values()) == sorted(pids)


def _keep_calling(mesh: Any, stop: threading.Event, done: list[float], errors: list[str]) -> None:
    """One fetch after another until ``stop``: when each completed, and what failed."""
    with mesh.activate():
        while not stop.is_set():
            try:
                fetch(remote(_sleep)(0.0)).result(timeout=30)
                done.append(time.monotonic())
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(repr(e))


def measure_system_restart(reps: int) -> tuple[list[float], dict[str, Any]]:
    values: list[float] = []
    gaps: list[float] = []
    failed = 0
    for _ in range(reps):
        with local_mesh(1, 2) as mesh:
            with mesh.activate():
                pids = [fetch(remote(os.getpid)(), shard=r).result(timeout=60) for r in range(2)]
                client = runtime.submit(
                    lambda: System(parse(mesh._local.system_addr)).attach(timeout_s=10)
                ).get(20)
                stop = threading.Event()
                done: list[float] = []
                errors: list[str] = []
                caller = threading.Thread(
                    target=_keep_calling, args=(mesh, stop, done, errors), daemon=True
                )
                caller.start()
                time.sleep(0.3)
                t_kill = time.monotonic()
                os.kill(mesh._local.system.pid, signal.SIGKILL)
                time.sleep(0.05)
                while not _rebuilt(client, pids):
                    if time.monotonic() - t_kill > CAP_S:
                        raise RuntimeError(f"the job was not rebuilt within {CAP_S} s")
                    time.sleep(0.01)
                values.append(time.monotonic() - t_kill)
                time.sleep(0.5)
                stop.set()
                caller.join(30)
                runtime.submit(client.close).get(10)
                around = [t for t in done if t >= t_kill - 1.0]
                gaps.append(max(b - a for a, b in itertools.pairwise(around)))
                failed += len(errors)
        log(
            f"job rebuilt {values[-1]:.2f} s after the kill; longest call gap "
            f"{gaps[-1] * 1000:.0f} ms; {len(errors)} calls failed"
        )
    return values, {"longest_call_gap_s": [round(g, 4) for g in gaps], "failed_calls": failed}


# ---------------------------------------------------------------------- Ctrl-C

INTERRUPTED = textwrap.dedent(
    """
    import time
    from palatine import fetch, local_mesh, remote

    def ready():
        return 1

    def slow():
        import time
        time.sleep(600)
        return 1

    with local_mesh(1, 2) as mesh:
        with mesh.activate():
            fetch(remote(ready)()).result(timeout=60)
            print("roles", *[rp.popen.pid for rp in mesh._local.procs], flush=True)
            fetch(remote(slow)()).result()
    """
)


def measure_sigint(reps: int) -> tuple[list[float], dict[str, Any]]:
    values: list[float] = []
    left: list[int] = []
    for _ in range(reps):
        script = subprocess.Popen(
            [sys.executable, "-c", INTERRUPTED],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert script.stdout is not None
            words = script.stdout.readline().split()
            if not words or words[0] != "roles":
                raise RuntimeError(f"the script did not start its mesh: {words}")
            roles = [int(p) for p in words[1:]]
            time.sleep(0.5)  # the fetch is pending
            t0 = time.monotonic()
            script.send_signal(signal.SIGINT)
            script.wait(timeout=CAP_S)
            values.append(time.monotonic() - t0)
        finally:
            if script.poll() is None:
                script.kill()
                script.wait(10)
        deadline = time.monotonic() + 5.0
        while any(psutil.pid_exists(p) for p in roles) and time.monotonic() < deadline:
            time.sleep(0.05)
        left.append(sum(psutil.pid_exists(p) for p in roles))
        log(f"exited {values[-1]:.2f} s after SIGINT; roles left: {left[-1]}")
    return values, {"roles_left_after_5s": left}


# ---------------------------------------------------------------------- big fetch


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def _job_pids(mesh: Any) -> dict[str, int]:
    """The job's processes by role; a host's fork server is left out (it never holds a
    value; it imports torch in the background, which is not the fetch's memory)."""
    pids = {"client": os.getpid()}
    for name, rp in zip(("system", "host", "controller"), mesh._local.procs, strict=False):
        pids[name] = rp.popen.pid
    workers = [
        c
        for c in psutil.Process(pids["host"]).children(recursive=True)
        if "forkserver_main" not in " ".join(c.cmdline()) or c.ppid() != pids["host"]
    ]
    for i, child in enumerate(workers):
        pids[f"worker{i}"] = child.pid
    return pids


def one_big_fetch() -> dict[str, float]:
    """One 1 GiB fetch in a fresh job: each process's peak growth, in units of the value."""
    # 1 GiB of data pickles to a little more than the default limit of one value.
    os.environ["PALATINE_MAX_VALUE"] = str(2 * GIB)
    with local_mesh(1, 1) as mesh:
        with mesh.activate():
            # a small tensor first: torch's own import, in the worker and here, is not
            # part of what a fetch costs
            fetch(remote(_ones)(1024)).result(timeout=60)
            pids = _job_pids(mesh)
            before = {}
            for role, pid in pids.items():
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")  # reset the high-water mark to the current RSS
                before[role] = _status_kib(pid, "VmRSS")
            value = fetch(remote(_ones_gib)()).result(timeout=300)
            if value.numel() * 4 != GIB:
                raise RuntimeError(f"fetched {value.numel() * 4} bytes, not 1 GiB")
            return {
                role: max(0, _status_kib(pid, "VmHWM") - before[role]) / (GIB >> 10)
                for role, pid in pids.items()
            }


def measure_big_fetch(reps: int) -> tuple[list[float], dict[str, Any]]:
    """Each repetition in a fresh interpreter: a process keeps memory it freed (its
    allocator's, its connections' buffers), which a second fetch would reuse unseen."""
    values: list[float] = []
    per_role: dict[str, list[float]] = {}
    for _ in range(reps):
        out = subprocess.run(
            [sys.executable, __file__],
            env={**os.environ, ONE_FETCH_VAR: "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0:
            raise RuntimeError(f"the fetch failed: {out.stderr[-2000:]}")
        grown: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
        for role, g in grown.items():
            per_role.setdefault(role, []).append(round(g, 2))
        values.append(sum(grown.values()))
        shown = ", ".join(f"{role} {g:.2f}" for role, g in grown.items())
        log(f"1 GiB fetch: job peak {values[-1]:.2f}x the value ({shown})")
    return values, {"per_process_x": per_role, "value_bytes": GIB}


ONE_FETCH_VAR = "BENCH_ONE_BIG_FETCH"


def main() -> None:
    if os.environ.get(ONE_FETCH_VAR):
        print(json.dumps(one_big_fetch()), flush=True)
        return
    args = parse_args(__doc__.splitlines()[0])
    reps = max(3, args.reps or 3)
    run_metric(
        args, "detect_system_loss_s", "palatine", "s", False, VERSION,
        lambda: measure_system_loss(reps),
    )  # fmt: skip
    run_metric(
        args, "system_restart_job_continues_s", "palatine", "s", False, VERSION,
        lambda: measure_system_restart(reps),
    )  # fmt: skip
    run_metric(
        args, "teardown_after_sigint_s", "palatine", "s", False, VERSION,
        lambda: measure_sigint(reps),
    )  # fmt: skip
    run_metric(
        args, "fetch_1GiB_peak_ratio", "palatine", "x the value", False, VERSION,
        lambda: measure_big_fetch(reps),
    )  # fmt: skip


if __name__ == "__main__":
    main()
