"""``palatine stacks`` against a running local mesh: the stacks of every worker,
identical ones grouped under their ranks, a known function in them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import cloudpickle
import pytest

from palatine import local_mesh, remote
from palatine.cli.stacks import group_stacks, rank_ranges

pytestmark = pytest.mark.timeout(120)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def spin_in_a_known_place(seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)
    return 0


def stacks(addr: str, token: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "palatine", "stacks", "--system-addr", addr, *extra],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PALATINE_CLUSTER_TOKEN": token},
    )  # fmt: skip


def test_stacks_of_a_running_mesh_are_grouped_by_rank_and_show_the_running_function() -> None:
    with local_mesh(1, 3) as mesh:
        cluster = mesh._local
        assert cluster is not None
        token = cluster.env["PALATINE_CLUSTER_TOKEN"]
        with mesh.activate():
            remote(spin_in_a_known_place)(6.0)
            time.sleep(0.5)  # it is running on every rank
            every = stacks(cluster.system_addr, token, "--world", "worker")
            one = stacks(cluster.system_addr, token, "--world", "worker", "--rank", "1")
            wrong = stacks(cluster.system_addr, "0" * 64, "--world", "worker")
    assert every.returncode == 0, every.stderr
    assert every.stdout.startswith("=== ranks 0-2 of worker (3 procs)\n"), every.stdout
    assert every.stdout.count("=== ") == 1, every.stdout
    # (faulthandler's "in f", or py-spy's "f (file:line)" where py-spy is installed)
    assert re.search(r"in spin_in_a_known_place|spin_in_a_known_place \(", every.stdout)
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("=== rank 1 of worker (1 proc)\n"), one.stdout
    assert wrong.returncode == 1
    assert "authentication failed" in wrong.stderr, wrong.stderr


def test_rank_ranges_and_grouping_ignore_addresses() -> None:
    assert rank_ranges([5, 0, 2, 1]) == "0-2,5"
    assert rank_ranges([3]) == "3"
    groups = group_stacks(
        {
            "w[0]": "Thread 0x7f01 (most recent call first):\n  f",
            "w[1]": "Thread 0x7f99 (most recent call first):\n  f",
            "w[2]": "Thread 0x7f01 (most recent call first):\n  g",
        }
    )
    assert [procs for procs, _ in groups] == [["w[0]", "w[1]"], ["w[2]"]]
