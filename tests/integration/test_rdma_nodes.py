"""One-sided buffers between hosts: an owner proc on one node of a namespace test bed, a
reader on the other, over TCP and over TLS with a certificate per node. Each node has
its own network namespace, so the reader goes through the owner proc's buffer server
(not shared memory), as it would between two machines."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from conftest import bed_tls

from palatine import Actor, endpoint
from palatine.testing.bedroles import roles_on_bed
from palatine.testing.netns import TestBed, unavailable

_why = unavailable()
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(_why is not None, reason=f"no namespace test bed here: {_why}"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 1 << 20  # floats: 4 MiB


class Node(Actor):
    """Owns a tensor on its node, or reads and writes another node's."""

    @endpoint
    def publish(self) -> Any:
        import torch

        from palatine.rdma import RDMABuffer

        self.weights = torch.arange(N, dtype=torch.float32)
        return RDMABuffer(self.weights)

    @endpoint
    def head(self) -> list[float]:
        return self.weights[:4].tolist()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def read(self, buf: Any) -> tuple[float, float]:
        import torch

        dst = torch.empty(buf.size() // 4)
        await buf.read_into(dst)
        return float(dst.sum()), float(dst[N - 1])

    @endpoint
    async def write(self, buf: Any, values: list[float], offset: int) -> None:
        import torch

        await buf.write_from(torch.tensor(values), offset=offset)

    @endpoint
    async def read_failure(self, buf: Any) -> str:
        import torch

        try:
            await buf.read_into(torch.empty(buf.size() // 4), timeout=20)
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            return f"{type(e).__name__}: {e}"
        return "read"


@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_a_reader_on_another_node_reads_and_writes_through_the_owners_server_and_sees_its_death(
    bed: TestBed, transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from palatine.job.jobhosts import JobHosts

    pki = bed_tls(bed, tmp_path, monkeypatch) if transport == "tls" else None
    with roles_on_bed(bed, tls=pki, update_timeout_s=3.0, interval_s=0.5) as roles:
        hosts = JobHosts(roles.system_addr, roles.token, "hostworker", 2, sys.executable)
        try:
            nodes = hosts.spawn_procs({"procs": 1}).spawn("node", Node)
            owner, reader = nodes.slice(hosts=0, procs=0), nodes.slice(hosts=1, procs=0)
            buf = owner.publish.call_one().get()
            h = buf._handle
            assert (h.server_host, h.tls) == (bed.node_ip(0), transport == "tls")
            import torch

            expect = float(torch.arange(N, dtype=torch.float32).sum())
            assert reader.read.call_one(buf).get() == (expect, float(N - 1))
            reader.write.call_one(buf, [-1.0, -2.0], 8).get()
            assert owner.head.call_one().get() == [0.0, 1.0, -1.0, -2.0]

            pid = owner.pid.call_one().get()
            gone = os.pidfd_open(pid)  # readable once the whole process has exited
            os.kill(pid, signal.SIGKILL)
            assert select.select([gone], [], [], 10)[0], "the owner outlived SIGKILL by 10 s"
            what = reader.read_failure.call_one(buf).get()
            assert what.startswith("DeviceException: rdma read: the buffer's owner "), what
            assert f"(pid {pid})" in what and "[" in what, what
        finally:
            hosts.close()


def test_a_read_from_an_owner_whose_node_is_cut_off_fails_when_the_system_declares_it_dead(
    bed: TestBed,
) -> None:
    from palatine.job.jobhosts import JobHosts

    update_timeout_s, interval_s = 3.0, 0.5
    try:
        with roles_on_bed(bed, update_timeout_s=update_timeout_s, interval_s=interval_s) as roles:
            hosts = JobHosts(roles.system_addr, roles.token, "hostworker", 2, sys.executable)
            try:
                nodes = hosts.spawn_procs({"procs": 1}).spawn("node", Node)
                owner, reader = nodes.slice(hosts=1, procs=0), nodes.slice(hosts=0, procs=0)
                buf = owner.publish.call_one().get()
                reader.read.call_one(buf).get()  # the reader's proc now watches the owner's
                bed.cut(1)
                cut_at = time.monotonic()
                what = reader.read_failure.call_one(buf).get()
                took = time.monotonic() - cut_at
                assert what.startswith("DeviceException: rdma read: the buffer's owner "), what
                assert "declared dead" in what, what
                # the heartbeat bound, not the transfer's 20 s timeout
                assert took < update_timeout_s + interval_s + 3.0, (took, what)
            finally:
                hosts.close()
    finally:
        bed.heal(1)
