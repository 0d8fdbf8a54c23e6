"""Jobs on a real Slurm cluster: ``slurmctld`` here, one ``slurmd`` per namespace node.

The client, the system and the controller run in the root namespace; ``sbatch`` puts one
``palatine host`` on each allocated node, inside that node's namespace."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import cloudpickle
import pytest

from palatine import inspect, remote
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


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmTestCluster]:
    bed = TestBed(2)
    try:
        bed.start()
    except RuntimeError as e:
        pytest.skip(f"cannot make a namespace test bed here: {e}")
    cluster = SlurmTestCluster(bed)
    try:
        cluster.start()
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        from palatine import config

        with config.override(host_ip=bed.root_ip):
            yield cluster
        assert cluster.squeue() == []  # nothing left in the queue
    finally:
        cluster.close()
        bed.close()
    assert bed.leftovers() == []


def test_a_slurm_job_runs_calls_on_its_nodes_and_a_collective_across_them(
    slurm: SlurmTestCluster,
) -> None:
    with SlurmJob(hosts=2, procs_per_host=2, partition=PARTITION, start_timeout_s=120) as job:
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

    job = SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, start_timeout_s=120)
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
