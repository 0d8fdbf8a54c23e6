"""The fault matrix: what a client sees, and when, for each fault a cluster user meets.

Needs root (a namespace test bed, `palatine.testing.netns`, and for ``scancel`` a Slurm
test cluster, `palatine.testing.slurm`). Run with the project's interpreter::

    .venv/bin/python bench/fault_matrix.py                        # the whole matrix
    .venv/bin/python bench/fault_matrix.py --phase reduce,collective --transport tcp
    .venv/bin/python bench/fault_matrix.py --false-positives      # the timeout under load

**The matrix.** For each transport (``tcp``, mutual ``tls``), fault and phase, a fresh
2-node mesh (2 worker procs per node, ranks 2 and 3 on node 1) with a 3 s heartbeat
timeout (the system's ``supervision_update_timeout_s``) and a 0.5 s heartbeat interval,
as the multi-node tests use. The system, the controller and the client run in the root
namespace, one ``palatine host`` in each node's namespace (`roles_on_bed`); the
``scancel`` cells run a `SlurmJob` on the Slurm test cluster instead, with the same
timeouts. Faults, all on node 1:

* ``cut``: node 1's link goes down (healed once the cell is measured; the cell also says
  how long after the heal node 1's old processes were gone);
* ``worker``: SIGKILL of rank 2's worker; ``host``: SIGKILL of node 1's ``palatine host``;
* ``node``: SIGKILL of every process in node 1's namespace (host, fork server, workers);
* ``scancel``: the Slurm job is cancelled (both nodes).

Phases, when the fault lands:

* ``idle``: nothing runs; right after the fault the client makes its next call and
  fetches its value from rank 2;
* ``call``: every rank is in a remote function sleeping 60 s; the client waits on rank
  0's value (node 0, which the fault spares);
* ``reduce``: ranks 0, 1 and 3 wait inside palatine's own reduce (``value.reduce``) for
  rank 2, which is still computing its input; the client waits on rank 0's result;
* ``collective``: the same with a user's collective, a remote function calling
  ``torch.distributed.all_reduce`` on ``mesh.process_group()``.

Each cell is the time from the fault to the client's exception and its type, or ``no
error within N s`` (``--bound``, default 20 s). The results are merged, cell by cell,
into ``bench/results/fault_matrix.json`` (each with its date and tree), and the tables
in ``docs/faults.md`` (between its ``fault-matrix`` markers) are written again from it,
so a run of a subset updates only its cells.

**False positives** (``--false-positives``). For each heartbeat timeout of
``--fp-timeouts`` (3, 5, 10 s; the interval a sixth of it), a 2-node mesh runs
``--fp-seconds`` (60 s) with every worker spinning in Python and one busy process per
core beside it; the system's snapshot is read every 0.5 s. It counts the procs that left
``Alive`` (a spurious declaration: nothing was wrong) and the longest heartbeat silence
the system saw.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

import cloudpickle

from palatine import DeviceException, RemoteException, config, fetch, inspect, remote
from palatine.core import runtime
from palatine.tensor.client.local import connect
from palatine.tensor.client.mesh import DeviceMesh
from palatine.testing.bedroles import BedRoles, roles_on_bed
from palatine.testing.netns import TestBed, unavailable

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results" / "fault_matrix.json"
DOC = ROOT / "docs" / "faults.md"

TRANSPORTS = ("tcp", "tls")
FAULTS = ("cut", "worker", "host", "node", "scancel")
PHASES = ("idle", "call", "reduce", "collective")
UPDATE_TIMEOUT_S = 3.0  # the system's supervision update timeout in the matrix
INTERVAL_S = 0.5  # the heartbeat interval and the controller's query interval
VICTIM = 2  # rank 2: node 1's first proc
HEAL_WAIT_S = 15.0  # how long a healed node's old processes may take to be gone
DRAIN_S = 5.0  # how long a cell's processes may take to end before they are killed
FAULT_TEXT = {
    "cut": "link cut (then healed)",
    "worker": "SIGKILL of a worker",
    "host": "SIGKILL of a host",
    "node": "SIGKILL of a node",
    "scancel": "`scancel` of the Slurm job",
}
PHASE_TEXT = {
    "idle": "idle (next call)",
    "call": "during a call",
    "reduce": "in palatine's reduce",
    "collective": "in a user's collective",
}


# ------------------------------------------------------------------ on the workers


def rank_of(rank: Any) -> int:
    return int(rank)


def sleep_then(rank: Any) -> int:
    time.sleep(60)
    return int(rank)


def ones(rank: Any, hold: bool) -> Any:
    """A small tensor; rank `VICTIM` holds its input back for 60 s when ``hold``, so that
    the other ranks wait for it inside the collective that follows."""
    import torch

    if hold and int(rank) == VICTIM:
        time.sleep(60)
    return torch.ones(4) * float(rank)


def user_all_reduce(pg: Any, rank: Any, hold: bool) -> float:
    """A user's own collective on the mesh's process group (see `ones` for ``hold``)."""
    import torch.distributed as dist

    t = ones(rank, hold)
    dist.all_reduce(t, group=pg)
    return float(t.sum())


def spin(seconds: float) -> int:
    """Python busy for ``seconds`` (holds the GIL but for its switch interval)."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


