"""``palatine ps`` and ``--job`` against a running local mesh (real processes): the job
records itself, client commands reach it by ``--job latest``, its id or as the only job,
several jobs must be told apart, and the record goes with the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import palatine
from palatine.job.records import JobRecord, RecordDir


@pytest.fixture(scope="module")
def runtime() -> Iterator[Path]:
    """A runtime dir of this module's own, so that other jobs of this user stay out."""
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", d)
        mp.delenv("PALATINE_SYSTEM_ADDR", raising=False)
        yield Path(d) / "palatine"


@pytest.fixture(scope="module")
def mesh(runtime: Path) -> Iterator[Any]:
    m = palatine.local_mesh(hosts=1, procs_per_host=2, startup_timeout_s=90)
    try:
        yield m
    finally:
        m.shutdown()


def palatine_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PALATINE_CLUSTER_TOKEN"}
    return subprocess.run([sys.executable, "-m", "palatine", *args], capture_output=True,
                          text=True, timeout=60, env=env)  # fmt: skip


def test_ps_lists_the_running_mesh_under_its_job_id(mesh: Any, runtime: Path) -> None:
    out = palatine_cli("ps", "--json")
    assert out.returncode == 0, out.stderr
    [job] = json.loads(out.stdout)
    assert job["id"] == mesh.job_id
    assert job["system_addr"] == mesh.system_addr
    assert job["shape"] == "1x2"
    assert os.stat(job["token_file"]).st_mode & 0o777 == 0o600
    assert Path(job["log_dir"]).is_dir()
    table = palatine_cli("ps")
    assert mesh.job_id in table.stdout and mesh.system_addr in table.stdout


def test_snapshot_reaches_the_latest_job_with_its_recorded_token(mesh: Any) -> None:
    out = palatine_cli("snapshot", "--job", "latest", "--json")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["execution_id"] == mesh.job_id
    assert sorted(snap["worlds"]["worker"]["procs"]) == ["worker[0]", "worker[1]"]


def test_top_and_stacks_reach_the_only_job_without_being_told(mesh: Any) -> None:
    top = palatine_cli("top", "--once", "--interval-in-sec", "0.1")
    assert top.returncode == 0, top.stderr
    assert "worker[1]" in top.stdout
    stacks = palatine_cli("stacks", "--job", mesh.job_id, "--rank", "0")
    assert stacks.returncode == 0, stacks.stderr
    assert "rank 0 of worker" in stacks.stdout


def test_with_two_live_jobs_a_command_asks_which_one(mesh: Any, runtime: Path) -> None:
    # (a second job that this test process keeps alive)
    other = JobRecord(id="zz-other", system_addr="unix:@nobody-listens", token_file="/none",
                      log_dir="", pid=os.getpid(), started=time.time() + 1)  # fmt: skip
    with RecordDir(runtime).recorded(other):
        out = palatine_cli("snapshot")
        assert out.returncode == 2
        assert "2 live jobs" in out.stderr and mesh.job_id in out.stderr
        assert "--job" in out.stderr
        named = palatine_cli("snapshot", "--job", mesh.job_id, "--json")
        assert named.returncode == 0, named.stderr
    missing = palatine_cli("stop", "--job", "nosuchjob")
    assert missing.returncode == 2
    assert "--job nosuchjob matches no live jobs" in missing.stderr


def test_a_finished_jobs_record_is_removed(runtime: Path) -> None:
    m = palatine.local_mesh(hosts=1, procs_per_host=1, startup_timeout_s=90)
    job = m.job_id
    assert job is not None and RecordDir(runtime).exists(job)
    m.shutdown()
    assert not RecordDir(runtime).exists(job)
    assert job not in palatine_cli("ps").stdout
