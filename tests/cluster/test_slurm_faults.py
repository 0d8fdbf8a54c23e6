"""What a Slurm user meets when things go wrong, on the real Slurm test cluster: where
the system listens and what is said when that cannot work, an ``scancel`` under a job,
and ``palatine job status|cancel`` beside a running job.

The cluster is `test_slurm`'s: ``slurmctld`` here, one ``slurmd`` per namespace node."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
import test_slurm as base

from palatine import DeviceException, config, fetch, remote
from palatine.job.slurm import SlurmJob
from palatine.testing.slurm import PARTITION, SlurmTestCluster

pytestmark = base.pytestmark
cloudpickle.register_pickle_by_value(sys.modules[__name__])

slurm = base.slurm  # the fixture: a 2-node Slurm test cluster


@contextlib.contextmanager
def launched_waiting() -> Iterator[subprocess.Popen[str]]:
    """``palatine launch`` of `base.WAIT_PROGRAM` on 2 nodes (1 proc each), killed at the
    end of the block if it still runs."""
    argv = [sys.executable, "-m", "palatine", "launch", "--scheduler", "slurm", "--partition",
            PARTITION, "--hosts", "2", "--procs-per-host", "1", "--start-timeout-in-sec", "120",
            "--", sys.executable, "-c", base.WAIT_PROGRAM]  # fmt: skip
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)


def attached(launcher: subprocess.Popen[str], slurm: SlurmTestCluster) -> str:
    """Wait until the launched program attached; the job's id."""
    assert launcher.stdout is not None and launcher.stderr is not None
    first = launcher.stdout.readline()
    assert first == "attached\n", first + launcher.stderr.read()
    return slurm.squeue()[0].split()[0]


