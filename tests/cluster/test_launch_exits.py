"""How ``palatine launch`` ends on a real Slurm cluster (the test bed of ``test_slurm``).

A program that simply ends, with or without ``with palatine.connect()``, ends the job as
quietly and as quickly as the ``with`` form; a program that dies (SIGKILL) ends the
launch at once with its status: the launcher is its parent and stops the job's worlds
itself, instead of leaving the controller to find its client lost."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import test_slurm as base

from palatine.testing.netns import unavailable as no_bed
from palatine.testing.slurm import PARTITION, SlurmTestCluster
from palatine.testing.slurm import unavailable as no_slurm

slurm = base.slurm  # the fixture: a 2-node Slurm test cluster

_why = no_bed() or no_slurm()
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(_why is not None, reason=f"no Slurm test cluster here: {_why}"),
]

_NOISE = re.compile(r"\b(WARNING|ERROR)\b")

# The program's last line is the time it ended its work (monotonic, as this process's).
PLAIN = (
    "import time, palatine\n"
    "from palatine import fetch, remote\n"
    "mesh = palatine.connect()\n"
    "with mesh.activate():\n"
    "    print(fetch(remote(len)('abc')).result())\n"
    "print('done', time.monotonic(), flush=True)\n"
)
WITH = (
    "import time, palatine\n"
    "from palatine import fetch, remote\n"
    "with palatine.connect() as mesh, mesh.activate():\n"
    "    print(fetch(remote(len)('abc')).result())\n"
    "print('done', time.monotonic(), flush=True)\n"
)
KILLED = (
    "import os, time, palatine\n"
    "from palatine import fetch, remote\n"
    "mesh = palatine.connect()\n"
    "with mesh.activate():\n"
    "    print(fetch(remote(len)('abc')).result())\n"
    "print('done', time.monotonic(), flush=True)\n"
    "os.kill(os.getpid(), 9)\n"
)


def launch_program(program: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Launch ``program`` on 2 nodes × 1 proc; (the launch, seconds from the program's
    last line to the launcher's exit)."""
    done = subprocess.run(
        [sys.executable, "-m", "palatine", "launch", "--scheduler", "slurm", "--partition",
         PARTITION, "--start-timeout-in-sec", "120", "--hosts", "2", "--procs-per-host", "1",
         "--", sys.executable, "-c", program],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    ended = time.monotonic()
    last = [line for line in done.stdout.splitlines() if line.startswith("done ")]
    assert last, done.stdout + done.stderr
    return done, ended - float(last[0].split()[1])


@pytest.mark.parametrize("program", [PLAIN, WITH], ids=["without-with", "with"])
def test_a_program_that_ends_ends_its_launch_quietly_and_at_once_with_or_without_with(
    slurm: SlurmTestCluster, program: str
) -> None:
    done, took = launch_program(program)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3" in done.stdout.splitlines()
    noise = [line for line in done.stderr.splitlines() if _NOISE.search(line)]
    assert noise == [], done.stderr
    assert took < 2.0, (took, done.stderr)
    assert slurm.squeue() == []


def test_a_program_killed_ends_its_launch_at_once_with_its_status_and_no_supervision_noise(
    slurm: SlurmTestCluster,
) -> None:
    done, took = launch_program(KILLED)
    assert done.returncode == 137, done.stdout + done.stderr
    assert took < 2.0, (took, done.stderr)
    # Nothing but where its logs are kept: the job's own stop is no worker's failure.
    noise = [line for line in done.stderr.splitlines() if _NOISE.search(line)]
    assert len(noise) == 1 and "the logs of this mesh are kept in" in noise[0], done.stderr
    assert slurm.squeue() == []


CUT_THEN_KILLED = (
    "import os, time, palatine\n"
    "from palatine import fetch, remote\n"
    "mesh = palatine.connect()\n"
    "with mesh.activate():\n"
    "    print(fetch(remote(len)('abc')).result())\n"
    "print('ready', os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_program_killed_while_a_node_is_cut_off_ends_its_launch_within_seconds(
    slurm: SlurmTestCluster,
) -> None:
    # Slurm keeps a cancelled job COMPLETING while a node it cannot reach has not
    # confirmed; the launcher does not wait that out.
    import os
    import signal

    launch = subprocess.Popen(
        [sys.executable, "-m", "palatine", "launch", "--scheduler", "slurm", "--partition",
         PARTITION, "--start-timeout-in-sec", "120", "--hosts", "2", "--procs-per-host", "1",
         "--", sys.executable, "-c", CUT_THEN_KILLED],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert launch.stdout is not None
        program = 0
        for line in launch.stdout:
            if line.startswith("ready "):
                program = int(line.split()[1])
                break
        assert program, launch.stderr.read() if launch.stderr else ""
        slurm.bed.cut(1)
        killed_at = time.monotonic()
        os.kill(program, signal.SIGKILL)
        code = launch.wait(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        slurm.bed.heal(1)
        if launch.poll() is None:
            launch.kill()
            launch.wait(10)
    assert code == 137, code
    assert took < 10.0, took
    deadline = time.monotonic() + 60
    while slurm.squeue() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.squeue() == []
