"""One-sided buffers for Monarch (``torchmonarch``'s ``RDMABuffer``), the shape of
bench/rdma_bench.py (bench/_rdma_shape.py) at 64 MiB: without ibverbs hardware Monarch
falls back to TCP, and 1 GiB would take minutes.

    bench/.peers-venv/bin/python bench/peers/monarch_rdma.py [--only METRIC] [--reps N]

``PALATINE_BENCH_MONARCH_RDMA_BYTES`` sets the size (default 64 MiB).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import monarch  # noqa: E402
from _rdma_shape import run  # noqa: E402
from monarch.actor import Actor, endpoint, this_host  # noqa: E402
from monarch.rdma import RDMABuffer  # noqa: E402

IMPL = "torchmonarch"
VERSION = metadata.version("torchmonarch")
NBYTES = int(os.environ.get("PALATINE_BENCH_MONARCH_RDMA_BYTES", str(64 << 20)))


def _allow_tcp() -> None:
    """Monarch's TCP fallback, in whichever process makes or reads buffers."""
    configure = getattr(monarch, "configure", None)
    if configure is not None:
        try:
            configure(rdma_allow_tcp_fallback=True)
        except TypeError:
            pass
    warnings.simplefilter("ignore")


class Peer(Actor):
    @endpoint
    async def publish(self, nbytes: int) -> Any:
        _allow_tcp()
        self.data = torch.ones(nbytes, dtype=torch.uint8)
        return RDMABuffer(self.data)

    @endpoint
    async def prepare(self, nbytes: int) -> None:
        _allow_tcp()
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        ctypes.memset(self.dst.data_ptr(), 0, nbytes)

    @endpoint
    async def read(self, buf: Any) -> float:
        t0 = time.perf_counter()
        await buf.read_into(self.dst)
        return time.perf_counter() - t0


if __name__ == "__main__":
    _allow_tcp()
    run(__doc__.splitlines()[0], IMPL, VERSION, Peer, this_host, NBYTES)
