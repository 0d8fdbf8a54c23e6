"""System-level benchmarks for palatine: a real system process, measured from outside.

Run with the project's interpreter::

    .venv/bin/python bench/system_bench.py [--only METRIC] [--reps N]

Metrics (targets in ``bench/run.py``):

* ``system_1k_procs_cpu`` (% of one core): ``palatine system`` serves ``unix:@...`` in a
  child process. This process attaches a client proc (``System(addr).attach()``), joins
  1,000 simulated procs ``bench[0..1000)`` through it (``Join``, ManagedBySystem, one
  incarnation each, the client's own served address), then sends each a
  ``SupervisionUpdate`` once a second over the client's normal channel, spread evenly
  (20 every 20 ms), each with the resources a real proc's heartbeat carries (CPU and
  RSS). After a warm-up, each repetition is one steady-state window of
  ``WINDOW_S`` seconds: the system process's CPU time (user + system, psutil) over the
  window divided by the window's wall time. The system runs with an update timeout of
  ``SIM_TIMEOUT_S``, so procs whose heartbeats did not arrive would show up ``Expired``:
  the program checks that all 1,000 are still ``Alive`` at the end.
* ``snapshot_1k_procs_ms``: the same 1,000 procs (labelled), heartbeats still running;
  one ``Snapshot`` whose filter is a proc label every proc carries (so all 1,000 are
  listed), timed from the client as a request/reply round trip. The value is the median
  over ``max(20, 4 x reps)`` requests (each request is one entry of ``reps``).
* ``detect_sigkill_system_s``: ``palatine system`` + ``palatine host`` (CLI) and a world
  of 4 procs exec'd by the host (``<python> -m palatine worker``, upserted through the
  client). One worker is SIGKILLed; the time until a snapshot (polled every ~5 ms) shows
  it ``Exited`` with signal 9. Between repetitions the world is evicted (short eviction
  timeout) and upserted again, so the host restarts its workers. ``detect_sigkill_s``
  (bench/actor_calls.py) is the same fault seen from an actor caller.

Every role process gets a fresh cluster token, logs at WARNING to a temp file, and is
killed (its whole process group) at the end.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_args, run_metric, wanted  # noqa: E402

os.environ["PALATINE_CLUSTER_TOKEN"] = secrets.token_hex(16)
os.environ.setdefault("PALATINE_LOG_LEVEL", "WARNING")

import psutil  # noqa: E402

from palatine.channel.addr import parse  # noqa: E402
from palatine.core import runtime  # noqa: E402
from palatine.ids import SYSTEM_ACTOR, WorldId  # noqa: E402
from palatine.protocol.supervision import ProcSupervisionState  # noqa: E402
from palatine.protocol.system import Join, SupervisionUpdate  # noqa: E402
from palatine.system.service import System, SystemClient  # noqa: E402
from palatine.tensor.client.procs import RoleProcess  # noqa: E402

IMPL = "palatine"
VERSION = metadata.version("palatine")

SIM_WORLD = "bench"
SIM_PROCS = 1000
SIM_TIMEOUT_S = 5.0  # the system's supervision_update_timeout in the 1k-procs run
HEARTBEAT_PERIOD_S = 1.0  # each simulated proc beats at 1 Hz
SLICE_S = 0.02  # heartbeats go out in slices: SIM_PROCS * SLICE_S per slice
WARMUP_S = 2.0  # heartbeating before the first CPU window
WINDOW_S = 2.0  # one repetition of system_1k_procs_cpu
# Heartbeats carry the proc's resources where this palatine has them (this file also
# measures an older palatine, for a before and after: PYTHONPATH=<its src>).
RESOURCES = "resources" in ProcSupervisionState.__struct_fields__
JOIN_BATCH = 100  # joins in flight at once
SIM_LABEL = ("bench.palatine.dev/sim", "1")
MIN_SNAPSHOTS = 20

DETECT_WORLD = "w"
DETECT_PROCS = 4
DETECT_VICTIM = 1
DETECT_CAP_S = 30.0
DETECT_POLL_S = 0.005
DETECT_EVICTION_S = 1.0
READY_TIMEOUT_S = 30.0
LIVE_TIMEOUT_S = 60.0

T = TypeVar("T")


def log(msg: str) -> None:
    print(f"[system_bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ role processes


class Role(RoleProcess):
    """``palatine <role> ...`` in its own process group; stderr to a temp file."""

    def __init__(self, args: list[str]) -> None:
        fd, self.errpath = tempfile.mkstemp(prefix="palatine-bench-", suffix=".log")
        os.close(fd)
        super().__init__(args, None, READY_TIMEOUT_S, log_path=self.errpath)

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            with open(self.errpath, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        super().kill()
        try:
            os.unlink(self.errpath)
        except OSError:
            pass


def _system_addr() -> str:
    return f"unix:@palatine-bench-{secrets.token_hex(6)}"


def _run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    """Run one async part on a fresh palatine loop in this thread."""
    loop = runtime.new_event_loop()
    asyncio.set_event_loop(loop)

    async def body() -> T:
        runtime.adopt_current_loop()
        try:
            return await coro_fn()
        finally:
            runtime.release_current_loop()

    try:
        return loop.run_until_complete(body())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio.set_event_loop(None)


async def _close_client(client: SystemClient | None) -> None:
    if client is None:
        return
    try:
        await asyncio.wait_for(client.close(), 5)
    except Exception as exc:  # noqa: BLE001 - the system may be gone already
        log(f"client close: {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------ 1,000 procs


class Heartbeats:
    """Send every simulated proc one ``SupervisionUpdate`` per period, evenly spread."""

    def __init__(self, client: SystemClient, beats: list[SupervisionUpdate]) -> None:
        self.client = client
        self.beats = beats
        self.sent = 0
        self.late_slices = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        n = len(self.beats)
        slices = max(1, round(HEARTBEAT_PERIOD_S / SLICE_S))
        per = -(-n // slices)
        tell = self.client.mailbox.tell
        t0 = loop.time()
        k = 0
        while True:
            lo = (k % slices) * per
            for msg in self.beats[lo : lo + per]:
                tell(SYSTEM_ACTOR, msg)
            self.sent += len(self.beats[lo : lo + per])
            k += 1
            delay = t0 + k * SLICE_S - loop.time()
            if delay < 0:
                self.late_slices += 1
            await asyncio.sleep(max(0.0, delay))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


async def _join_sim_procs(client: SystemClient) -> list[SupervisionUpdate]:
    """Join ``bench[0..SIM_PROCS)`` through the client; return each proc's heartbeat."""
    assert client.proc.addr is not None
    addr = str(client.proc.addr)
    world = WorldId(SIM_WORLD)
    host = socket.gethostname()
    pid = os.getpid()
    joins: list[Join] = []
    beats: list[SupervisionUpdate] = []
    for r in range(SIM_PROCS):
        proc_id = world.proc(r)
        incarnation = secrets.randbits(63) | 1
        labels = {
            SIM_LABEL[0]: SIM_LABEL[1],
            "bench.palatine.dev/parity": "even" if r % 2 == 0 else "odd",
        }
        joins.append(
            Join(
                proc_id=proc_id,
                addr=addr,
                labels=labels,
                mode="ManagedBySystem",
                pid=pid,
                host=host,
                incarnation=incarnation,
            )
        )
        state = ProcSupervisionState(
            proc_id=proc_id, addr=addr, health="Alive", incarnation=incarnation
        )
        if RESOURCES:  # what a real proc's heartbeat carries (palatine.hosting.resources)
            state.resources = {"cpu_percent": 12.5 + r % 7, "rss_bytes": 5.1e8 + r * 4096.0}
        beats.append(SupervisionUpdate(state=state))
    for i in range(0, len(joins), JOIN_BATCH):
        await asyncio.gather(*(client.ask(j, 30.0) for j in joins[i : i + JOIN_BATCH]))
    return beats


