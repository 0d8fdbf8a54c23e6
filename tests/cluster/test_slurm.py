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