# ------------------------------------------------------------------ faults and processes


def _ns_inode(bed: TestBed, node: int) -> int:
    return os.stat(f"/run/netns/{bed.namespaces[node]}").st_ino


def pids_in(bed: TestBed, node: int, palatine_only: bool = False) -> list[int]:
    """The processes in node ``node``'s network namespace (those running palatine: not
    Slurm's daemons, whose command lines may name a palatine directory)."""
    inode, out = _ns_inode(bed, node), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (entry / "ns" / "net").stat().st_ino != inode:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if palatine_only and (
                Path(argv[0].decode(errors="replace")).name.startswith("slurm")
                or not any(b"palatine" in a for a in argv)
            ):
                continue
            out.append(int(entry.name))
    return out


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def gone_within(bed: TestBed, node: int, seconds: float) -> float | None:
    """Seconds until node ``node`` runs no palatine process, or None if it still does."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not pids_in(bed, node, palatine_only=True):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def drain(bed: TestBed) -> None:
    """Between cells: what a cell started on the nodes ends (bounded), or is killed."""
    for node in range(bed.nodes):
        if gone_within(bed, node, DRAIN_S) is None:
            kill_all(pids_in(bed, node, palatine_only=True))


# ------------------------------------------------------------------ one cell


@dataclass
class Outcome:
    seconds: float | None  # fault to the client's exception; None: none within the bound
    kind: str  # DeviceException | RemoteException | other | none | returned | failed
    exc_type: str
    detail: str  # the exception's first line, or what went wrong
    after_heal: str = ""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def classify(e: BaseException) -> tuple[str, str]:
    name = type(e).__name__
    if isinstance(e, DeviceException):
        return "DeviceException", f"{name} ({e.kind})" if getattr(e, "kind", None) else name
    if isinstance(e, RemoteException):
        return "RemoteException", name
    return "other", name


def start_phase(mesh: DeviceMesh, phase: str) -> Callable[[float], Any]:
    """Warm the mesh for ``phase`` and set its work going; what the client then waits on,
    for at most the seconds it is given (raising `TimeoutError` after them)."""
    rank = mesh.rank(("host", "proc"))
    inspect(remote(rank_of)(rank), shard=VICTIM)  # every rank up and answering
    if phase == "idle":
        return lambda bound_s: next_calls(rank, bound_s)
    if phase == "call":
        pending = fetch(remote(sleep_then)(rank), shard=0)
        time.sleep(0.3)  # the ranks are in the call
        return pending.result
    if phase == "reduce":
        warm = remote(ones)(rank, False).reduce(("host", "proc"), op="sum")
        fetch(warm, shard=0).result(timeout=60)  # the collectives are set up
        total = remote(ones)(rank, True).reduce(("host", "proc"), op="sum")
    else:
        pg = mesh.process_group()
        fetch(remote(user_all_reduce)(pg, rank, False), shard=0).result(timeout=60)
        total = remote(user_all_reduce)(pg, rank, True)
    pending = fetch(total, shard=0)
    time.sleep(1.0)  # ranks 0, 1 and 3 are inside the collective, rank 2 holds back
    return pending.result


def next_calls(rank: Any, bound_s: float) -> None:
    """The client's next calls after the fault, one after another, each fetched from the
    lost rank (a call may still return while the fault takes effect: an ``scancel``'s
    kills come some milliseconds after it returns); raises the first error, or
    `TimeoutError` once ``bound_s`` is spent."""
    end = time.monotonic() + bound_s
    while (left := end - time.monotonic()) > 0:
        fetch(remote(rank_of)(rank), shard=VICTIM).result(timeout=left)
        time.sleep(0.02)
    raise TimeoutError(f"no error within {bound_s:g} s")


def measure(wait: Callable[[float], Any], inject: Callable[[], None], bound_s: float) -> Outcome:
    """Inject the fault, then wait (bounded) for the client's error."""
    t0 = time.monotonic()
    inject()
    try:
        value = wait(bound_s)
    except TimeoutError:
        return Outcome(None, "none", "", f"no error within {bound_s:g} s")
    except Exception as e:  # noqa: BLE001 - every exception the client sees is the measurement
        took = time.monotonic() - t0
        kind, name = classify(e)
        return Outcome(took, kind, name, first_line(e))
    return Outcome(time.monotonic() - t0, "returned", "", f"the call returned {value!r}")