def _check_all_alive(snap: Any) -> float:
    """All simulated procs listed and Alive; return the oldest heartbeat age (s)."""
    world = snap.worlds.get(SIM_WORLD)
    if world is None:
        raise AssertionError(f"world {SIM_WORLD} missing from the snapshot")
    health: dict[str, int] = {}
    oldest = 0.0
    for entry in world.procs.values():
        health[entry.health] = health.get(entry.health, 0) + 1
        oldest = max(oldest, entry.last_heartbeat_age_s or 0.0)
    if len(world.procs) != SIM_PROCS or health.get("Alive", 0) != SIM_PROCS:
        raise AssertionError(f"expected {SIM_PROCS} Alive procs listed, got {health}")
    if oldest > 2 * HEARTBEAT_PERIOD_S:
        raise AssertionError(f"a heartbeat is {oldest:.2f} s old: heartbeats are not arriving")
    return oldest


def bench_1k_procs(args: Any) -> None:
    want_cpu = wanted(args, "system_1k_procs_cpu")
    want_snap = wanted(args, "snapshot_1k_procs_ms")
    if not (want_cpu or want_snap):
        return
    results: dict[str, tuple[list[float], dict[str, Any]] | BaseException] = {}
    try:
        system = Role(
            [
                "system",
                "--system-addr",
                _system_addr(),
                "--supervision-update-timeout-in-sec",
                str(SIM_TIMEOUT_S),
            ]
        )
    except Exception as exc:  # noqa: BLE001 - reported per metric below
        results["system_1k_procs_cpu"] = results["snapshot_1k_procs_ms"] = exc
        system = None
    if system is not None:
        try:
            _run(lambda: _measure_1k(system, args, want_cpu, want_snap, results))
        finally:
            tail = system.stderr_tail(1500).strip()
            system.kill()
            if tail:
                log(f"system stderr (tail):\n{tail}")

    def reported(metric: str) -> Callable[[], tuple[list[float], dict[str, Any]]]:
        def get() -> tuple[list[float], dict[str, Any]]:
            r = results.get(metric)
            if r is None:
                raise RuntimeError("not measured (an earlier step failed)")
            if isinstance(r, BaseException):
                raise r
            return r

        return get

    run_metric(
        args,
        "system_1k_procs_cpu",
        IMPL,
        "% of one core",
        False,
        VERSION,
        reported("system_1k_procs_cpu"),
    )
    run_metric(
        args, "snapshot_1k_procs_ms", IMPL, "ms", False, VERSION, reported("snapshot_1k_procs_ms")
    )


