"""torchrun's environment across machines: a proc mesh over the two nodes of a namespace
test bed (one ``palatine host`` in each node's namespace, the system and this client in
the root namespace) gets ``MASTER_ADDR`` on node 0's address, and a gloo group of its 4
ranks works across the nodes, from actors and from a script run as torchrun would."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle
import pytest

from palatine import Actor, endpoint
from palatine.testing.bedroles import roles_on_bed
from palatine.testing.netns import TestBed, unavailable

_why = unavailable()
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(_why is not None, reason=f"no namespace test bed here: {_why}"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Trainer(Actor):
    @endpoint
    def all_reduce(self) -> tuple[str, str, float]:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env://
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        netns = str(os.stat("/proc/self/ns/net").st_ino)
        return os.environ["MASTER_ADDR"], netns, t.item()


SCRIPT = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
assert t.item() == 6.0, t
print("node", os.environ["GROUP_RANK"], "local", os.environ["LOCAL_RANK"], "sum", t.item())
dist.destroy_process_group()
"""


def test_actors_on_two_nodes_init_one_gloo_group_from_env_with_node_0_as_master(
    bed: TestBed,
) -> None:
    from palatine.job.jobhosts import JobHosts
    from palatine.spmd import setup_torch_elastic_env

    with roles_on_bed(bed) as roles:
        hosts = JobHosts(roles.system_addr, roles.token, "hostworker", 2, sys.executable)
        try:
            procs = hosts.spawn_procs({"procs": 2})
            setup_torch_elastic_env(procs)
            seen = procs.spawn("trainer", Trainer).all_reduce.call().get().values()
        finally:
            hosts.close()
    assert {addr for addr, _, _ in seen} == {bed.node_ip(0)}
    assert [total for _, _, total in seen] == [10.0] * 4
    nets = [net for _, net, _ in seen]
    assert nets[0] == nets[1] != nets[2] == nets[3]  # two ranks on each node


def test_a_torchrun_script_runs_on_two_nodes_by_the_launcher(bed: TestBed, tmp_path: Path) -> None:
    from palatine.job.jobhosts import JobHosts
    from palatine.spmd.launcher import launch

    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    said: list[str] = []
    with roles_on_bed(bed) as roles:
        hosts = JobHosts(roles.system_addr, roles.token, "hostworker", 2, sys.executable)
        try:
            result = launch([str(script)], hosts, {"procs": 2}, say=said.append)
        finally:
            hosts.close()
    assert result.status == 0, (said, result.failures)
    assert result.failures == [] and result.restarts == 0
