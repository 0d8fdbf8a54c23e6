"""Hosts on other machines: each node of a namespace test bed runs a ``palatine host``;
the system, the controller and the client run in the root namespace and reach the nodes
over TCP on the bridge, as they would reach the machines of a cluster."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
from conftest import bed_tls

from palatine import Actor, DeviceException, config, endpoint, fetch, inspect, remote
from palatine.tensor.client.local import connect
from palatine.tensor.client.mesh import DeviceMesh
from palatine.tensor.client.procs import RoleProcess
from palatine.testing.bedroles import roles_on_bed
from palatine.testing.netns import TestBed, unavailable

_why = unavailable()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(_why is not None, reason=f"no namespace test bed here: {_why}"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

UPDATE_TIMEOUT_S = 3.0  # the system's supervision update timeout in these tests
INTERVAL_S = 0.5  # the hosts' heartbeat interval and the controller's query interval


def net_namespace() -> int:
    """The inode of the calling process's network namespace (one per node)."""
    return os.stat("/proc/self/ns/net").st_ino


def ones_times(rank: object) -> object:
    import torch

    return torch.ones(2) * float(rank)  # type: ignore[arg-type]


def sleep_then(value: int) -> int:
    time.sleep(60)
    return value


@contextlib.contextmanager
def two_node_mesh(
    bed: TestBed, tls: dict[str, dict[str, str]] | None = None
) -> Iterator[DeviceMesh]:
    """System and controller here, one host per node, 2 worker procs on each node; over
    ``tls:`` with each machine's certificate variables when ``tls`` maps addresses to them
    (this process must have the root namespace's in its environment)."""
    with roles_on_bed(
        bed, per_host=2, tls=tls, update_timeout_s=UPDATE_TIMEOUT_S, interval_s=INTERVAL_S
    ) as roles:
        assert roles.system_addr.startswith(f"{'tls' if tls else 'tcp'}:{bed.root_ip}:")
        with connect(roles.system_addr, "worker", timeout_s=90, _token=roles.token) as mesh:
            yield mesh


def test_workers_on_two_nodes_run_calls_and_a_collective_across_the_nodes(bed: TestBed) -> None:
    with two_node_mesh(bed) as mesh:
        where = remote(net_namespace)()
        seen = [inspect(where, shard={"host": h, "proc": p}) for h in (0, 1) for p in (0, 1)]
        # two procs on each node, each node its own namespace, none of them ours
        assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
        assert net_namespace() not in seen
        total = remote(ones_times)(mesh.rank(("host", "proc"))).reduce(("host", "proc"), op="sum")
        assert inspect(total, shard={"host": 1, "proc": 1}).tolist() == [6.0, 6.0]


def test_a_node_cut_off_fails_its_ranks_by_name_within_the_heartbeat_bound(bed: TestBed) -> None:
    try:
        with two_node_mesh(bed):
            assert inspect(remote(net_namespace)(), shard={"host": 1, "proc": 0}) > 0
            pending = fetch(remote(sleep_then)(7), shard={"host": 1, "proc": 0})
            cut_at = time.monotonic()
            bed.cut(1)
            with pytest.raises(DeviceException) as ei:
                pending.result(timeout=30)
            took = time.monotonic() - cut_at
            text = str(ei.value)
            assert "worker[2]" in text or "worker[3]" in text, text
            assert f"addr tcp:{bed.node_ip(1)}:" in text, text
            assert took < UPDATE_TIMEOUT_S + INTERVAL_S + 2.0, (took, text)
            print(f"link cut -> client error in {took:.2f} s: {text.splitlines()[0]}")
    finally:
        bed.heal(1)


def _pids_in(namespace_inode: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "ns" / "net").stat().st_ino == namespace_inode:
                    pids.append(int(entry.name))
    return pids


def test_a_node_whose_processes_all_die_fails_its_ranks_at_once_naming_the_lost_host(
    bed: TestBed,
) -> None:
    with two_node_mesh(bed):
        node1 = inspect(remote(net_namespace)(), shard={"host": 1, "proc": 0})
        pending = fetch(remote(sleep_then)(7), shard={"host": 1, "proc": 1})
        victims = _pids_in(node1)
        assert len(victims) >= 3  # the host, its fork server and two workers at least
        killed_at = time.monotonic()
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with pytest.raises(DeviceException) as ei:
            pending.result(timeout=30)
        took = time.monotonic() - killed_at
        text = str(ei.value)
        assert "worker[2]" in text or "worker[3]" in text, text
        assert "hostworker[1]" in text, text  # nobody is left there to report a signal
        assert took < UPDATE_TIMEOUT_S + INTERVAL_S + 2.0, (took, text)
        print(f"node killed -> client error in {took:.2f} s: {text.splitlines()[0]}")