def bed_cell(
    bed: TestBed, pki: dict[str, dict[str, str]] | None, fault: str, phase: str, bound_s: float
) -> Outcome:
    with roles_on_bed(
        bed, per_host=2, tls=pki, update_timeout_s=UPDATE_TIMEOUT_S, interval_s=INTERVAL_S
    ) as roles:
        with connect(roles.system_addr, "worker", timeout_s=90, _token=roles.token) as mesh:
            victim = inspect(remote(os.getpid)(), shard=VICTIM)
            wait = start_phase(mesh, phase)
            inject = injector(bed, roles, fault, victim)
            try:
                out = measure(wait, inject, bound_s)
            finally:
                if fault == "cut":
                    bed.heal(1)
            if fault == "cut":
                gone = gone_within(bed, 1, HEAL_WAIT_S)
                out.after_heal = (
                    f"node 1's old processes gone {gone:.1f} s after the heal"
                    if gone is not None
                    else f"node 1's old processes still running {HEAL_WAIT_S:g} s after the heal"
                )
    drain(bed)
    return out


def injector(bed: TestBed, roles: BedRoles, fault: str, victim: int) -> Callable[[], None]:
    if fault == "cut":
        return lambda: bed.cut(1)
    if fault == "worker":
        return lambda: kill_all([victim])
    if fault == "host":
        host = roles.hosts[1].pid
        assert b"palatine" in Path(f"/proc/{host}/cmdline").read_bytes(), host
        return lambda: kill_all([host])
    if fault == "node":
        return lambda: kill_all(pids_in(bed, 1))
    raise ValueError(fault)


def slurm_cell(cluster: Any, transport: str, phase: str, bound_s: float) -> Outcome:
    from palatine.job.slurm import SlurmJob
    from palatine.testing.slurm import PARTITION

    with SlurmJob(
        hosts=2,
        procs_per_host=2,
        partition=PARTITION,
        startup_timeout_s=120,
        transport=transport,
        supervision_update_timeout_s=UPDATE_TIMEOUT_S,
        supervision_update_interval_s=INTERVAL_S,
        supervision_query_interval_s=INTERVAL_S,
    ) as job:
        mesh = job.mesh()
        with mesh.activate():
            wait = start_phase(mesh, phase)
            job_id = job.job_id
            assert job_id is not None

            def inject() -> None:
                subprocess.run(["scancel", job_id], check=True, timeout=30, env=cluster.env)

            out = measure(wait, inject, bound_s)
    drain(cluster.bed)
    slurm_idle(cluster)
    return out


