"""Worker-side objects on real workers: `OpaqueRef` and `remote_autograd_function`.

One 2 × 2 local mesh (dims ``host`` and ``proc``, ranks 0-3) serves every test. Whether
a worker-side object was freed is seen from a finalizer that touches a file.
"""

from __future__ import annotations

import gc
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
from meshes import module_mesh

from palatine import Tensor, inspect, remote
from palatine.tensor.client.autograd_function import remote_autograd_function
from palatine.tensor.client.mesh import DeviceMesh
from palatine.tensor.worker.opaque import OpaqueRef

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])

SHARDS = [{"host": h, "proc": p} for h in (0, 1) for p in (0, 1)]


mesh = module_mesh(2, 2)


def eventually(mesh: DeviceMesh, cond: Callable[[], bool], what: str) -> None:
    """Until ``cond()``; each try first makes a round trip, which sends what is queued
    (drops included)."""
    deadline = time.monotonic() + 20
    with mesh.activate():
        while not cond():
            assert time.monotonic() < deadline, what
            inspect(torch.zeros(1))
            time.sleep(0.05)


def files(where: Path) -> int:
    return len(list(where.iterdir()))


class Counter:
    def __init__(self, start: int) -> None:
        self.n = start


class Tracked:
    """An object whose end on a worker touches a new file in ``where``."""

    def __init__(self, where: str) -> None:
        weakref.finalize(self, Path(where, uuid.uuid4().hex).touch)


def make_counter(start: Any) -> OpaqueRef:
    return OpaqueRef(Counter(int(start)))


def bump(ref: OpaqueRef, by: int) -> None:
    ref.value.n += by


def read(ref: OpaqueRef) -> int:
    return int(ref.value.n)


def make_tracked(where: str) -> OpaqueRef:
    return OpaqueRef(Tracked(where))


# ------------------------------------------------------------------ OpaqueRef


def test_an_opaque_ref_made_on_the_workers_is_mutated_by_one_function_and_read_by_another(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        rank = mesh.rank(("host", "proc"))
        ref = remote(make_counter, propagate=lambda start: OpaqueRef())(rank)
        assert isinstance(ref, OpaqueRef) and isinstance(ref.key, Tensor)
        remote(bump, propagate=lambda ref, by: None)(ref, 10)
        counts = remote(read)(ref)
        assert [inspect(counts, **s) for s in SHARDS] == [10, 11, 12, 13]
        copy = inspect(ref, host=1, proc=0)  # a copy of one rank's box, value included
        assert isinstance(copy, OpaqueRef) and copy.value.n == 12
        with pytest.raises(TypeError, match="lives on the workers"):
            _ = ref.value
        # plain remote(): a RemoteValue holding the box, the same object to later calls
        boxed = remote(make_counter)(rank)
        remote(bump)(boxed, 1)
        assert inspect(remote(read)(boxed), host=1, proc=1) == 4


def test_an_opaque_ref_dropped_on_the_client_is_freed_on_the_workers(
    mesh: DeviceMesh, tmp_path: Path
) -> None:
    handle, plain = tmp_path / "handle", tmp_path / "plain"
    handle.mkdir()
    plain.mkdir()
    with mesh.activate():
        ref = remote(make_tracked, propagate=lambda where: OpaqueRef())(str(handle))
        boxed = remote(make_tracked)(str(plain))
        inspect(torch.zeros(1))
    assert files(handle) == files(plain) == 0  # held while the client holds them
    del ref
    gc.collect()
    eventually(mesh, lambda: files(handle) == 4, "the OpaqueRef's object was not freed")
    assert files(plain) == 0
    del boxed
    gc.collect()
    eventually(mesh, lambda: files(plain) == 4, "the RemoteValue's box was not freed")


# ------------------------------------------------------------------ remote_autograd_function


class ScaledTanh(torch.autograd.Function):
    """``scale * tanh(x * w)``, ``w`` broadcast over the rows of ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
        y = torch.tanh(x * w) * scale
        ctx.save_for_backward(x, w, y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w, y = ctx.saved_tensors
        d = g * (ctx.scale - y * y / ctx.scale)
        return d * w, (d * x).sum(0), None


RemoteScaledTanh = remote_autograd_function(ScaledTanh)


def test_a_remote_autograd_functions_gradients_equal_local_torchs_shard_by_shard(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        x = torch.randn(4, 3, requires_grad=True)  # different on every rank
        w = torch.randn(3, requires_grad=True)
        y = RemoteScaledTanh.apply(x, w, 2.0)
        assert isinstance(y, Tensor) and y.requires_grad and y.shape == (4, 3)
        (y * y).sum().backward()
        for s in SHARDS:
            xs, ws, ys, gx, gw = inspect((x, w, y, x.grad, w.grad), **s)
            xl, wl = xs.requires_grad_(), ws.requires_grad_()
            yl = ScaledTanh.apply(xl, wl, 2.0)
            (yl * yl).sum().backward()
            torch.testing.assert_close(ys, yl.detach())
            torch.testing.assert_close(gx, xl.grad)
            torch.testing.assert_close(gw, wl.grad)


@remote_autograd_function(propagate=lambda x, where: x * 3)  # (a mocked run would make one here)
class Tripled(torch.autograd.Function):
    """``3 * x``; its ctx holds a `Tracked` object (a ctx state that only lives on the
    worker), which its backward checks is there."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, where: str) -> torch.Tensor:
        ctx.tracked = Tracked(where)
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        assert isinstance(ctx.tracked, Tracked)
        return g * 3, None


def test_a_decorated_function_keeps_its_ctx_on_the_workers_until_its_backward_ran(
    mesh: DeviceMesh, tmp_path: Path
) -> None:
    local = Tripled.apply(torch.ones(2, requires_grad=True), str(tmp_path))  # the Function
    assert local.tolist() == [3.0, 3.0] and not isinstance(local, Tensor)
    ctx_dir = tmp_path / "ctx"
    ctx_dir.mkdir()
    with mesh.activate():
        x = torch.ones(2, requires_grad=True)
        y = Tripled.apply(x, str(ctx_dir))
        assert inspect(y).tolist() == [3.0, 3.0]
        assert files(ctx_dir) == 0  # the ctx waits for the backward
        y.sum().backward()
        assert [inspect(x.grad, **s).tolist() for s in SHARDS] == [[3.0, 3.0]] * 4
    eventually(mesh, lambda: files(ctx_dir) == 4, "the workers kept the ctx after backward")
