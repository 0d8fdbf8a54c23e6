"""One-sided buffers (`palatine.rdma.RDMABuffer`): one actor's buffer read by 3 others on
this host, beside a memory copy in the same run (program shape: bench/_rdma_shape.py).

    python bench/rdma_bench.py [--only METRIC] [--reps N]

``PALATINE_BENCH_RDMA_BYTES`` sets the buffer's size (default 1 GiB; a smaller one for
quick runs: the metric's name stays, its ``bytes`` says what was read).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rdma_shape import run  # noqa: E402

import palatine  # noqa: E402
from palatine import Actor, endpoint, this_host  # noqa: E402
from palatine.rdma import RDMABuffer  # noqa: E402

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


if __name__ == "__main__":
    run(__doc__.splitlines()[0], "palatine", palatine.__version__, Peer, this_host, NBYTES)