async def _measure_1k(
    system: Role, args: Any, want_cpu: bool, want_snap: bool, results: dict[str, Any]
) -> None:
    sysproc = psutil.Process(system.pid)
    client: SystemClient | None = None
    hb: Heartbeats | None = None
    try:
        client = await System(parse(system.addr)).attach(timeout_s=20)
        t0 = time.perf_counter()
        beats = await _join_sim_procs(client)
        join_s = time.perf_counter() - t0
        log(f"joined {SIM_PROCS} procs in {join_s:.2f} s")
        hb = Heartbeats(client, beats)
        hb.start()
        await asyncio.sleep(WARMUP_S)

        me = psutil.Process()
        if want_cpu:
            try:
                reps: list[float] = []
                client_cpu: list[float] = []
                sent0 = hb.sent
                w0 = time.perf_counter()
                for _ in range(args.reps):
                    c0 = sum(sysproc.cpu_times()[:2])
                    m0 = sum(me.cpu_times()[:2])
                    t0 = time.perf_counter()
                    await asyncio.sleep(WINDOW_S)
                    t1 = time.perf_counter()
                    c1 = sum(sysproc.cpu_times()[:2])
                    m1 = sum(me.cpu_times()[:2])
                    reps.append(100.0 * (c1 - c0) / (t1 - t0))
                    client_cpu.append(round(100.0 * (m1 - m0) / (t1 - t0), 2))
                rate = (hb.sent - sent0) / (time.perf_counter() - w0)
                snap = await client.snapshot(worlds=[SIM_WORLD])
                oldest = _check_all_alive(snap)
                results["system_1k_procs_cpu"] = (
                    reps,
                    {
                        "procs": SIM_PROCS,
                        "heartbeats_per_s": round(rate, 1),
                        "window_s": WINDOW_S,
                        "late_slices": hb.late_slices,
                        "sender_cpu_pct": client_cpu,
                        "join_1k_s": round(join_s, 3),
                        "oldest_heartbeat_age_s": round(oldest, 3),
                        "resources_in_heartbeats": RESOURCES,
                    },
                )
            except Exception as exc:  # noqa: BLE001 - one metric must not end the other
                results["system_1k_procs_cpu"] = exc

        if want_snap:
            try:
                label = {SIM_LABEL[0]: SIM_LABEL[1]}
                snap = await client.snapshot(proc_labels=label)  # warm-up
                _check_all_alive(snap)
                times: list[float] = []
                for _ in range(max(MIN_SNAPSHOTS, 4 * args.reps)):
                    t0 = time.perf_counter()
                    snap = await client.snapshot(proc_labels=label)
                    times.append((time.perf_counter() - t0) * 1e3)
                    listed = len(snap.worlds[SIM_WORLD].procs)
                    if listed != SIM_PROCS:
                        raise AssertionError(f"snapshot listed {listed} procs, not {SIM_PROCS}")
                    await asyncio.sleep(0.02)
                results["snapshot_1k_procs_ms"] = (
                    times,
                    {
                        "procs": SIM_PROCS,
                        "requests": len(times),
                        "filter": f"proc_labels {SIM_LABEL[0]}={SIM_LABEL[1]}",
                    },
                )
            except Exception as exc:  # noqa: BLE001
                results["snapshot_1k_procs_ms"] = exc
    except Exception as exc:  # noqa: BLE001 - attach or joins failed: both metrics fail
        for m in ("system_1k_procs_cpu", "snapshot_1k_procs_ms"):
            results.setdefault(m, exc)
    finally:
        if hb is not None:
            await hb.stop()
        await _close_client(client)


