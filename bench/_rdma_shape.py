"""The one-sided buffer benchmark's program shape, shared by palatine and Monarch (same API).

`run` is called by bench/rdma_bench.py (palatine) and bench/peers/monarch_rdma.py
(torchmonarch) with their own ``Peer`` actor, ``this_host`` and a size. Metrics:

* ``rdma_read_1GiB_GBps``: a 4-proc mesh on this host; the actor on proc 0 publishes a
  CPU tensor of ``nbytes`` as an ``RDMABuffer``; the other 3 each read it whole into a
  tensor of their own (allocated and touched once), all at once; the value is the
  bytes read by the 3 over the wall time of the round (GB/s, median over reps), and
  ``per_reader_GBps`` the median of what each reader timed for its own read. The first
  round (which maps or connects) is a warm-up, reported as ``first_round_GBps``.
* ``memcpy_GBps``: one thread copying ``nbytes`` between two touched tensors in this
  process (``ctypes.memmove``), the reference for the goal "≥ 0.5 of memcpy".
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from _common import parse_args, run_metric

READERS = 3


def run(description: str, impl: str, version: str, peer: Any, this_host: Any, nbytes: int) -> None:
    """Measure both metrics for one framework (its ``Peer`` actor: ``publish(nbytes)`` on the
    owner returns a buffer, ``prepare(nbytes)`` and ``read(buf)`` (seconds) on readers)."""
    args = parse_args(description)

    def rdma() -> tuple[list[float], dict[str, Any]]:
        procs = this_host().spawn_procs(per_host={"procs": 1 + READERS})
        try:
            peers = procs.spawn("peer", peer)
            owner = peers.slice(procs=0)
            readers = peers.slice(procs=slice(1, 1 + READERS))
            buf = owner.publish.call_one(nbytes).get()
            readers.prepare.call(nbytes).get()
            t0 = time.perf_counter()
            readers.read.call(buf).get()
            first = READERS * nbytes / (time.perf_counter() - t0) / 1e9
            reps, each = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                took = list(readers.read.call(buf).get().values())
                reps.append(READERS * nbytes / (time.perf_counter() - t0) / 1e9)
                each += [nbytes / s / 1e9 for s in took]
            each.sort()
            return reps, {
                "bytes": nbytes,
                "readers": READERS,
                "per_reader_GBps": each[len(each) // 2],
                "first_round_GBps": first,
            }
        finally:
            procs.stop().get()

    def memcpy() -> tuple[list[float], dict[str, Any]]:
        src = bytearray(b"\x01") * nbytes
        dst = bytearray(nbytes)
        a = ctypes.addressof(ctypes.c_char.from_buffer(src))
        b = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        ctypes.memmove(b, a, nbytes)
        reps = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            ctypes.memmove(b, a, nbytes)
            reps.append(nbytes / (time.perf_counter() - t0) / 1e9)
        return reps, {"bytes": nbytes}

    run_metric(args, "rdma_read_1GiB_GBps", impl, "GB/s", True, version, rdma)
    run_metric(args, "memcpy_GBps", impl, "GB/s", True, version, memcpy)
