"""A Slurm job's record (palatine.job.records) on the submitting machine: listed by
``palatine ps`` under Slurm's job id, reached by ``--job`` with the token in its log
dir, and gone when the job is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_slurm as base

from palatine.job.records import RecordDir
from palatine.job.slurm import SlurmJob
from palatine.testing.slurm import PARTITION, SlurmTestCluster

pytestmark = base.pytestmark
slurm = base.slurm  # the fixture: a 2-node Slurm test cluster


def palatine_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PALATINE_CLUSTER_TOKEN"}
    return subprocess.run([sys.executable, "-m", "palatine", *args], capture_output=True,
                          text=True, timeout=60, env=env)  # fmt: skip


def test_a_slurm_job_is_listed_under_its_slurm_id_and_reached_by_it(
    slurm: SlurmTestCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, startup_timeout_s=120) as job:
        assert job.state() == "Live"
        slurm_id = job.job_id
        assert slurm_id is not None and job.mesh().job_id == slurm_id
        out = palatine_cli("ps", "--json")
        [rec] = json.loads(out.stdout)  # (its system wrote none of its own)
        assert (rec["id"], rec["scheduler_job"], rec["shape"]) == (slurm_id, slurm_id, "2x1")
        assert rec["pid"] == os.getpid() and rec["token_file"].startswith(rec["log_dir"])
        snap = palatine_cli("snapshot", "--job", slurm_id, "--json")
        assert snap.returncode == 0, snap.stderr
        assert sorted(json.loads(snap.stdout)["worlds"]["worker"]["procs"]) == [
            "worker[0]",
            "worker[1]",
        ]
    assert RecordDir(tmp_path / "palatine").live() == []
    assert not (tmp_path / "palatine" / f"{slurm_id}.json").exists()