# ------------------------------------------------------------------------------ SIGKILL detection


async def _wait_snapshot(
    client: SystemClient,
    pred: Callable[[Any], bool],
    timeout_s: float,
    what: str,
    poll_s: float = 0.05,
) -> Any:
    deadline = time.monotonic() + timeout_s
    snap = None
    while time.monotonic() < deadline:
        snap = await client.snapshot(worlds=[DETECT_WORLD])
        if pred(snap):
            return snap
        await asyncio.sleep(poll_s)
    shown = "" if snap is None else _snap_text(snap)[:2000]
    raise TimeoutError(
        f"timed out after {timeout_s:g} s waiting for {what}; last snapshot: {shown}"
    )


def _snap_text(snap: Any) -> str:
    import msgspec

    return msgspec.json.encode(snap).decode()


def _world(snap: Any) -> Any:
    return snap.worlds.get(DETECT_WORLD)


def _is_live(snap: Any) -> bool:
    w = _world(snap)
    return (
        w is not None
        and w.status == "Live"
        and len(w.procs) == DETECT_PROCS
        and all(e.health == "Alive" for e in w.procs.values())
    )


def _is_evicted(snap: Any) -> bool:
    w = _world(snap)
    return w is None or (w.status == "AwaitingCreation" and not w.procs)


def bench_detect(args: Any) -> None:
    if not wanted(args, "detect_sigkill_system_s"):
        return

    def measure() -> tuple[list[float], dict[str, Any]]:
        system = host = None
        try:
            system = Role(
                [
                    "system",
                    "--system-addr",
                    _system_addr(),
                    "--world-eviction-timeout-in-sec",
                    str(DETECT_EVICTION_S),
                ]
            )
            host = Role(
                [
                    "host",
                    "--system-addr",
                    system.addr,
                    "--host-world",
                    f"host{DETECT_WORLD}",
                    "--host-rank",
                    "0",
                ]
            )
            return _run(lambda: _measure_detect(system, host, args))
        except Exception:
            for r in (host, system):
                if r is not None:
                    log(f"palatine {r.args[0]} stderr (tail):\n{r.stderr_tail(2000)}")
            raise
        finally:
            for r in (host, system):
                if r is not None:
                    r.kill()

    run_metric(args, "detect_sigkill_system_s", IMPL, "s", False, VERSION, measure)


async def _measure_detect(
    system: Role, host: Role, args: Any
) -> tuple[list[float], dict[str, Any]]:
    client = await System(parse(system.addr)).attach(timeout_s=20)
    program = f"{sys.executable} -m palatine worker"
    reps: list[float] = []
    polls: list[int] = []
    capped = 0
    victim = f"{DETECT_WORLD}[{DETECT_VICTIM}]"
    try:
        for _ in range(args.reps):
            await client.upsert_world(DETECT_WORLD, [DETECT_PROCS], DETECT_PROCS, program)
            snap = await _wait_snapshot(client, _is_live, LIVE_TIMEOUT_S, "the world to be Live")
            pid = _world(snap).procs[victim].pid
            if not pid or not psutil.pid_exists(pid):
                raise AssertionError(f"{victim} has no live pid in the snapshot: {pid}")
            await asyncio.sleep(0.2)  # settled: heartbeats flowing
            n = 0
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while True:
                snap = await client.snapshot(worlds=[DETECT_WORLD])
                n += 1
                elapsed = time.perf_counter() - t0
                e = _world(snap).procs.get(victim) if _world(snap) else None
                if e is not None and e.health == "Exited":
                    if e.exit_signal != 9:
                        raise AssertionError(f"{victim} Exited without signal 9: {e}")
                    reps.append(elapsed)
                    break
                if elapsed > DETECT_CAP_S:
                    capped += 1
                    reps.append(DETECT_CAP_S)
                    break
                await asyncio.sleep(DETECT_POLL_S)
            polls.append(n)
            # The world is evicted after the eviction timeout; the host kills the rest and
            # keeps running, so the next upsert makes it start 4 fresh workers.
            await _wait_snapshot(client, _is_evicted, DETECT_EVICTION_S + 20, "eviction")
    finally:
        await _close_client(client)
    return reps, {
        "procs": DETECT_PROCS,
        "poll_s": DETECT_POLL_S,
        "polls": polls,
        "cap_s": DETECT_CAP_S,
        "capped_reps": capped,
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    bench_1k_procs(args)
    bench_detect(args)


if __name__ == "__main__":
    main()