def slurm_idle(cluster: Any, timeout_s: float = 90.0) -> None:
    """Wait (bounded) until Slurm has no job left and every node is idle again (a
    cancelled job's nodes are ``completing`` for a while): the next job starts at once."""
    deadline = time.monotonic() + timeout_s
    states = ""
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=cluster.env,
                              capture_output=True, text=True, timeout=10, check=False)  # fmt: skip
        states = " ".join(done.stdout.split())
        if not cluster.squeue() and states == " ".join(["idle"] * cluster.bed.nodes):
            return
        time.sleep(0.5)
    raise RuntimeError(f"Slurm's nodes not idle within {timeout_s:g} s: {states}")


@contextlib.contextmanager
def slurm_cluster(bed: TestBed, pki: dict[str, dict[str, str]] | None) -> Iterator[Any]:
    from palatine.testing.slurm import SlurmTestCluster

    node_env = {i: pki[bed.node_ip(i)] for i in range(bed.nodes)} if pki else {}
    cluster = SlurmTestCluster(bed, node_env=node_env)
    cluster.start()
    try:
        env = {"SLURM_CONF": str(cluster.conf), "PALATINE_HOST_IP": bed.root_ip}
        clear = ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        with patch.dict(os.environ, env), config.override(host_ip=bed.root_ip):
            for var in clear:
                os.environ.pop(var, None)
            yield cluster
    finally:
        cluster.close()


@contextlib.contextmanager
def transport_env(
    bed: TestBed, transport: str, tmp: str
) -> Iterator[dict[str, dict[str, str]] | None]:
    """``tls``: one certificate per machine of the bed, this machine's in the environment."""
    if transport == "tcp":
        yield None
        return
    from palatine.testing.certs import make_node_pki

    pki = make_node_pki(
        Path(tmp) / "pki", [bed.root_ip, *(bed.node_ip(i) for i in range(bed.nodes))]
    )
    with patch.dict(os.environ, pki[bed.root_ip]):
        yield pki


# ------------------------------------------------------------------ false positives


def false_positives(bed: TestBed, timeout_s: float, seconds: float) -> dict[str, Any]:
    """One mesh under load for ``seconds`` with heartbeat timeout ``timeout_s``."""
    interval = round(timeout_s / 6, 1)
    env = {
        "PALATINE_SUPERVISION_UPDATE_TIMEOUT": f"{timeout_s:g}",
        "PALATINE_SUPERVISION_UPDATE_INTERVAL": f"{interval:g}",
    }
    declared: dict[str, str] = {}
    max_age: dict[str, float] = {}  # the longest silence seen, by kind of proc
    samples = 0
    busy: list[subprocess.Popen[bytes]] = []
    with (
        patch.dict(os.environ, env),
        config.override(
            supervision_update_timeout_s=timeout_s, supervision_update_interval_s=interval
        ),
        roles_on_bed(bed, per_host=2, update_timeout_s=timeout_s, interval_s=interval) as roles,
        connect(roles.system_addr, "worker", timeout_s=90, _token=roles.token) as mesh,
    ):
        inspect(remote(rank_of)(mesh.rank(("host", "proc"))), shard=VICTIM)
        spinning = fetch(remote(spin)(seconds), shard=0)
        client = mesh.session.system_client
        try:
            for _ in range(os.cpu_count() or 1):
                busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                snap = runtime.submit(lambda: client.snapshot()).get(30)
                samples += 1
                for world in snap.worlds.values():
                    for name, entry in world.procs.items():
                        if entry.health != "Alive":
                            declared.setdefault(name, entry.reason or entry.health)
                        else:
                            role = name.split("[")[0]
                            age = entry.last_heartbeat_age_s or 0.0
                            max_age[role] = round(max(max_age.get(role, 0.0), age), 2)
                time.sleep(0.5)
        finally:
            for p in busy:
                p.kill()
                p.wait(10)
        try:
            spinning.result(timeout=30)
            client_saw = ""
        except Exception as e:  # noqa: BLE001 - what the client saw is the measurement
            client_saw = first_line(e)
    drain(bed)
    return {
        "timeout_s": timeout_s,
        "interval_s": interval,
        "seconds": seconds,
        "busy_procs": len(busy),
        "declared": declared,
        "max_heartbeat_age_s": max(max_age.values(), default=0.0),
        "max_heartbeat_age_by_role": max_age,
        "samples": samples,
        "client_error": client_saw,
        "date": dt.date.today().isoformat(),
        "tree": tree(),
    }


