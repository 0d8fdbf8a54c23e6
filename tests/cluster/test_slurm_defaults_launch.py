"""``palatine launch``'s defaults for real clusters, on this machine (``--scheduler
local``: no Slurm needed): a hangup (an ssh session that drops) does not end the launch
or its program; ``--detach`` returns at once and leaves the job running; inside an
allocation ``--hosts`` and ``--procs-per-host gpu`` come from Slurm's variables."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palatine.cli import launch

pytestmark = pytest.mark.timeout(180)

# Attaches to the job, waits (bounded) for a file named "go" beside it, then calls the
# job's worker, says so and leaves "done" there.
PROGRAM = """\
import pathlib, sys, time
import palatine
from palatine import fetch, remote
here = pathlib.Path(sys.argv[1])
with palatine.connect() as mesh, mesh.activate():
    (here / "started").write_text("")
    deadline = time.monotonic() + 120
    while not (here / "go").exists():
        if time.monotonic() > deadline:
            sys.exit("no go within 120 s")
        time.sleep(0.05)
    print("program went on", fetch(remote(len)("abc")).result(timeout=60), flush=True)
(here / "done").write_text("")
"""


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s:g} s"
        time.sleep(0.05)


def launch_argv(tmp_path: Path, *extra: str) -> list[str]:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    return [
        sys.executable, "-m", "palatine", "launch", "--scheduler", "local", "--hosts", "1",
        "--procs-per-host", "1", *extra, "--", sys.executable, str(program), str(tmp_path),
    ]  # fmt: skip


def test_a_hangup_does_not_end_the_launch_nor_its_program(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        launch_argv(tmp_path),
        cwd=tmp_path,
        start_new_session=True,  # its own process group: the terminal's, hung up below
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(tmp_path / "started")
        os.killpg(proc.pid, signal.SIGHUP)  # what a dropped ssh session sends its jobs
        (tmp_path / "go").write_text("")
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out
    assert "program went on 3" in out, out  # the job's worker answered after the hangup


def test_detach_returns_at_once_and_the_job_runs_on(tmp_path: Path) -> None:
    done = subprocess.run(
        launch_argv(tmp_path, "--detach"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    m = re.search(r"detached \(pid (\d+)\); its output goes to (\S+);", done.stderr)
    assert m, done.stderr
    pid, out = int(m[1]), Path(m[2])
    assert out.parent == tmp_path / "palatine-logs"
    try:
        wait_for(tmp_path / "started")  # the job came up after the command returned
        (tmp_path / "go").write_text("")
        wait_for(tmp_path / "done")
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
            assert time.monotonic() < deadline, "the detached launcher did not end"
            time.sleep(0.05)
    finally:
        if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
            os.kill(pid, signal.SIGKILL)
    text = out.read_text()
    assert "palatine launch: job" in text and "program went on 3" in text, text


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def args_of(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_arguments(p)
    return p.parse_args([*argv, "--", "true"])


def test_inside_an_allocation_hosts_and_gpu_procs_come_from_slurm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    args = args_of("--procs-per-host", "gpu")
    launch._resolve_shape(args)
    assert (args.hosts, args.procs_per_host, args.gpus_per_node) == (3, 4, 4)
    submitted = args_of(
        "--procs-per-host", "gpu", "--submit", "--hosts", "2", "--gpus-per-node", "8"
    )
    launch._resolve_shape(submitted)  # a job of its own: the allocation's GPUs do not count
    assert (submitted.hosts, submitted.procs_per_host) == (2, 8)


def test_outside_an_allocation_hosts_must_be_given(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="give --hosts"):
        launch._resolve_shape(args_of("--procs-per-host", "2"))
    with pytest.raises(ValueError, match="no GPU count known"):  # a submit host's own GPUs
        launch._resolve_shape(args_of("--hosts", "2", "--procs-per-host", "gpu"))  # do not count
    with pytest.raises(SystemExit):
        args_of("--procs-per-host", "many")  # a number or 'gpu'
