"""The pure pieces of `palatine.spmd` and ``palatine torchrun``, without processes: each
rank's variables, torchrun's flags, and the failure summary in torchrun's layout."""

from __future__ import annotations

import argparse
import os

import pytest

from palatine.cli import torchrun
from palatine.spmd.env import elastic_env
from palatine.spmd.launcher import ElasticResult, RankFailure
from palatine.spmd.summary import failure_summary


def test_the_last_dimension_is_a_nodes_ranks_and_the_rest_its_groups() -> None:
    env = elastic_env([("hosts", 2), ("replicas", 2), ("gpus", 4)], 13, "10.0.0.1", 29500, 2)
    assert env["RANK"] == "13" and env["WORLD_SIZE"] == "16"
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "4")
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "3" and env["GROUP_WORLD_SIZE"] == "4"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    with pytest.raises(ValueError, match="rank 16 is outside"):
        elastic_env([("gpus", 16)], 16, "h", 1)


def test_torchruns_flags_parse_in_both_spellings_and_the_rendezvous_ones_are_kept_aside() -> None:
    p = argparse.ArgumentParser()
    torchrun.add_arguments(p)
    args = p.parse_args(
        ["--nnodes", "1:2", "--nproc_per_node", "cpu", "--max-restarts", "3", "--rdzv_backend",
         "c10d", "-m", "pkg.train", "--lr", "0.1"]
    )  # fmt: skip
    assert torchrun._nnodes(args.nnodes) == 2
    assert torchrun.nproc_per_node(args.nproc_per_node) == len(os.sched_getaffinity(0))
    assert args.max_restarts == 3 and args.rdzv_backend == "c10d" and args.module
    assert (args.training_script, args.training_script_args) == ("pkg.train", ["--lr", "0.1"])
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="--nproc-per-node"):
            torchrun.nproc_per_node(bad)


def test_the_failure_summary_has_torchruns_layout_root_cause_last() -> None:
    killed = RankFailure(2, 0, "node1", 42, -9, "killed by signal 9 (SIGKILL)", proc="mesh0[2]")
    raised = RankFailure(1, 1, "node0", 41, 1, "RuntimeError: x", "Traceback...\nRuntimeError: x")
    text = failure_summary(ElasticResult(1, [killed, raised], 0, "train.py"))
    lines = text.splitlines()
    assert lines[0] == "=" * 60 and lines[1] == "train.py FAILED" and lines[-1] == "=" * 60
    other, root = text.index("Failures:\n[1]:"), text.index("Root Cause (first observed failure):")
    assert other < text.index("  rank      : 1 (local_rank: 1)") < root
    assert "  exitcode  : -9 (pid: 42) (SIGKILL)" in text[root:]
    assert "  traceback : killed by signal 9 (SIGKILL)" in text[root:]
    assert "  traceback : Traceback...\n  RuntimeError: x" in text[:root]
    assert failure_summary(ElasticResult(0, [], 0, "train.py")) == ""
