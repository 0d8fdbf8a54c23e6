"""Jobs on a real Slurm cluster: ``slurmctld`` here, one ``slurmd`` per namespace node.

The client, the system and the controller run in the root namespace; ``sbatch`` puts one
``palatine host`` on each allocated node, inside that node's namespace."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

from palatine import Actor, endpoint, inspect, remote
from palatine.errors import SchedulerError
from palatine.job.slurm import SlurmJob
from palatine.testing.netns import TestBed
from palatine.testing.netns import unavailable as no_bed
from palatine.testing.slurm import PARTITION, SlurmTestCluster
from palatine.testing.slurm import unavailable as no_slurm

_why = no_bed() or no_slurm()
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(_why is not None, reason=f"no Slurm test cluster here: {_why}"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def net_namespace() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def ones_times(rank: object) -> object:
    import torch

    return torch.ones(2) * float(rank)  # type: ignore[arg-type]


@contextlib.contextmanager
def slurm_cluster(
    monkeypatch: pytest.MonkeyPatch, pki_dir: Path | None = None
) -> Iterator[SlurmTestCluster]:
    """A 2-node Slurm test cluster; with ``pki_dir``, one certificate per machine from one
    CA (the submitter's in this process's environment, each node's through Slurm)."""
    bed = TestBed(2)
    try:
        bed.start()
    except RuntimeError as e:
        pytest.skip(f"cannot make a namespace test bed here: {e}")
    node_env: dict[int, dict[str, str]] = {}
    if pki_dir is not None:
        from palatine.testing.certs import make_node_pki

        pki = make_node_pki(pki_dir, [bed.root_ip, bed.node_ip(0), bed.node_ip(1)])
        for k, v in pki[bed.root_ip].items():
            monkeypatch.setenv(k, v)
        node_env = {i: pki[bed.node_ip(i)] for i in range(2)}
    cluster = SlurmTestCluster(bed, node_env=node_env)
    try:
        cluster.start()
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        for var in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
            monkeypatch.delenv(var, raising=False)  # (not inside an allocation of another cluster)
        monkeypatch.setenv("PALATINE_HOST_IP", bed.root_ip)  # for launchers in subprocesses
        from palatine import config

        with config.override(host_ip=bed.root_ip):
            yield cluster
        assert cluster.squeue() == []  # nothing left in the queue
    finally:
        cluster.close()
        bed.close()
    assert bed.leftovers() == []


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmTestCluster]:
    with slurm_cluster(monkeypatch) as cluster:
        yield cluster


@pytest.fixture
def slurm_tls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SlurmTestCluster]:
    with slurm_cluster(monkeypatch, tmp_path / "pki") as cluster:
        yield cluster


def test_a_slurm_job_runs_calls_on_its_nodes_and_a_collective_across_them(
    slurm: SlurmTestCluster,
) -> None:
    with SlurmJob(hosts=2, procs_per_host=2, partition=PARTITION, startup_timeout_s=120) as job:
        assert job.state() == "Live"
        mesh = job.mesh()
        with mesh.activate():
            where = remote(net_namespace)()
            seen = [inspect(where, shard={"host": h, "proc": p}) for h in (0, 1) for p in (0, 1)]
            assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
            assert net_namespace() not in seen
            total = remote(ones_times)(mesh.rank(("host", "proc"))).reduce(
                ("host", "proc"), op="sum"
            )
            assert inspect(total, shard={"host": 0, "proc": 0}).tolist() == [6.0, 6.0]
        assert job.job_state() == "RUNNING"
    assert slurm.squeue() == []


def test_a_job_slurm_refuses_is_an_error_in_sbatchs_words(slurm: SlurmTestCluster) -> None:
    job = SlurmJob(hosts=2, procs_per_host=1, partition="no-such-partition")
    with pytest.raises(SchedulerError) as ei:
        job.apply()
    assert str(ei.value).startswith("sbatch refused the job: sbatch: error: ")
    assert "invalid partition" in str(ei.value).lower()
    job.cancel()


def sleep_then(value: int) -> int:
    import time

    time.sleep(60)
    return value


