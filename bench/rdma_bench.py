"""One-sided buffers (`palatine.rdma.RDMABuffer`): one actor's buffer read by 3 others on
this host, beside a memory copy in the same run (program shape: bench/_rdma_shape.py).

    python bench/rdma_bench.py [--only METRIC] [--reps N]

``PALATINE_BENCH_RDMA_BYTES`` sets the buffer's size (default 1 GiB; a smaller one for
quick runs: the metric's name stays, its ``bytes`` says what was read).

Across the nodes of a namespace test bed (needs root, as bench/cross_node.py):
``cross_node_rdma_read_64MiB_GBps`` and ``cross_node_rdma_read_64MiB_tls_GBps``, the
owner on one node and one reader on the other reading 64 MiB through the owner proc's
buffer server (the goal: at least ``cross_node_fetch_64MiB_GBps``, which each of them
measures again on the same test bed, each fetch paired with a read: ``fetch_64MiB_GBps``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_args, run_metric  # noqa: E402
from _rdma_shape import run  # noqa: E402

import palatine  # noqa: E402
from palatine import Actor, endpoint, this_host  # noqa: E402
from palatine.rdma import RDMABuffer  # noqa: E402
from palatine.testing.netns import TestBed, unavailable  # noqa: E402

NBYTES = int(os.environ.get("PALATINE_BENCH_RDMA_BYTES", str(1 << 30)))


class Peer(Actor):
    """The owner publishes a tensor; a reader reads it into a tensor of its own."""

    @endpoint
    async def publish(self, nbytes: int) -> RDMABuffer:
        self.data = torch.ones(nbytes, dtype=torch.uint8)
        return RDMABuffer(self.data)

    @endpoint
    async def prepare(self, nbytes: int) -> None:
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        ctypes.memset(self.dst.data_ptr(), 0, nbytes)  # touch every page

    @endpoint
    async def read(self, buf: RDMABuffer) -> float:
        t0 = time.perf_counter()
        await buf.read_into(self.dst)
        return time.perf_counter() - t0


CROSS_BYTES = 64 << 20
CROSS_METRICS = ("cross_node_rdma_read_64MiB_GBps", "cross_node_rdma_read_64MiB_tls_GBps")


@contextlib.contextmanager
def _bed() -> Iterator[TestBed]:
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"no namespace test bed here: {why}")
    bed = TestBed(2)
    bed.start()
    try:
        yield bed
    finally:
        bed.close()


def cross_node(args: Any, tls: bool) -> tuple[list[float], dict[str, Any]]:
    """The owner on node 1, a reader on node 0: 64 MiB read whole, ``args.reps`` times.
    Each read is paired with bench/cross_node.py's 64 MiB fetch from a worker of node 1
    by the client here (the goal's reference), on the same test bed and roles, one right
    after the other, so both see the same load; the fetches' median is reported as
    ``fetch_64MiB_GBps``, with the ratio to it."""
    from cross_node import make_tensor

    from palatine import fetch, remote
    from palatine.job.jobhosts import JobHosts
    from palatine.tensor.client.local import connect
    from palatine.testing.bedroles import roles_on_bed
    from palatine.testing.certs import make_node_pki

    reps, fetched = [], []
    with _bed() as bed, tempfile.TemporaryDirectory() as d:
        pki = None
        env: dict[str, str] = {}
        if tls:
            pki = make_node_pki(d, [bed.root_ip, bed.node_ip(0), bed.node_ip(1)])
            env = pki[bed.root_ip]
        with patch.dict(os.environ, env), roles_on_bed(bed, per_host=1, tls=pki) as roles:
            hosts = JobHosts(roles.system_addr, roles.token, "hostworker", 2, sys.executable)
            try:
                with connect(roles.system_addr, "worker", timeout_s=90, _token=roles.token):
                    value = remote(make_tensor)(CROSS_BYTES)
                    where = {"host": 1, "proc": 0}
                    fetch(value, shard=where).result()  # warm
                    peers = hosts.spawn_procs({"procs": 1}).spawn("peer", Peer)
                    owner, reader = peers.slice(hosts=1, procs=0), peers.slice(hosts=0, procs=0)
                    buf = owner.publish.call_one(CROSS_BYTES).get()
                    reader.prepare.call_one(CROSS_BYTES).get()
                    reader.read.call_one(buf).get()  # warm: connected
                    for _ in range(args.reps):
                        reps.append(CROSS_BYTES / reader.read.call_one(buf).get() / 1e9)
                        t0 = time.perf_counter()
                        fetch(value, shard=where).result()
                        fetched.append(CROSS_BYTES / (time.perf_counter() - t0) / 1e9)
            finally:
                hosts.close()
    fetch_median = sorted(fetched)[len(fetched) // 2]
    return reps, {
        "bytes": CROSS_BYTES,
        "fetch_64MiB_GBps": fetch_median,
        "ratio_to_fetch": round(sorted(reps)[len(reps) // 2] / fetch_median, 3),
    }


def main() -> None:
    description = __doc__.splitlines()[0]
    args = parse_args(description)
    if not args.only or args.only - set(CROSS_METRICS):
        run(description, "palatine", palatine.__version__, Peer, this_host, NBYTES)
    for metric, tls in zip(CROSS_METRICS, (False, True), strict=True):
        run_metric(args, metric, "palatine", "GB/s", True, palatine.__version__,
                   lambda tls=tls: cross_node(args, tls))  # fmt: skip


if __name__ == "__main__":
    main()
