"""Training with plain PyTorch on real workers: modules built under ``mesh.activate()``,
``loss.backward()``, torch's optimizers (both of their code paths), and the small values
the client knows (an optimizer's step counter read with ``.item()``).

One 1 × 2 local mesh (dims ``host`` and ``proc``) serves every test. Each compares what the workers
computed with the same program run by local torch from the same starting weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import pytest
import torch
from meshes import module_mesh
from torch import nn

import palatine
from palatine import inspect, no_mesh, remote
from palatine.tensor.client.mesh import DeviceMesh

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])


mesh = module_mesh(1, 2)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def local_copy(model: nn.Module, rank: int) -> nn.Module:
    """A local model with the weights rank ``rank`` holds."""
    with no_mesh():
        local = make_model()
    with torch.no_grad():
        for mine, theirs in zip(local.parameters(), model.parameters(), strict=True):
            mine.copy_(inspect(theirs, proc=rank))
    return local


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum-per-parameter": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "adam-per-parameter": lambda p: torch.optim.Adam(p, lr=0.01, foreach=False),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adamw-per-parameter": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
}


def train(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any, steps: int = 3) -> None:
    """The same few steps for a mesh model and its local copies."""
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_optimizer_trains_a_module_built_under_activate_as_local_torch_does(
    mesh: DeviceMesh, name: str
) -> None:
    make_opt = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(16, 4, generator=gen)
    ys = torch.randn(16, 1, generator=gen)
    with mesh.activate():
        model = make_model()
        assert all(isinstance(p, palatine.Tensor) for p in model.parameters())
        locals_ = [local_copy(model, r) for r in (0, 1)]
        x = torch.tensor(xs.tolist())
        y = torch.tensor(ys.tolist())
        train(model, make_opt(model.parameters()), x, y)
        for r, local in enumerate(locals_):
            train(local, make_opt(local.parameters()), xs, ys)
            for mine, theirs in zip(local.parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(inspect(theirs, proc=r), mine.detach())


def add_to(t: Any, n: float) -> None:
    t.add_(n)


def test_small_values_made_from_constants_are_known_to_the_client(mesh: DeviceMesh) -> None:
    with mesh.activate():
        step = torch.tensor(0.0)
        step += 1
        step = step * 3
        assert step.item() == 3.0
        assert bool(step) and step.tolist() == 3.0
        counts = torch.arange(4)
        view = counts[1:3]
        view.mul_(10)  # a write through a view is seen by the base, as on the workers
        assert counts.tolist() == [0, 10, 20, 3]
        assert inspect(counts, proc=1).tolist() == [0, 10, 20, 3]
        # random, large or worker-written values are not known: they need a fetch
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            torch.rand(()).item()
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            torch.zeros(1000).sum().item()
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            (step + mesh.rank("proc")).item()
        written = torch.tensor(1.0)
        remote(add_to, propagate=lambda t, n: None, mutates=("t",))(written, 2.0)
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            written.item()
        assert inspect(written, proc=0).item() == 3.0
        summed = torch.tensor(1.0)
        summed.reduce_("proc", "sum")
        with pytest.raises(TypeError, match=r"palatine\.inspect"):
            summed.item()
        assert inspect(summed, proc=0).item() == 2.0


def test_a_pipeline_sends_activations_forward_and_gradients_back_across_meshes(
    mesh: DeviceMesh,
) -> None:
    gen = torch.Generator().manual_seed(2)
    w1, w2, xs = (torch.randn(*s, generator=gen) for s in ((4, 3), (3, 1), (5, 4)))
    first, second = mesh(proc=0), mesh(proc=1)
    with first.activate():
        a = torch.tensor(w1.tolist(), requires_grad=True)
        x = torch.tensor(xs.tolist())
        h = (x @ a).tanh()
    with second.activate():
        b = torch.tensor(w2.tolist(), requires_grad=True)
        out = h.to_mesh(second) @ b  # the activations go forward to the second stage
        loss = (out**2).mean()
    loss.backward()  # the gradient of h comes back to the first stage
    assert a.grad is not None and a.grad.mesh is first
    assert b.grad is not None and b.grad.mesh is second
    la, lb = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    (((xs @ la).tanh() @ lb) ** 2).mean().backward()
    torch.testing.assert_close(inspect(a.grad), la.grad)
    torch.testing.assert_close(inspect(b.grad), lb.grad)


def test_a_local_module_and_local_tensors_move_onto_the_mesh_and_train_there(
    mesh: DeviceMesh,
) -> None:
    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    with no_mesh():
        model = make_model()
        reference = make_model()
    reference.load_state_dict(model.state_dict())
    assert palatine.to_mesh(model, mesh) is model  # in place, as module.to() is
    assert all(isinstance(p, nn.Parameter) and isinstance(p, palatine.Tensor)
               for p in model.parameters())  # fmt: skip
    data = palatine.to_mesh({"x": xs, "y": ys, "n": 8}, mesh)
    assert data["n"] == 8 and data["x"].mesh is mesh
    with mesh.activate():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ((model(data["x"]) - data["y"]) ** 2).mean().backward()
        opt.step()
    ropt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ((reference(xs) - ys) ** 2).mean().backward()
    ropt.step()
    for mine, theirs in zip(reference.parameters(), model.parameters(), strict=True):
        for r in (0, 1):
            torch.testing.assert_close(inspect(theirs, proc=r), mine.detach())