def _palatine_pids_in(namespace_inode: int) -> list[int]:
    out = []
    for pid in _pids_in(namespace_inode):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"palatine" in cmdline and b"slurm" not in cmdline:  # (not a test bed's slurmd)
                out.append(pid)
    return out


def test_a_node_that_comes_back_after_a_partition_is_told_to_stop_not_reused(
    bed: TestBed,
) -> None:
    from palatine.core import runtime

    with two_node_mesh(bed) as mesh:
        node1 = inspect(remote(net_namespace)(), shard={"host": 1, "proc": 0})
        assert len(_palatine_pids_in(node1)) >= 3  # host, fork server, two workers
        pending = fetch(remote(sleep_then)(7), shard={"host": 1, "proc": 0})
        bed.cut(1)
        try:
            with pytest.raises(DeviceException) as ei:
                pending.result(timeout=30)
        finally:
            bed.heal(1)
        healed_at = time.monotonic()
        first = str(ei.value).splitlines()[0]
        # The node's heartbeats reach the system again: its procs were declared lost, so
        # each is told to stop (the host stops its workers and exits), none is taken back.
        deadline = healed_at + 30
        while _palatine_pids_in(node1) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _palatine_pids_in(node1)
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
        took = time.monotonic() - healed_at
        client = mesh.session.system_client
        snap = runtime.submit(lambda: client.snapshot()).get(10)
        for world in snap.worlds.values():
            for proc, entry in world.procs.items():
                if entry.addr.startswith(f"tcp:{bed.node_ip(1)}:"):
                    assert entry.health != "Alive", (proc, entry)
        # The session stays failed with the same error: no call goes to the old node.
        with pytest.raises(DeviceException) as again:
            inspect(remote(net_namespace)(), shard={"host": 1, "proc": 0})
        assert str(again.value).splitlines()[0] == first
        print(f"node back after the cut: its processes stopped {took:.2f} s after the heal")


