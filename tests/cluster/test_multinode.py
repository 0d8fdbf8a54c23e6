"""Hosts on other machines: each node of a namespace test bed runs a ``palatine host``;
the system, the controller and the client run in the root namespace and reach the nodes
over TCP on the bridge, as they would reach the machines of a cluster."""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator

import cloudpickle
import pytest

from palatine import inspect, remote
from palatine.tensor.client.local import connect
from palatine.tensor.client.procs import RoleProcess
from palatine.testing.netns import TestBed, unavailable

_why = unavailable()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(_why is not None, reason=f"no namespace test bed here: {_why}"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def net_namespace() -> int:
    """The inode of the calling process's network namespace (one per node)."""
    return os.stat("/proc/self/ns/net").st_ino


def ones_times(rank: object) -> object:
    import torch

    return torch.ones(2) * float(rank)  # type: ignore[arg-type]


@pytest.fixture
def bed() -> Iterator[TestBed]:
    b = TestBed(2)
    try:
        b.start()
    except RuntimeError as e:  # a container without the right to make namespaces
        pytest.skip(f"cannot make a namespace test bed here: {e}")
    try:
        yield b
    finally:
        b.close()
    assert b.leftovers() == []


def test_workers_on_two_nodes_run_calls_and_a_collective_across_the_nodes(bed: TestBed) -> None:
    token = secrets.token_hex(32)
    env = {"PALATINE_CLUSTER_TOKEN": token}
    roles: list[RoleProcess] = []
    try:
        system = RoleProcess(["system", "--system-addr", f"tcp:{bed.root_ip}:0"], env, 30)
        roles.append(system)
        assert system.addr.startswith(f"tcp:{bed.root_ip}:")
        for i in range(2):
            roles.append(
                RoleProcess(
                    [
                        "host",
                        "--system-addr",
                        system.addr,
                        "--host-world",
                        "hostworker",
                        "--host-rank",
                        str(i),
                    ],
                    {**env, "PALATINE_HOST_IP": bed.node_ip(i)},
                    60,
                    prefix=bed.prefix(i),
                )
            )
        roles.append(
            RoleProcess(
                [
                    "controller",
                    "--worker-world",
                    "worker",
                    "--system-addr",
                    system.addr,
                    "--world-size",
                    "4",
                    "--num-procs-per-host",
                    "2",
                    "--program",
                    f"{sys.executable} -m palatine worker",
                    "--is-cpu-worker",
                ],
                env,
                90,
            )
        )
        with connect(system.addr, "worker", timeout=90, _token=token) as mesh:
            where = remote(net_namespace)()
            seen = [inspect(where, shard={"host": h, "proc": p}) for h in (0, 1) for p in (0, 1)]
            # two procs on each node, each node its own namespace, none of them ours
            assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
            assert net_namespace() not in seen
            total = remote(ones_times)(mesh.rank(("host", "proc"))).reduce(
                ("host", "proc"), op="sum"
            )
            assert inspect(total, shard={"host": 1, "proc": 1}).tolist() == [6.0, 6.0]
    finally:
        for role in reversed(roles):
            role.kill()


def sleep_then(value: int) -> int:
    import time

    time.sleep(60)
    return value


def test_a_node_cut_off_fails_its_ranks_by_name_within_the_heartbeat_bound(bed: TestBed) -> None:
    import time

    from palatine import DeviceException, fetch

    token = secrets.token_hex(32)
    env = {"PALATINE_CLUSTER_TOKEN": token}
    update_timeout_s, interval_s = 3.0, 0.5
    roles: list[RoleProcess] = []
    try:
        system = RoleProcess(
            [
                "system",
                "--system-addr",
                f"tcp:{bed.root_ip}:0",
                "--supervision-update-timeout-in-sec",
                str(update_timeout_s),
            ],
            env,
            30,
        )
        roles.append(system)
        for i in range(2):
            roles.append(
                RoleProcess(
                    [
                        "host",
                        "--system-addr",
                        system.addr,
                        "--host-world",
                        "hostworker",
                        "--host-rank",
                        str(i),
                        "--supervision-update-interval-in-sec",
                        str(interval_s),
                    ],
                    {**env, "PALATINE_HOST_IP": bed.node_ip(i)},
                    60,
                    prefix=bed.prefix(i),
                )
            )
        roles.append(
            RoleProcess(
                [
                    "controller",
                    "--worker-world",
                    "worker",
                    "--system-addr",
                    system.addr,
                    "--world-size",
                    "4",
                    "--num-procs-per-host",
                    "2",
                    "--supervision-query-interval-in-sec",
                    str(interval_s),
                    "--program",
                    f"{sys.executable} -m palatine worker",
                    "--is-cpu-worker",
                ],
                env,
                90,
            )
        )
        with connect(system.addr, "worker", timeout=90, _token=token):
            assert inspect(remote(net_namespace)(), shard={"host": 1, "proc": 0}) > 0
            pending = fetch(remote(sleep_then)(7), shard={"host": 1, "proc": 0})
            cut_at = time.monotonic()
            bed.cut(1)
            with pytest.raises(DeviceException) as ei:
                pending.result(timeout=30)
            took = time.monotonic() - cut_at
            text = str(ei.value)
            assert "worker[2]" in text or "worker[3]" in text, text
            assert took < update_timeout_s + interval_s + 2.0, (took, text)
            print(f"link cut -> client error in {took:.2f} s: {text.splitlines()[0]}")
    finally:
        bed.heal(1)
        for role in reversed(roles):
            role.kill()
