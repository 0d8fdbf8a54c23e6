"""``palatine launch --scheduler local``: a program runs against a job it did not start.

The launcher starts the job, hands the program its address in the environment (where
``palatine.connect()`` finds it), exits with the program's status and leaves nothing
running; signals reach the program. The Slurm form is in ``tests/cluster/test_slurm.py``.
"""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import time

import cloudpickle
import psutil
import pytest

import palatine
from palatine import Actor, endpoint
from palatine.job import LocalJob
from palatine.tensor.client.local import local_mesh

pytestmark = pytest.mark.timeout(120)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def launch_argv(*program: str, hosts: int = 1, per_host: int = 2) -> list[str]:
    return [sys.executable, "-m", "palatine", "launch", "--scheduler", "local", "--hosts",
            str(hosts), "--procs-per-host", str(per_host), "--", *program]  # fmt: skip


def processes_naming(text: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(text in part for part in p.info["cmdline"] or ()):
            out.append(p)
    return out


PROGRAM = """
import os, sys, palatine
from palatine import fetch, remote
print(os.environ["PALATINE_SYSTEM_ADDR"], os.environ["PALATINE_JOB_ID"], flush=True)
with palatine.connect() as mesh:
    ranks = fetch(remote("palatine.tensor.worker.functions.coordinate")(mesh.handle(), ("host", "proc")), shard=1).result()
    print("mesh", mesh.names, mesh.sizes, "rank", ranks, flush=True)
sys.exit(5)
"""


def test_launch_runs_the_program_on_the_job_exits_with_its_status_and_leaves_nothing() -> None:
    done = subprocess.run(
        launch_argv(sys.executable, "-c", PROGRAM, hosts=2, per_host=1),
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 5, out
    addr, job = done.stdout.splitlines()[0].split()
    # (the job id is its record's, as palatine ps lists it: the local job's execution id)
    assert job.startswith(getpass.getuser() + "-") and addr.startswith("unix:"), out
    assert "mesh ['host', 'proc'] [2, 1] rank 1" in done.stdout, out
    assert f"palatine launch: job {job}: 2 host(s) × 1 procs up in" in done.stderr, out
    assert processes_naming(addr) == []


def test_sigterm_to_the_launcher_reaches_the_program_and_the_job_is_torn_down() -> None:
    program = (
        "import os, signal, sys, time, palatine\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('program got SIGTERM', flush=True), sys.exit(7)))\n"
        "mesh = palatine.connect()\n"
        "print(os.environ['PALATINE_SYSTEM_ADDR'], flush=True)\n"
        "try:\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    mesh.shutdown()\n"
    )
    launcher = subprocess.Popen(
        launch_argv(sys.executable, "-c", program), stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None
        addr = launcher.stdout.readline().strip()
        assert addr.startswith("unix:"), addr
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    assert code == 7
    assert launcher.stdout.read() == "program got SIGTERM\n"
    assert took < 15, took
    assert processes_naming(addr) == []


def test_launch_without_a_program_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "palatine", "launch", "--scheduler", "local", "--hosts", "1",
         "--procs-per-host", "1"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "give the program to run after '--'" in done.stderr


def test_launch_of_a_shape_no_controller_takes_is_refused_before_anything_starts() -> None:
    done = subprocess.run(
        launch_argv("true", hosts=1, per_host=0), capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "palatine launch: procs_per_host must be from 1 to 4096, got 0"


def test_connect_without_an_address_outside_a_launch_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PALATINE_SYSTEM_ADDR", raising=False)
    with pytest.raises(ValueError, match="run the program under 'palatine launch'"):
        palatine.connect()


@pytest.mark.parametrize(
    ("hosts", "per_host", "message"),
    [
        (1, 0, "procs_per_host must be from 1 to 4096, got 0"),
        (-1, 4, "hosts must be from 1 to 1048576, got -1"),
        (1, 10000, "procs_per_host must be from 1 to 4096, got 10000"),
        (1, 2.5, "procs_per_host must be an int from 1 to 4096, not 2.5"),
        (512, 4096, "hosts × procs_per_host must be at most 1048576, got 512 × 4096 = 2097152"),
    ],
)
def test_local_mesh_refuses_a_bad_shape_by_name_before_starting_a_process(
    hosts: int, per_host: int, message: str
) -> None:
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    t0 = time.monotonic()
    with pytest.raises(ValueError) as ei:
        local_mesh(hosts, per_host)
    assert str(ei.value) == message
    assert time.monotonic() - t0 < 0.5
    assert {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} <= before


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def rank(self) -> tuple[dict[str, int], int, dict[str, int]]:
        point = palatine.current_rank()
        return dict(point), point.rank, palatine.current_size()  # type: ignore[attr-defined]


class Planner(Actor):
    """Spawns proc meshes of its own on the job's hosts it was passed."""

    @endpoint
    def spread(self, hosts: object) -> list[int]:
        procs = hosts.spawn_procs(per_host={"gpus": 1})  # type: ignore[attr-defined]
        pids = list(procs.spawn("pid", Pid).pid.call().get().values())
        procs.stop().get(timeout=30)
        return pids


def test_a_job_host_mesh_passed_to_an_actor_spawns_proc_meshes_there() -> None:
    with LocalJob(hosts=2, procs_per_host=1) as job:
        hosts = job.host_mesh()
        planners = hosts.spawn_procs(per_host={"procs": 1}).spawn("planner", Planner)
        pids = planners.slice(hosts=0).spread.call_one(hosts).get(timeout=120)
        assert len(set(pids)) == 2 and os.getpid() not in pids


def test_a_local_jobs_host_mesh_spawns_proc_meshes_on_its_hosts_and_stops_them() -> None:
    with LocalJob(hosts=2, procs_per_host=1) as job:
        hosts = job.host_mesh()
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        assert procs.sizes == {"hosts": 2, "gpus": 2}
        pids = procs.spawn("pid", Pid).pid.call().get()
        assert [tuple(p.values()) for p, _ in pids.items()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert len(set(pids.values())) == 4
        # each actor knows its point in the mesh, by the mesh's own dimension names
        ranks = procs.spawn("pid2", Pid).rank.call().get()
        for point, (coords, flat, size) in ranks.items():
            assert coords == point and flat == point.rank
            assert size == {"hosts": 2, "gpus": 2}
        assert [p.rank for p, _ in ranks.items()] == [0, 1, 2, 3]
        assert ranks.item(hosts=1, gpus=0)[0] == {"hosts": 1, "gpus": 0}
        procs.stop().get(timeout=30)
        assert all(not psutil.pid_exists(p) for p in pids.values())
        with pytest.raises(ValueError, match="per_host cannot name 'hosts'"):
            hosts.spawn_procs(per_host={"hosts": 1, "b": 1})
        # several dimensions per host: row-major after the hosts
        grid = hosts.spawn_procs(per_host={"a": 1, "b": 2})
        points = grid.spawn("pid3", Pid).rank.call().get()
        assert [c for _, (c, _f, _s) in points.items()] == [
            {"hosts": h, "a": 0, "b": b} for h in range(2) for b in range(2)
        ]
        grid.stop().get(timeout=30)
