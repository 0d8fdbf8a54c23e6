"""``palatine top --once`` into a pipe: the whole table, whatever its width, and the CPU
of a busy worker as it is (a first reading alone would say 0%)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import cloudpickle
import pytest

from palatine import local_mesh, remote

pytestmark = pytest.mark.timeout(120)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def spin_for_a_long_while(seconds: float) -> float:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return seconds


def test_top_once_in_a_pipe_prints_whole_rows_and_a_spinning_workers_cpu() -> None:
    with local_mesh(1, 1) as mesh:
        cluster = mesh._local
        assert cluster is not None
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        env["PALATINE_CLUSTER_TOKEN"] = cluster.env["PALATINE_CLUSTER_TOKEN"]
        with mesh.activate():
            busy = remote(spin_for_a_long_while)(8.0)
            deadline = time.monotonic() + 6
            text = ""
            while time.monotonic() < deadline:  # until the heartbeat says what it runs
                once = subprocess.run(
                    [sys.executable, "-m", "palatine", "top", "--system-addr",
                     str(cluster.system_addr), "--world", "worker", "--once"],
                    env=env, capture_output=True, text=True, timeout=60, check=False,
                )  # fmt: skip
                assert once.returncode == 0, once.stderr
                text = once.stdout
                if "spin_for_a_long_while" in text:
                    break
            del busy
        rows = [line for line in text.splitlines() if "worker[0]" in line]
        assert len(rows) == 1, text
        assert "…" not in text, text  # no cell cut to 80 columns
        assert "spin_for_a_long_while" in rows[0], text
        cpu = re.search(r"\s(\d+)%\s", rows[0])
        assert cpu is not None and int(cpu.group(1)) >= 30, text
