"""`palatine.spmd` on real OS processes: torchrun's environment on every proc of a mesh,
so ``init_process_group`` from ``env://`` works in actors, and programs run as
``__main__`` on every rank with their exit statuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from user_scripts import run_script

pytestmark = pytest.mark.timeout(120)


ENV_AND_GLOO = """
    import os
    from palatine import Actor, endpoint, this_host
    from palatine.spmd import setup_torch_elastic_env

    class Trainer(Actor):
        @endpoint
        def env(self):
            keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "NODE_RANK", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"]
            return {k: os.environ[k] for k in keys}

        @endpoint
        def all_reduce(self):
            import torch
            import torch.distributed as dist
            dist.init_process_group("gloo")  # env://
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            dist.destroy_process_group()
            return t.item()

    procs = this_host().spawn_procs(per_host={"nodes": 2, "gpus": 2})
    setup_torch_elastic_env(procs, restart_count=3)
    trainers = procs.spawn("trainer", Trainer)
    envs = trainers.env.call().get().values()
    for e in envs:
        print("ENV" + e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"],
              e["GROUP_RANK"], e["NODE_RANK"], e["TORCHELASTIC_RESTART_COUNT"])
    print("MASTERS", len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}),
          envs[0]["MASTER_ADDR"])
    print("SUMS", trainers.all_reduce.call().get().values())
    procs.stop().get()
"""


def test_setup_torch_elastic_env_lets_actors_init_a_gloo_group_from_env() -> None:
    out, err = run_script(ENV_AND_GLOO)
    assert out["SUMS"] == "[10.0, 10.0, 10.0, 10.0]", err[-3000:]
    assert out["MASTERS"] == "1 127.0.0.1"  # one rendezvous for all, on this machine
    # ENV<RANK> LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK RESTART_COUNT: the
    # mesh's last dimension is the local one (the procs of one node)
    assert [out[f"ENV{r}"] for r in range(4)] == [
        "0 4 2 0 0 3",
        "1 4 2 0 0 3",
        "0 4 2 1 1 3",
        "1 4 2 1 1 3",
    ]


PROGRAMS = """
    import os, sys
    from palatine import this_host
    from palatine.spmd import SPMDActor, ScriptFailed

    here = os.environ["SPMD_TEST_DIR"]
    os.chdir(here)  # (-m finds modules in the current directory, as python -m does)
    procs = this_host().spawn_procs(per_host={"gpus": 3})
    for name, program in [
        ("SCRIPT", [os.path.join(here, "train.py"), "--lr", "0.5"]),
        ("MODULE", ["-m", "train", "--lr", "0.25"]),
        ("FUNCTION", ["train:main", "x"]),
    ]:
        actors = procs.spawn(name.lower(), SPMDActor)
        addr, port = actors.slice(gpus=0).get_host_port.call_one().get()
        statuses = actors.main.call(addr, port, program).get().values()
        print(name, [s if isinstance(s, int) else s.first_line for s in statuses])
    procs.stop().get()
"""

TRAIN = """
import os, sys
import torch.distributed as dist

def main():
    rank = int(os.environ["RANK"])
    if rank == 2:
        raise ValueError(f"rank {rank} fails with {sys.argv[1:]}")
    return rank  # rank 1 exits with 1

if __name__ == "__main__":
    dist.init_process_group("gloo")
    dist.barrier()
    print(f"main {os.environ['RANK']} {sys.argv}", flush=True)
    dist.destroy_process_group()
    sys.exit(int(os.environ["RANK"]) * 3)
"""


def test_spmd_actor_runs_a_script_a_module_or_a_function_with_argv_and_gives_each_exit_status(
    tmp_path: Path,
) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    out, err = run_script(PROGRAMS, env={"SPMD_TEST_DIR": str(tmp_path)})
    assert out["SCRIPT"] == "[0, 3, 6]", err[-3000:]
    assert out["MODULE"] == "[0, 3, 6]"
    assert out["FUNCTION"] == "[0, 1, \"ValueError: rank 2 fails with ['x']\"]"
    script = tmp_path / "train.py"
    assert f"main 2 ['{script}', '--lr', '0.5']" in err
    assert f"main 1 ['{script}', '--lr', '0.25']" in err  # (-m: argv[0] is its file)
    assert "ValueError: rank 2 fails" in err  # its traceback, as Python prints it
