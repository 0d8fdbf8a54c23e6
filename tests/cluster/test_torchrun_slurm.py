"""``palatine torchrun --scheduler slurm`` on the Slurm test cluster: a torchrun script on
2 nodes × 2 procs, one gloo group across the nodes, and the job gone afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm import _why, slurm  # noqa: F401 - the Slurm test cluster fixture

from palatine.testing.slurm import PARTITION, SlurmTestCluster

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(_why is not None, reason=f"no Slurm test cluster here: {_why}"),
]

SCRIPT = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print("node", os.environ["GROUP_RANK"], "local", os.environ["LOCAL_RANK"], "sum", t.item(),
      "netns", os.stat("/proc/self/ns/net").st_ino,
      "master", os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], flush=True)
dist.destroy_process_group()
"""


def test_a_torchrun_script_runs_on_two_slurm_nodes_as_one_group(
    slurm: SlurmTestCluster,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    # With torchrun's --master-addr/--master-port (a cluster whose nodes reach each other
    # on another interface than the one the hostname names): every rank is given them,
    # and rank 0's node hosts the store there.
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    master = slurm.bed.node_ip(0)
    done = subprocess.run(
        [sys.executable, "-m", "palatine", "torchrun", "--scheduler", "slurm", "--partition",
         PARTITION, "--start-timeout-in-sec", "120", "--nnodes", "2", "--nproc-per-node", "2",
         "--master-addr", master, "--master-port", "29533", str(script)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    lines = [ln.split("] ", 1)[1] for ln in done.stderr.splitlines() if " sum " in ln]
    seen = {tuple(ln.split()[1:4:2]): ln.split() for ln in lines}  # (node, local) -> words
    assert sorted(seen) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], done.stderr
    assert {words[5] for words in seen.values()} == {"6.0"}
    nets = {key: words[7] for key, words in seen.items()}
    assert nets[("0", "0")] == nets[("0", "1")] != nets[("1", "0")] == nets[("1", "1")]
    assert {tuple(words[9:11]) for words in seen.values()} == {(master, "29533")}
    assert slurm.squeue() == []