def test_over_tls_with_a_certificate_per_node_the_job_runs_and_a_stranger_is_refused(
    bed: TestBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("cryptography")
    from palatine.testing.certs import make_node_pki

    ips = [bed.root_ip, bed.node_ip(0), bed.node_ip(1)]
    pki = make_node_pki(tmp_path / "pki", ips)
    for key, value in pki[bed.root_ip].items():
        monkeypatch.setenv(key, value)
    with two_node_mesh(bed, tls=pki) as mesh:
        assert mesh.session.worker_world == "worker"
        where = remote(net_namespace)()
        seen = [inspect(where, shard={"host": h, "proc": 0}) for h in (0, 1)]
        assert seen[0] != seen[1]
        total = remote(ones_times)(mesh.rank(("host", "proc"))).reduce(("host", "proc"), op="sum")
        assert inspect(total, shard={"host": 0, "proc": 0}).tolist() == [6.0, 6.0]

    # a node whose certificate another CA signed cannot join: its host says why, at once
    strangers = make_node_pki(tmp_path / "other", ips, untrusted=(bed.node_ip(1),))
    env = {"PALATINE_CLUSTER_TOKEN": secrets.token_hex(32), **pki[bed.root_ip]}
    system = RoleProcess(["system", "--system-addr", f"tls:{bed.root_ip}:0"], env, 30)
    try:
        stranger_env = {**env, **strangers[bed.node_ip(1)], "PALATINE_HOST_IP": bed.node_ip(1)}
        stranger_env["PALATINE_TLS_CA"] = pki[bed.root_ip]["PALATINE_TLS_CA"]
        host = [
            "host",
            "--system-addr",
            system.addr,
            "--host-world",
            "hostworker",
            "--host-rank",
            "1",
        ]
        started = time.monotonic()
        with pytest.raises(RuntimeError) as ei:
            RoleProcess(host, stranger_env, 20, prefix=bed.prefix(1))
        took = time.monotonic() - started
        assert "does not accept our certificate" in str(ei.value), str(ei.value)[-2000:]
        assert took < 10, took  # refused at once, not after the join timeout
    finally:
        system.kill()


class Napper(Actor):
    """Answers at once, or after a long nap; says how many lanes its proc serves."""

    @endpoint
    def lanes(self) -> int:
        from palatine.core.proc import Proc

        return len(Proc.of(self.cx)._lanes)

    @endpoint
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_a_thread_waiting_on_a_lane_to_a_cut_off_node_fails_within_the_heartbeat_bound(
    bed: TestBed, transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from palatine.errors import PeerGoneError
    from palatine.job.jobhosts import JobHosts

    pki = bed_tls(bed, tmp_path, monkeypatch) if transport == "tls" else None
    with roles_on_bed(
        bed, tls=pki, update_timeout_s=UPDATE_TIMEOUT_S, interval_s=INTERVAL_S
    ) as roles:
        hosts = JobHosts(roles.system_addr, roles.token, "hostworker", 2, sys.executable)
        try:
            napper = hosts.spawn_procs({"procs": 1}).spawn("napper", Napper)
            far = napper.slice(hosts=1, procs=0)
            far.lanes.call_one().get()  # through the loop: the next calls may take a lane
            assert far.lanes.call_one().get() == 1  # this one came over a lane
            cutter = threading.Timer(0.3, bed.cut, (1,))
            cutter.start()
            t0 = time.monotonic()
            try:
                with pytest.raises(PeerGoneError) as ei:
                    far.nap.call_one(60).get()
            finally:
                cutter.join()
                bed.heal(1)
            took = time.monotonic() - t0 - 0.3
            assert "procs0[2]" in str(ei.value) or "procs0[1]" in str(ei.value), str(ei.value)
            assert took < UPDATE_TIMEOUT_S + INTERVAL_S + 1.5, (took, str(ei.value))
            print(f"{transport} lane, link cut -> caller's error in {took:.2f} s: {ei.value}")
        finally:
            hosts.close()


def say_where(rank: object) -> int:
    rank = int(rank)  # type: ignore[call-overload]  # (mesh.rank: a 0-dim tensor here)
    print("hello from a node", flush=True)
    print(f"only rank {rank} says this", flush=True)
    return rank


def test_prints_on_other_nodes_reach_the_client_aggregated(
    bed: TestBed, capfd: pytest.CaptureFixture[str]
) -> None:
    # The hosts run in other namespaces; what their workers print comes to this client
    # over the network (not through any host's console), identical lines shown once.
    # The window that merges identical lines is widened from half a second to five: a
    # loaded machine may run one rank's call that much later than the others'.
    with config.override(output_window_s=5.0), two_node_mesh(bed) as mesh:
        ranks = mesh.rank(("host", "proc"))
        # A fetch waits for every rank: all have made their rank tensor (torch imported),
        # so they print together, within the window that merges identical lines.
        inspect(ranks, shard=0)
        capfd.readouterr()
        inspect(remote(say_where)(ranks), shard={"host": 1, "proc": 1})
        seen = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen += capfd.readouterr().err
            if "[worker 0-3] hello from a node" in seen and "only rank 3 says" in seen:
                break
            time.sleep(0.1)
        assert "[worker 0-3] hello from a node" in seen, seen[-3000:]
        for r in range(4):
            assert f"[worker {r}] only rank {r} says this" in seen
        assert "[worker[" not in seen  # no host echoed them


# ------------------------------------------------------------ recovering from a partition


def sleep_on_node_1(rank: object) -> int:
    """A long call on the ranks of node 1 (2 and 3), a quick one on the others, so that
    the survivors are free for the calls that follow the recovery."""
    if int(rank) >= 2:  # type: ignore[call-overload]
        time.sleep(60)
    return int(rank)  # type: ignore[call-overload]


def _sum_of_ranks(mesh: DeviceMesh) -> list[float]:
    total = remote(ones_times)(mesh.rank(("host", "proc"))).reduce(("host", "proc"), op="sum")
    return list(fetch(total, shard={"host": 0, "proc": 0}).result(timeout=60).tolist())


@pytest.mark.parametrize("run", range(2))
def test_healing_a_partition_stops_the_old_incarnations_and_never_the_replacements(
    bed: TestBed, run: int
) -> None:
    with two_node_mesh(bed) as mesh:
        node0 = inspect(remote(net_namespace)(), shard={"host": 0, "proc": 0})
        node1 = inspect(remote(net_namespace)(), shard={"host": 1, "proc": 0})
        pending = fetch(
            remote(sleep_on_node_1)(mesh.rank(("host", "proc"))), shard={"host": 1, "proc": 0}
        )
        bed.cut(1)
        try:
            with pytest.raises(DeviceException):
                pending.result(timeout=30)
            rec = mesh.recover([2, 3], timeout_s=60)
            assert rec.ranks == [2, 3]
            moved = remote(net_namespace)()
            assert [inspect(moved, shard={"host": 1, "proc": p}) for p in (0, 1)] == [node0] * 2
        finally:
            bed.heal(1)
        healed_at = time.monotonic()
        # The old incarnations on node 1 heartbeat again: they, and only they, are told
        # to stop, and their host with them.
        deadline = healed_at + 30
        while _palatine_pids_in(node1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _palatine_pids_in(node1) == []
        # Well past the heal, the replacements still answer, and collectives span all four.
        time.sleep(3 * INTERVAL_S + 1.0)
        again = remote(net_namespace)()
        assert [inspect(again, shard={"host": 1, "proc": p}) for p in (0, 1)] == [node0] * 2
        assert _sum_of_ranks(mesh) == [6.0, 6.0]


@pytest.mark.parametrize("run", range(2))
def test_recover_called_at_once_after_a_partition_error_brings_back_every_rank_of_the_node(
    bed: TestBed, run: int
) -> None:
    with two_node_mesh(bed) as mesh:
        node0 = inspect(remote(net_namespace)(), shard={"host": 0, "proc": 0})
        rank3 = inspect(remote(os.getpid)(), shard={"host": 1, "proc": 1})
        # Rank 3 falls silent first, then its node is cut off: the first error names rank
        # 3 alone, and recover() is called while the system has rank 2 and node 1's host
        # still alive; they are declared lost a moment later, while it runs.
        os.kill(rank3, signal.SIGSTOP)
        time.sleep(1.0)
        pending = fetch(remote(sleep_on_node_1)(mesh.rank(("host", "proc"))), shard=3)
        bed.cut(1)
        try:
            with pytest.raises(DeviceException) as ei:
                pending.result(timeout=30)
            assert "worker[3]" in str(ei.value).splitlines()[0], str(ei.value)
            t0 = time.monotonic()
            rec = mesh.recover(timeout_s=60)
            took = time.monotonic() - t0
        finally:
            bed.heal(1)
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank3, signal.SIGKILL)
        # Every rank of the cut node comes back in this one call, within the liveness
        # bound, never after the world's eviction.
        assert rec.ranks == [2, 3], rec
        assert took < UPDATE_TIMEOUT_S + 5.0, took
        moved = remote(net_namespace)()
        assert [inspect(moved, shard={"host": 1, "proc": p}) for p in (0, 1)] == [node0] * 2
        assert _sum_of_ranks(mesh) == [6.0, 6.0]


def test_survivors_waiting_in_palatines_reduce_for_a_cut_off_node_fail_at_the_bound_and_go_on(
    bed: TestBed,
) -> None:
    with two_node_mesh(bed) as mesh:
        ranks = mesh.rank(("host", "proc"))
        v = remote(ones_times)(ranks)
        assert _sum_of_ranks(mesh) == [6.0, 6.0]
        remote(sleep_on_node_1)(ranks)  # node 1's ranks stay busy: the others wait for them
        total = v.reduce(("host", "proc"), op="sum")
        futs = [fetch(total, shard={"host": 0, "proc": p}) for p in (0, 1)]
        time.sleep(0.5)
        bed.cut(1)
        cut_at = time.monotonic()
        try:
            for f in futs:  # (not the collective timeout: palatine's reduce ends at once)
                with pytest.raises(DeviceException) as ei:
                    f.result(timeout=60)
                assert "worker[2]" in str(ei.value) or "worker[3]" in str(ei.value)
            took = time.monotonic() - cut_at
            assert took < UPDATE_TIMEOUT_S + INTERVAL_S + 2.0, took
            rec = mesh.recover(timeout_s=60)
        finally:
            bed.heal(1)
        assert rec.ranks == [2, 3], rec
        v.restore(ones_times, mesh.rank(("host", "proc")))
        total = v.reduce(("host", "proc"), op="sum")
        assert fetch(total, shard={"host": 0, "proc": 0}).result(timeout=30).tolist() == [6.0, 6.0]
