"""What a CPU tensor worker imports, and when: torch on first use.

A CPU worker reports ready without importing torch (about 1.6 s of CPU each); the first
command that needs it imports it on its stream and gets the right result. Worker-side
helpers (``palatine.tensor.worker.functions``) never pull the client package into a worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import cloudpickle
import pytest

from palatine import fetch, local_mesh, remote
from palatine.tensor.client.mesh import DeviceMesh

pytestmark = pytest.mark.timeout(120)

# Workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

IDENTITY = "palatine.tensor.worker.functions.identity"
GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def loaded(names: list[str]) -> list[bool]:
    import sys

    return [name in sys.modules for name in names]


def total(t: object) -> float:
    return float(t.sum())  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    m = local_mesh(hosts=1, procs_per_host=2, startup_timeout_s=60, device="cpu")
    try:
        yield m
    finally:
        m.shutdown()


def test_torch_is_imported_on_first_use_and_the_client_never(mesh: DeviceMesh) -> None:
    watched = ["torch", "palatine.tensor.client"]
    with mesh.activate():
        assert fetch(remote(IDENTITY)(7), shard=1).result(timeout=30) == 7
        assert fetch(remote(loaded)(watched), shard=0).result(timeout=30) == [False, False]
        ones = remote("torch.ones")(3)  # the first command that needs torch imports it
        assert fetch(remote(total)(ones), shard=1).result(timeout=60) == 3.0
        x = fetch(ones, shard=0).result(timeout=30)
        assert x.tolist() == [1.0, 1.0, 1.0]
        assert fetch(remote(loaded)(watched), shard=0).result(timeout=30) == [True, False]


@pytest.mark.skipif(
    any(os.path.exists(p) for p in GPU_NODES), reason="this machine has a GPU driver"
)
def test_local_mesh_checks_for_a_gpu_without_importing_torch() -> None:
    code = (
        "import sys; from palatine.tensor.client.local import want_cuda; "
        "print(want_cuda('auto'), want_cuda('cpu'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]
