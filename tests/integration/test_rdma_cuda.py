"""One-sided buffers of CUDA tensors: the owner's proc serves them through its buffer
server with a device copy, and a reader's CUDA destination is filled through a host
copy. Runs where a GPU is (one is enough: the procs share it)."""

from __future__ import annotations

import pytest
from user_scripts import run_script

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCRIPT = """
import torch
from palatine import Actor, endpoint, this_host
from palatine.rdma import RDMABuffer

class Owner(Actor):
    @endpoint
    def publish(self):
        self.w = torch.arange(1024, dtype=torch.float32, device="cuda")
        return RDMABuffer(self.w)

    @endpoint
    def head(self):
        return self.w[:4].tolist()

class Reader(Actor):
    @endpoint
    async def read(self, buf, device):
        dst = torch.zeros(buf.size() // 4, device=device)
        await buf.read_into(dst)
        return float(dst.sum()), dst.device.type

    @endpoint
    async def write(self, buf, device):
        await buf.write_from(torch.tensor([-1.0, -2.0], device=device), offset=8)

procs = this_host().spawn_procs(per_host={"procs": 2})
owner = procs.slice(procs=0).spawn("owner", Owner)
reader = procs.slice(procs=1).spawn("reader", Reader)
buf = owner.publish.call_one().get()
print("READ_CPU", reader.read.call_one(buf, "cpu").get())
print("READ_CUDA", reader.read.call_one(buf, "cuda").get())
reader.write.call_one(buf, "cuda").get()
print("HEAD", owner.head.call_one().get())
procs.stop().get()
"""


def test_a_cuda_buffer_is_read_into_cpu_and_cuda_tensors_and_written_from_one() -> None:
    out, _ = run_script(SCRIPT, timeout_s=170)
    assert out["READ_CPU"] == "(523776.0, 'cpu')"
    assert out["READ_CUDA"] == "(523776.0, 'cuda')"
    assert out["HEAD"] == "[0.0, 1.0, -1.0, -2.0]"