def ended(launcher: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    """The launcher's exit status and the rest of its stdout and stderr (bounded)."""
    try:
        out, err = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        out, err = launcher.communicate(timeout=30)
    return launcher.returncode, out, err


# ------------------------------------------------------------------ where the system listens


def test_a_slurm_job_without_palatine_host_ip_listens_where_its_nodes_reach_it(
    slurm: SlurmTestCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This machine's hostname resolves to a loopback address here; the nodes are on the bridge.
    monkeypatch.delenv("PALATINE_HOST_IP")
    with config.override(host_ip=None):
        with SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, startup_timeout_s=60) as job:
            assert job.state() == "Live"
            assert job.client_env()["PALATINE_SYSTEM_ADDR"].startswith(f"tcp:{slurm.bed.root_ip}:")
            with job.mesh().activate():
                assert fetch(remote(len)("abc"), shard={"host": 1, "proc": 0}).result(60) == 3
    assert slurm.squeue() == []


def test_a_submit_host_with_only_loopback_says_so_at_once(
    slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    # A machine whose only interface is its loopback (a network namespace of its own):
    # Slurm cannot be reached either, but what the system would listen on is said first.
    program = (
        "import time, palatine.job.slurm as s\n"
        "from palatine.cli.role import setup_logging\n"
        "setup_logging()\n"
        "t0 = time.monotonic()\n"
        f"job = s.SlurmJob(2, 1, partition={PARTITION!r}, log_dir={str(tmp_path)!r})\n"
        "try:\n"
        "    job.apply()\n"
        "except s.SchedulerError as e:\n"
        "    print('refused:', str(e).splitlines()[0], flush=True)\n"
        "finally:\n"
        "    job.cancel()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PALATINE_HOST_IP"}
    argv = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
            sys.executable, "-c", program]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stderr is not None
    warning = ""
    for line in proc.stderr:
        if "loopback" in line:
            warning = line
            break
    said_after = time.monotonic() - started
    still_submitting = proc.poll() is None
    out, err = proc.communicate(timeout=120)
    assert "WARNING palatine.job.slurm: the system listens on 127.0.0.1" in warning, warning + err
    assert "set PALATINE_HOST_IP" in warning, warning
    # at once: before sbatch (which waits out Slurm's message timeout here, as sinfo did)
    assert still_submitting and said_after < 20, said_after
    assert out.startswith("refused: sbatch refused the job"), out + err


def test_palatine_host_ip_inherited_by_a_batch_script_is_ignored_with_a_warning(
    slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    py = sys.executable
    job_id, out = base.submit_batch(tmp_path, 2, [
        f"exec {py} -m palatine launch --hosts 2 --procs-per-host 1 --start-timeout-in-sec 120 "
        f"-- {py} -m palatine demo --connect --steps 20",
    ], keep_host_ip=True)  # fmt: skip
    text = base.wait_batch(slurm, job_id, out)
    assert (
        f"WARNING palatine.job.slurm: PALATINE_HOST_IP={slurm.bed.root_ip} is not an address "
        f"of this node"
    ) in text, text
    assert f"allocation {job_id}: ignored" in text, text
    assert "replicas identical on 2/2 ranks" in text, text
    assert "Traceback" not in text, text
    assert "JobState=COMPLETED" in text and "ExitCode=0:0" in text, text


def test_a_palatine_host_ip_this_machine_cannot_listen_on_fails_the_launch_at_once_in_one_line(
    slurm: SlurmTestCluster,
) -> None:
    elsewhere = slurm.bed.node_ip(0)  # an address of node 0, not of this machine
    env = {**os.environ, "PALATINE_HOST_IP": elsewhere}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "palatine", "launch", "--scheduler", "slurm", "--partition",
         PARTITION, "--hosts", "2", "--procs-per-host", "1", "--", "/bin/true"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"palatine launch: cannot listen on {elsewhere} (PALATINE_HOST_IP): "
        "Cannot assign requested address\n"
    ), done.stderr
    assert took < 10, took
    assert slurm.squeue() == []  # nothing was submitted


# ------------------------------------------------------------------ scancel, job status|cancel


def test_a_slurm_job_scancelled_under_its_client_names_the_cancellation(
    slurm: SlurmTestCluster,
) -> None:
    job_id = None
    with pytest.raises(DeviceException) as ei:
        with SlurmJob(hosts=2, procs_per_host=1, partition=PARTITION, startup_timeout_s=120) as job:
            with job.mesh().activate():
                pending = fetch(remote(base.sleep_then)(1), shard={"host": 1, "proc": 0})
                job_id = job.job_id
                assert job_id is not None
                subprocess.run(["scancel", job_id], check=True, timeout=30)
                pending.result(timeout=60)
    assert getattr(ei.value, "__notes__", []) == [f"Slurm job {job_id} was cancelled (scancel)"]
    assert slurm.squeue() == []


def test_a_launched_program_scancelled_under_it_names_the_cancellation_in_its_own_exception(
    slurm: SlurmTestCluster,
) -> None:
    # The program attached with connect(); what it catches is its own DeviceException,
    # which must say that Slurm took the ranks, not only that they went.
    with launched_waiting() as launcher:
        job_id = attached(launcher, slurm)
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        code, out, err = ended(launcher)
    assert code == 4, out + err
    assert out.startswith(f"lost: Slurm job {job_id} was cancelled (scancel): "), out + err
    assert "worker rank " in out, out


def test_palatine_job_cancel_of_a_launch_is_quick_and_quiet_and_the_launcher_names_it(
    slurm: SlurmTestCluster,
) -> None:
    with launched_waiting() as launcher:
        job_id = attached(launcher, slurm)
        started = time.monotonic()
        cancel = base.palatine_job("cancel", job_id)
        took = time.monotonic() - started
        code, out, err = ended(launcher)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert cancel.stdout.startswith(f"job {job_id}: cancelled"), cancel.stdout
    assert "did not answer" not in cancel.stdout, cancel.stdout
    assert cancel.stderr == "", cancel.stderr
    assert took < 6, (took, cancel.stdout)
    assert code == 4, out + err
    assert out.startswith("lost: "), out
    assert "worker rank " in out, out
    assert f"Slurm job {job_id} was cancelled (scancel)" in err, err


def test_palatine_job_status_leaves_no_trace_in_the_jobs_output_or_its_own(
    slurm: SlurmTestCluster,
) -> None:
    with launched_waiting() as launcher:
        job_id = attached(launcher, slurm)
        statuses = [base.palatine_job("status", job_id) for _ in range(3)]
        launcher.terminate()  # it passes SIGTERM on and tears the job down
        _, _, err = ended(launcher)
    for status in statuses:
        assert status.returncode == 0, status.stderr
        assert "world worker: Live, 2/2 procs alive" in status.stdout, status.stdout
        assert status.stderr == "", status.stderr
    # (the system's lines about the observers, which are user[R] procs as the program is)
    assert "unknown to the system" not in err, err
    assert not [line for line in err.splitlines() if "palatine.system: heartbeat" in line], err