# ------------------------------------------------------------------ results and docs


def tree() -> str:
    done = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
        timeout=10, check=False,
    )  # fmt: skip
    return done.stdout.strip() or "unknown"


def load_results() -> dict[str, Any]:
    if RESULTS.exists():
        return dict(json.loads(RESULTS.read_text()))
    return {"cells": {}, "false_positives": {}}


def save_results(results: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "not measured"
    if cell["seconds"] is None or cell["kind"] in ("none", "failed"):
        return cell["detail"] if cell["kind"] == "none" else "could not measure"
    what = cell["exc_type"] or cell["kind"]
    return f"{cell['seconds']:.2f} s {what}" if cell["kind"] != "returned" else "call returned"


def measured_on(entries: list[dict[str, Any]]) -> str:
    trees = sorted({f"{e['tree']} on {e['date']}" for e in entries})
    return (
        "Measured on (`git describe`; -dirty: with uncommitted changes): "
        f"{', '.join(trees) or 'nothing yet'}."
    )


def matrix_markdown(results: dict[str, Any]) -> str:
    """The matrix's tables, one per transport, and what each cell's exception said."""
    cells = results.get("cells", {})
    lines: list[str] = []
    for transport in TRANSPORTS:
        lines += [f"#### Over {transport.upper()}", ""]
        lines.append("| fault | " + " | ".join(PHASE_TEXT[p] for p in PHASES) + " |")
        lines.append("|---" * (len(PHASES) + 1) + "|")
        for fault in FAULTS:
            row = [cell_text(cells.get(f"{transport}/{fault}/{phase}")) for phase in PHASES]
            lines.append(f"| {FAULT_TEXT[fault]} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["<details><summary>What each cell's exception said</summary>", ""]
    for transport in TRANSPORTS:
        for fault in FAULTS:
            for phase in PHASES:
                cell = cells.get(f"{transport}/{fault}/{phase}")
                if cell is not None:
                    text = cell["detail"].replace("|", "\\|")
                    heal = f" ({cell['after_heal']})" if cell.get("after_heal") else ""
                    lines.append(f"* {transport} · {fault} · {phase}: {text}{heal}")
    lines += ["", "</details>", "", measured_on(list(cells.values()))]
    return "\n".join(lines)


def false_positives_markdown(results: dict[str, Any]) -> str:
    """The table of spurious declarations under load."""
    fps = results.get("false_positives", {})
    lines = [
        "| heartbeat timeout | interval | under load | procs declared lost | "
        "longest heartbeat silence the system saw | the client saw |",
        "|---|---|---|---|---|---|",
    ]
    for key in sorted(fps, key=float):
        fp = fps[key]
        lost = ", ".join(f"{k}: {v}" for k, v in sorted(fp["declared"].items())) or "none"
        by_role = fp.get("max_heartbeat_age_by_role")
        longest = (
            ", ".join(f"{role} {age:.2f} s" for role, age in sorted(by_role.items()))
            if by_role
            else f"{fp['max_heartbeat_age_s']:.2f} s ({fp['max_heartbeat_age_proc']})"
        )
        lines.append(
            f"| {fp['timeout_s']:g} s | {fp['interval_s']:g} s | {fp['seconds']:g} s, "
            f"{fp['busy_procs']} busy procs | {lost} | {longest} | "
            f"{fp['client_error'] or 'no error'} |"
        )
    lines += ["", measured_on(list(fps.values()))]
    return "\n".join(lines)


def write_doc(results: dict[str, Any]) -> None:
    """Write both generated blocks of `DOC` again from ``results``."""
    doc = DOC.read_text()
    for name, text in (
        ("fault-matrix", matrix_markdown(results)),
        ("false-positives", false_positives_markdown(results)),
    ):
        begin, end = (
            f"<!-- {name}: begin (bench/fault_matrix.py writes this) -->",
            f"<!-- {name}: end -->",
        )
        if begin not in doc or end not in doc:
            raise SystemExit(f"{DOC} has no {begin!r} ... {end!r} block to write")
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        doc = f"{head}{begin}\n{text}\n{end}{tail}"
    DOC.write_text(doc)


# ------------------------------------------------------------------ main


def choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    picked = [t.strip() for t in text.split(",") if t.strip()]
    wrong = [t for t in picked if t not in allowed]
    if wrong:
        raise SystemExit(f"unknown {what}: {', '.join(wrong)} (choose from {', '.join(allowed)})")
    return picked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", default=",".join(TRANSPORTS), help="tcp,tls (comma separated)")
    p.add_argument("--fault", default=",".join(FAULTS), help=",".join(FAULTS))
    p.add_argument("--phase", default=",".join(PHASES), help=",".join(PHASES))
    p.add_argument("--bound", type=float, default=20.0, help="seconds a cell waits for an error")
    p.add_argument("--false-positives", action="store_true",
                   help="measure spurious declarations under load instead of the matrix")  # fmt: skip
    p.add_argument("--fp-timeouts", default="3,5,10", help="heartbeat timeouts (s) to load-test")
    p.add_argument("--fp-seconds", type=float, default=60.0, help="seconds under load for each")
    p.add_argument("--no-doc", action="store_true", help="print the tables; leave docs/ alone")
    p.add_argument("--doc-only", action="store_true",
                   help="measure nothing: write docs/faults.md's tables from the results")  # fmt: skip
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    results = load_results()
    if args.doc_only:
        write_doc(results)
        return
    why = unavailable()
    if why is not None:
        raise SystemExit(f"no namespace test bed here: {why}")
    started = time.monotonic()
    with TestBed(2) as bed, tempfile.TemporaryDirectory() as tmp:
        if args.false_positives:
            for t in [float(x) for x in args.fp_timeouts.split(",") if x.strip()]:
                fp = false_positives(bed, t, args.fp_seconds)
                results.setdefault("false_positives", {})[f"{t:g}"] = fp
                save_results(results)
                print(json.dumps(fp), flush=True)
        else:
            faults = choices(args.fault, FAULTS, "fault")
            phases = choices(args.phase, PHASES, "phase")
            for transport in choices(args.transport, TRANSPORTS, "transport"):
                with transport_env(bed, transport, tmp) as pki:
                    run_matrix(args, results, bed, pki, transport, faults, phases)
    print(f"done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(false_positives_markdown(results) if args.false_positives else matrix_markdown(results))
    if not args.no_doc:
        write_doc(results)


def run_matrix(
    args: argparse.Namespace,
    results: dict[str, Any],
    bed: TestBed,
    pki: dict[str, dict[str, str]] | None,
    transport: str,
    faults: list[str],
    phases: list[str],
) -> None:
    def record(fault: str, phase: str, run: Callable[[], Outcome]) -> None:
        key = f"{transport}/{fault}/{phase}"
        t0 = time.monotonic()
        try:
            out = run()
        except Exception as e:  # noqa: BLE001 - a cell that cannot be set up is reported, the rest run
            traceback.print_exc()
            out = Outcome(None, "failed", type(e).__name__, f"could not measure: {first_line(e)}")
            drain(bed)
        cell = {**out.__dict__, "date": dt.date.today().isoformat(), "tree": tree()}
        results.setdefault("cells", {})[key] = cell
        save_results(results)
        print(f"{key}: {cell_text(cell)} -- {out.detail} ({time.monotonic() - t0:.0f} s)",
              file=sys.stderr, flush=True)  # fmt: skip

    for fault in [f for f in faults if f != "scancel"]:
        for phase in phases:
            record(fault, phase, lambda: bed_cell(bed, pki, fault, phase, args.bound))  # noqa: B023 - called at once
    if "scancel" in faults:
        with slurm_cluster(bed, pki) as cluster:
            for phase in phases:
                record("scancel", phase, lambda: slurm_cell(cluster, transport, phase, args.bound))  # noqa: B023 - called at once


if __name__ == "__main__":
    main()
