"""Slurm defaults that work on a real cluster (the test bed of ``test_slurm``).

The log dir is on the submit directory's filesystem (``./palatine-logs/<job>``), and one
short probe step checks that every node sees it and the Python interpreter before the
hosts start: a node that does not is named, with what it lacks. Here node1's ``slurmd``
sees a directory of the submitter's as an empty tmpfs, as a node that does not mount
that filesystem would; inside an allocation, ``palatine launch`` takes ``--hosts`` from
it and runs the probe as a step of it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_slurm as base

from palatine import fetch, remote
from palatine.errors import SchedulerError
from palatine.job import slurm as slurm_module
from palatine.job.records import live_jobs
from palatine.job.slurm import SlurmJob, squeue_state
from palatine.testing.netns import TestBed
from palatine.testing.netns import unavailable as no_bed
from palatine.testing.slurm import PARTITION, SlurmTestCluster
from palatine.testing.slurm import unavailable as no_slurm

_why = no_bed() or no_slurm()
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(_why is not None, reason=f"no Slurm test cluster here: {_why}"),
]


@contextlib.contextmanager
def cluster_hiding(
    monkeypatch: pytest.MonkeyPatch, hidden: dict[int, str] | None = None
) -> Iterator[SlurmTestCluster]:
    """A 2-node Slurm test cluster whose node ``i`` sees ``hidden[i]`` empty."""
    bed = TestBed(2)
    try:
        bed.start()
    except RuntimeError as e:
        pytest.skip(f"cannot make a namespace test bed here: {e}")
    cluster = SlurmTestCluster(bed, node_hidden=hidden)
    try:
        cluster.start()
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        for var in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PALATINE_LOG_DIR"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("PALATINE_HOST_IP", bed.root_ip)
        from palatine import config

        with config.override(host_ip=bed.root_ip, log_dir=None):
            yield cluster
        assert cluster.squeue() == []
    finally:
        cluster.close()
        bed.close()
    assert bed.leftovers() == []


def refusal(job: SlurmJob) -> str:
    """The `SchedulerError` that starting ``job`` ends in, in words; the job cancelled."""
    try:
        with pytest.raises(SchedulerError) as ei:
            job.apply()
            job.state()
    finally:
        job.cancel(clean=False)
    return str(ei.value)


def test_a_jobs_default_log_dir_is_under_the_submit_directory_and_squeue_json_reads_its_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    with cluster_hiding(monkeypatch):
        with SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, startup_timeout_s=120) as job:
            with job.mesh().activate():
                assert fetch(remote(len)("abc")).result(timeout=60) == 3
            (record,) = [r for r in live_jobs() if r.id == job.job_id]
            log_dir = Path(record.log_dir)
            assert log_dir.parent == tmp_path / "palatine-logs", log_dir
            assert (log_dir / f"slurm-{job.job_id}.out").exists()
            job_id = job.job_id
            assert job_id is not None and squeue_state(job_id) == "RUNNING"
            assert slurm_module._squeue_json  # this Slurm (22.05 and later) has squeue --json
        # ended, said by the Slurm that ran it (squeue keeps an ended job for a while)
        assert squeue_state(job_id) in (None, *slurm_module._ENDED)
    # A Slurm that cannot be asked (here: its configuration is gone) is no evidence that
    # the job ended.
    assert squeue_state(job_id) == "UNKNOWN"


def test_the_probe_names_the_node_that_does_not_see_the_log_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    logs = shared / "logs"
    with cluster_hiding(monkeypatch, {1: str(shared)}):
        text = refusal(SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, log_dir=str(logs)))
    assert f"node node1 does not see the log dir {logs}" in text, text
    assert "node0" not in text, text  # the node that sees it is not blamed


def test_the_probe_names_a_missing_python_interpreter_on_every_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = str(tmp_path / "no-such-python")
    with cluster_hiding(monkeypatch):
        job = SlurmJob(
            hosts=2, procs_per_host=1, partition=PARTITION, python=missing, log_dir=str(tmp_path)
        )
        text = refusal(job)
    for node in ("node0", "node1"):
        assert f"node {node} does not see the Python interpreter {missing}" in text, text


def test_inside_an_allocation_launch_takes_its_node_count_and_probes_its_nodes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    py = sys.executable
    with cluster_hiding(monkeypatch, {1: str(shared)}) as slurm:
        job_id, out = base.submit_batch(tmp_path, 2, [
            f"exec {py} -m palatine launch --procs-per-host 1 --log-dir {shared}/logs "
            "--start-timeout-in-sec 120 -- /bin/true",
        ])  # fmt: skip
        text = base.wait_batch(slurm, job_id, out)
    assert f"allocation {job_id}: the nodes cannot run the job" in text, text
    assert f"node node1 does not see the log dir {shared}/logs" in text, text
    assert "JobState=FAILED" in text, text


def test_launch_without_hosts_outside_an_allocation_says_to_give_them() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "palatine", "launch", "--procs-per-host", "1", "--", "/bin/true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "give --hosts" in done.stderr, done.stderr