def test_a_job_cancelled_under_the_client_is_a_clear_error_and_nothing_stays(
    slurm: SlurmTestCluster,
) -> None:
    import subprocess
    import time

    from palatine import DeviceException, fetch

    job = SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, startup_timeout_s=120)
    try:
        mesh = job.mesh()
        with mesh.activate():
            pending = fetch(remote(sleep_then)(1), shard={"host": 1, "proc": 0})
            assert job.job_id is not None
            cancelled_at = time.monotonic()
            subprocess.run(["scancel", job.job_id], check=True, timeout=30)
            with pytest.raises(DeviceException) as ei:
                pending.result(timeout=60)
            took = time.monotonic() - cancelled_at
            text = str(ei.value)  # every rank went down with the job: the first one heard of
            assert text.startswith(("worker rank 0 (worker[0]", "worker rank 1 (worker[1]")), text
            assert took < 10, (took, text)
    finally:
        job.cancel()
    assert slurm.squeue() == []


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "palatine", "launch", "--scheduler", "slurm", "--partition",
         PARTITION, "--start-timeout-in-sec", "120", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_palatine_launch_trains_the_demo_on_two_slurm_nodes_and_the_replicas_agree(
    transport: str, request: pytest.FixtureRequest
) -> None:
    slurm = request.getfixturevalue("slurm_tls" if transport == "tls" else "slurm")
    done = launch(
        "--hosts", "2", "--procs-per-host", "2", "--transport", transport, "--",
        sys.executable, "-m", "palatine", "demo", "--connect", "--steps", "80",
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "mesh: 2 host(s) × 2 procs = 4 workers" in done.stdout, out
    assert "replicas identical on 4/4 ranks" in done.stdout, out
    assert re.search(r"palatine launch: job \d+: 2 host\(s\) × 2 procs up in", done.stderr), out
    assert slurm.squeue() == []


def test_palatine_launch_exits_with_the_programs_status_and_hands_it_the_job(
    slurm: SlurmTestCluster,
) -> None:
    program = (
        "import os, sys, palatine\n"
        "print(os.environ['PALATINE_JOB_ID'], os.environ['PALATINE_WORKER_WORLD'])\n"
        "with palatine.connect() as mesh:\n"
        "    print('ranks', len(mesh))\n"
        "sys.exit(3)\n"
    )
    done = launch("--hosts", "2", "--procs-per-host", "1", "--", sys.executable, "-c", program)
    assert done.returncode == 3, done.stdout + done.stderr
    job_id, world = done.stdout.split("\n")[0].split()
    assert job_id.isdigit() and world == "worker"
    assert "ranks 2" in done.stdout
    assert slurm.squeue() == []


def wait_forever() -> int:
    import time

    time.sleep(3600)
    return 0


# A client program that attaches, waits on a call to a rank of host 1, and exits 4 with
# the error once that rank is lost.
WAIT_PROGRAM = (
    "import sys, palatine\n"
    "from palatine import fetch, remote\n"
    f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
    "from test_slurm import wait_forever\n"
    "with palatine.connect() as mesh:\n"
    "    print('attached', flush=True)\n"
    "    try:\n"
    "        fetch(remote(wait_forever)(), shard={'host': 1, 'proc': 0}).result(timeout=120)\n"
    "    except palatine.DeviceException as e:\n"
    "        print('lost:', str(e).splitlines()[0], flush=True)\n"
    "        sys.exit(4)\n"
)


def palatine_job(action: str, job_id: str) -> subprocess.CompletedProcess[str]:
    """``palatine job ACTION JOB``, run to its end (bounded)."""
    return subprocess.run(
        [sys.executable, "-m", "palatine", "job", action, job_id],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip


def submit_batch(
    tmp_path: Path, nodes: int, lines: list[str], *, keep_host_ip: bool = False
) -> tuple[str, Path]:
    """Submit a batch script of ``nodes`` nodes (one task each) that runs ``lines`` on
    the first, from this environment less this machine's address (unless
    ``keep_host_ip``: then the script inherits it); (job id, output file)."""
    script = tmp_path / "job.sbatch"
    head = f"#!/bin/bash\n#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node=1\n"
    script.write_text(head + f"#SBATCH --partition={PARTITION}\n" + "\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    env = {k: v for k, v in os.environ.items() if keep_host_ip or k != "PALATINE_HOST_IP"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", str(script)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return submitted.stdout.strip().split(";")[0], out


def wait_batch(slurm: SlurmTestCluster, job_id: str, out: Path) -> str:
    """Wait (bounded) until the batch job has left the queue; its output, then Slurm's
    one line on it. Asserts that no other job showed up in the queue meanwhile."""
    seen: set[str] = set()
    deadline = time.monotonic() + 180
    while (queue := slurm.squeue()) and time.monotonic() < deadline:
        seen |= {line.split()[0] for line in queue if line.strip()}
        time.sleep(0.5)
    text = out.read_text() if out.exists() else "(no output)"
    assert not queue, f"the batch job did not end in time:\n{text}"
    assert seen <= {job_id}, text  # nothing but the batch job itself: no job was submitted
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return text + "\n" + shown.stdout


def test_a_batch_script_trains_the_demo_with_palatine_launch_inside_its_own_allocation(
    slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    py = sys.executable
    job_id, out = submit_batch(tmp_path, 2, [
        f"exec {py} -m palatine launch --hosts 2 --procs-per-host 2 --start-timeout-in-sec 120 "
        f"-- {py} -m palatine demo --connect --steps 40",
    ])  # fmt: skip
    text = wait_batch(slurm, job_id, out)
    assert "mesh: 2 host(s) × 2 procs = 4 workers" in text, text
    assert "replicas identical on 4/4 ranks" in text, text
    assert f"palatine launch: job {job_id}: 2 host(s) × 2 procs up in" in text, text
    assert "JobState=COMPLETED" in text and "ExitCode=0:0" in text, text
    assert "Comment=palatine:" not in text, text  # the job's comment is as it was


def test_an_allocation_smaller_than_the_job_fails_it_at_once_saying_so(
    slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    job_id, out = submit_batch(tmp_path, 1, [
        f"exec {sys.executable} -m palatine launch --hosts 2 --procs-per-host 1 -- /bin/true",
    ])  # fmt: skip
    text = wait_batch(slurm, job_id, out)
    assert f"allocation {job_id} has 1 node(s); the job asks for 2 hosts" in text, text
    assert "JobState=FAILED" in text and "ExitCode=1:0" in text, text


def test_palatine_job_cancel_ends_palatines_step_in_a_batch_script_and_the_script_goes_on(
    slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    program = tmp_path / "wait.py"
    program.write_text(WAIT_PROGRAM)
    py = sys.executable
    job_id, out = submit_batch(tmp_path, 2, [
        f"{py} -m palatine launch --hosts 2 --procs-per-host 1 --start-timeout-in-sec 120 "
        f"-- {py} {program}",
        'echo "launch exited $?"',
    ])  # fmt: skip
    deadline = time.monotonic() + 120
    while "attached" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and slurm.squeue(), out.read_text()
        time.sleep(0.2)

    status = palatine_job("status", job_id)  # the record is found through the job's comment
    assert status.returncode == 0 and "world worker: Live, 2/2 procs alive" in status.stdout, (
        status.stdout + status.stderr
    )
    cancel = palatine_job("cancel", job_id)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert cancel.stdout.startswith(f"job {job_id}: palatine's step {job_id}."), cancel.stdout
    assert "cancelled; the allocation goes on" in cancel.stdout, cancel.stdout
    text = wait_batch(slurm, job_id, out)
    assert "lost: worker rank " in text, text
    assert "launch exited 4" in text, text  # the script went on after palatine's step
    assert "JobState=COMPLETED" in text and "ExitCode=0:0" in text, text


def test_palatine_job_status_names_where_each_rank_runs_and_cancel_ends_the_launch(
    slurm: SlurmTestCluster,
) -> None:
    program = WAIT_PROGRAM
    argv = [sys.executable, "-m", "palatine", "launch", "--scheduler", "slurm", "--partition",
            PARTITION, "--hosts", "2", "--procs-per-host", "1", "--start-timeout-in-sec", "120",
            "--", sys.executable, "-c", program]  # fmt: skip
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None and launcher.stderr is not None
        first = launcher.stdout.readline()
        assert first == "attached\n", first + launcher.stderr.read()
        job_id = slurm.squeue()[0].split()[0]

        status = palatine_job("status", job_id)
        assert status.returncode == 0, status.stderr
        text = status.stdout
        assert text.startswith(f"job {job_id}: RUNNING for "), text
        assert "on 2 node(s) (node[0-1])" in text, text
        assert "world worker: Live, 2/2 procs alive" in text, text
        ranks = re.findall(r"worker\[(\d)\]: Alive on \S+ at tcp:([\d.]+):\d+ pid \d+", text)
        assert sorted(r for r, _ in ranks) == ["0", "1"], text
        assert {ip for _, ip in ranks} == {slurm.bed.node_ip(0), slurm.bed.node_ip(1)}, text

        cancelled_at = time.monotonic()
        cancel = palatine_job("cancel", job_id)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert cancel.stdout.startswith(f"job {job_id}: cancelled"), cancel.stdout
        code = launcher.wait(timeout=60)
        took = time.monotonic() - cancelled_at
        rest = launcher.stdout.read()
        assert code == 4, rest + launcher.stderr.read()
        named = f"lost: Slurm job {job_id} was cancelled (scancel): worker rank "
        assert rest.startswith(named), rest
        assert took < 30, took
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # it passes SIGTERM on and tears the job down
            try:
                launcher.wait(60)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait(30)
    gone = palatine_job("status", job_id)
    assert gone.returncode == 1
    assert f"job {job_id} is not in Slurm's queue" in gone.stderr


class Where(Actor):
    """Says which network namespace (which node) it runs in."""

    @endpoint
    def namespace(self) -> int:
        return net_namespace()

    @endpoint
    def double(self, x: int) -> int:
        return 2 * x


def test_a_slurm_jobs_host_mesh_spawns_actors_on_every_node(slurm: SlurmTestCluster) -> None:
    with SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, startup_timeout_s=120) as job:
        hosts = job.host_mesh()
        assert hosts.sizes == {"hosts": 2}
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        assert procs.sizes == {"hosts": 2, "gpus": 2}
        where = procs.spawn("where", Where)
        seen = dict(
            (tuple(point.values()), ns) for point, ns in where.namespace.call().get().items()
        )
        assert seen[(0, 0)] == seen[(0, 1)] != seen[(1, 0)] == seen[(1, 1)]
        assert net_namespace() not in seen.values()
        assert where.slice(hosts=1, gpus=1).double.call_one(21).get() == 42
        procs.stop().get(timeout=60)
        again = hosts.spawn_procs(per_host={"procs": 1}).spawn("where", Where)
        assert sorted(again.double.call(4).get().values()) == [8, 8]
    assert slurm.squeue() == []
