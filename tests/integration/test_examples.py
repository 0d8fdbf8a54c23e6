"""The examples in ``examples/`` run as a user runs them, and print what they say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str) -> list[str]:
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=100, env=env
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout.splitlines()


def test_ping_pong_between_two_meshes_with_call_backs() -> None:
    assert run_example("ping_pong.py") == ["pong 0 after 1 volley", "pong 1 after 1 volley"]


def test_trainers_fed_by_dataloaders_learn_the_line() -> None:
    lines = run_example("trainer_dataloader.py")
    assert lines[0].startswith("step 0: summed loss ")
    final = float(lines[-2].removeprefix("final summed loss "))
    assert final < 0.01
    assert lines[-1] == "weights: [(3.0, 1.0), (3.0, 1.0)]"


def test_accumulator_ports_and_channels() -> None:
    assert run_example("accumulator.py") == [
        "sum after incr(1): 10",
        "sum after incr(1): 20",
        "reports: [(0, 2), (1, 4), (2, 6), (3, 8)]",
        "got: first item",
    ]


def test_the_basic_actor_example() -> None:
    lines = run_example("actors.py")
    assert lines[0] == "call: [1, 1, 1, 1]"
    assert lines[-1] == "stopped"


def test_mesh_tensors_reduce_over_dp_and_hand_activations_to_the_next_pipeline_stage() -> None:
    assert run_example("mesh_tensors.py") == [
        "x at dp=1, pp=0: [20.0, 21.0, 22.0, 23.0]",
        "sum over dp at pp=0: [20.0, 22.0, 24.0, 26.0]",
        "sum over dp at pp=1: [40.0, 42.0, 44.0, 46.0]",
        "stage 1 output at dp=0: [0.0, 0.0, 0.0, 0.0]",
        "stage 1 output at dp=1: [18.0, 20.0, 22.0, 24.0]",
    ]


def test_a_two_stage_pipeline_trains_with_gradients_coming_back_across_meshes() -> None:
    assert run_example("pipeline.py") == ["loss fell: True", "replicas identical: True"]


def test_the_demos_console_shows_its_own_lines_and_nothing_internal() -> None:
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    env.pop("PALATINE_LOG_LEVEL", None)
    out = subprocess.run(
        [sys.executable, "-m", "palatine", "demo", "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.splitlines()[-1] == "replicas identical on 4/4 ranks"
    # nothing palatine says for itself at INFO, no ready lines, nothing at all on stderr
    assert out.stderr == "", out.stderr[-3000:]


def test_the_torch_style_demo_trains_to_the_same_held_out_loss_as_the_function_style() -> None:
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    held = {}
    for style in ("function", "torch"):
        out = subprocess.run(
            [sys.executable, "-m", "palatine", "demo", "--steps", "40", "--style", style],
            capture_output=True,
            text=True,
            timeout=100,
            env=env,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        lines = out.stdout.splitlines()
        assert lines[-1] == "replicas identical on 4/4 ranks", lines
        assert f"{style} style" in " ".join(lines[:2])
        held[style] = next(x for x in lines if x.startswith("loss ")).split("(held-out ")[1]
    assert held["torch"] == held["function"]


def test_generators_pull_the_trainers_weights_as_rdma_buffers_each_step() -> None:
    lines = run_example("weight_sync.py")
    assert len(lines) == 6, lines
    losses = [float(line.split("loss ")[1].split(";")[0]) for line in lines[:5]]
    assert losses == sorted(losses, reverse=True)
    assert all(line.endswith("3 generators match the trainer: True") for line in lines[:5])
    assert lines[-1] == "each pull: 4 buffers, 388 bytes"
