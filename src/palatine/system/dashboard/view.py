"""What the dashboard page shows, made from the system's snapshots (sans-IO).

`JobView` takes each `SystemSnapshot` the dashboard reads (`observe`) and keeps what one
snapshot cannot say: the failures seen so far, in words, and each world's
scalar user metrics over time (`palatine.hosting.user_metrics`: a worker's
``gauge("loss").set(...)`` shows here as ``loss``, the mean over the world's procs that
publish it). `state` is the JSON document the page polls.

Failures come from the system's stimulus log (`observe_stimuli`): every warning or error
it logged (``worker[2] (pid 12 on node3) was killed by signal 9``), those from before the
dashboard started included, and a proc that died and was respawned between two snapshots
too. Until the system has answered for its log, and for failed actors, which it does not
log, a snapshot's procs that are no longer alive are described instead
(`describe_failure`).
"""

from __future__ import annotations

import collections
import signal
import time
from typing import Any

from palatine.hosting.user_metrics import parse
from palatine.protocol.system import ProcEntry, StimulusLog, SystemSnapshot

__all__ = ["JobView", "describe_failure", "rank_of"]

_FAILURES_KEPT = 50
_POINTS_KEPT = 600  # per metric: ten minutes at the default half-second poll
_FAILURE_LEVELS = ("Log WARNING: ", "Log ERROR: ", "Log CRITICAL: ")


def rank_of(proc: str) -> int:
    """``worker[3]`` -> 3 (0 for a name without a rank)."""
    return int(proc.rsplit("[", 1)[1].rstrip("]")) if "[" in proc else 0


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def describe_failure(proc: str, e: ProcEntry) -> str:
    """One sentence on why ``proc`` is not alive (or which of its actors failed)."""
    where = f"{proc} (pid {e.pid or '?'} on {e.host or '?'})"
    if e.health == "Alive":
        what = ", ".join(f"{a.actor_id} {a.status}" for a in e.failed_actors)
        return f"{where}: actors failed: {what}"
    if e.reason:
        return f"{where}: {e.reason}"
    if e.exit_signal is not None:
        how = f"was killed by {_signal_name(e.exit_signal)}"
    elif e.exit_code is not None:
        how = f"exited with status {e.exit_code}"
    elif e.health == "Expired":
        how = "stopped sending heartbeats"
    elif e.health == "ConnectionFailure":
        how = "lost its connection"
    else:
        how = "exited"
    return f"{where} {how}"


class JobView:
    """The page's state of one job, fed by successive snapshots."""

    def __init__(self, job: dict[str, str] | None = None) -> None:
        self.job = dict(job or {})
        self.snapshot: SystemSnapshot | None = None
        self.failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=_FAILURES_KEPT)
        self.metrics: dict[str, collections.deque[tuple[float, float]]] = {}
        self._reported: set[str] = set()  # "proc", "proc/actor" or "stimulus/i" noted
        self._stimuli_seen = False

    def observe(self, snap: SystemSnapshot, now: float | None = None) -> None:
        """Take a new snapshot: note new failures and one point of every metric."""
        now = time.time() if now is None else now
        self.snapshot = snap
        for world_name, world in snap.worlds.items():
            sums: dict[str, list[float]] = {}
            for proc, e in world.procs.items():
                self._note_failures(proc, e, now)
                for m in parse(e.counters):
                    if m.kind != "histogram" and e.health == "Alive":
                        sums.setdefault(m.name, []).append(m.value)
            for name, values in sums.items():
                key = f"{world_name}: {name}"
                points = self.metrics.setdefault(key, collections.deque(maxlen=_POINTS_KEPT))
                points.append((now, sum(values) / len(values)))

    def observe_stimuli(self, log: StimulusLog) -> None:
        """Note the warnings and errors of the system's stimulus log not noted yet."""
        self._stimuli_seen = True
        for e in log.entries:
            for i, line in enumerate(e.instructions):
                key = f"{e.stimulus_id}/{i}"
                if key in self._reported or not line.startswith(_FAILURE_LEVELS):
                    continue
                self._reported.add(key)
                text = line.partition(": ")[2]
                self._add_failure({"time": e.time, "proc": e.subject, "text": text})

    def _note_failures(self, proc: str, e: ProcEntry, now: float) -> None:
        keys = [] if e.health == "Alive" or self._stimuli_seen else [proc]
        keys += [f"{proc}/{a.actor_id}" for a in e.failed_actors]
        new = [k for k in keys if k not in self._reported]
        if not new:
            return
        self._reported.update(new)
        self._add_failure({"time": now, "proc": proc, "text": describe_failure(proc, e)})

    def _add_failure(self, failure: dict[str, Any]) -> None:
        """Into the newest-first list, in time order (the log's may be older)."""
        kept = sorted([*self.failures, failure], key=lambda f: -f["time"])
        self.failures.clear()
        self.failures.extend(kept[:_FAILURES_KEPT])

    def state(self) -> dict[str, Any]:
        """The JSON document of ``/api/state``."""
        worlds = []
        snap = self.snapshot
        for name, world in (snap.worlds if snap else {}).items():
            procs = [_proc_row(p, e) for p, e in world.procs.items()]
            procs.sort(key=lambda r: r["rank"])
            worlds.append(
                {
                    "name": name,
                    "status": world.status,
                    "alive": sum(1 for r in procs if r["health"] == "Alive"),
                    "procs": procs,
                }
            )
        return {
            "job": {**self.job, "execution_id": snap.execution_id if snap else ""},
            "time": time.time(),
            "worlds": worlds,
            "failures": list(self.failures),
            "metrics": {k: list(v) for k, v in self.metrics.items()},
        }


def _proc_row(proc: str, e: ProcEntry) -> dict[str, Any]:
    use = e.resources if e.health == "Alive" else {}
    return {
        "proc": proc,
        "rank": rank_of(proc),
        "health": e.health,
        "host": e.host,
        "pid": e.pid,
        "heartbeat_age_s": e.last_heartbeat_age_s,
        "loop_lag_s": e.loop_lag_s,
        "activity": e.activity,
        "cpu_percent": use.get("cpu_percent"),
        "rss_bytes": use.get("rss_bytes"),
        "gpu_util_percent": use.get("gpu_util_percent"),
        "gpu_mem_bytes": use.get("gpu_mem_bytes"),
        "failed_actors": [a.actor_id for a in e.failed_actors],
        "reason": "" if e.health == "Alive" else describe_failure(proc, e),
    }
