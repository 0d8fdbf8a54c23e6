"""`grad_generator` on real workers: the gradients of a model built under
``mesh.activate()``, one at a time, each all-reduced as it comes.

One 1 × 2 local mesh (dims ``host`` and ``proc``) serves every test; each rank draws its
own data, so the two ranks' gradients differ until they are averaged over ``proc``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cloudpickle
import pytest
import torch
from meshes import module_mesh
from torch import nn

import palatine
from palatine import Stream, inspect
from palatine.tensor.client.gradients import (
    grad_function,
    grad_generator,
    gradient_execution_order,
)
from palatine.tensor.client.mesh import DeviceMesh

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])

RANKS = (0, 1)


mesh = module_mesh(1, 2)


def model_and_loss(mesh: DeviceMesh) -> tuple[nn.Module, torch.Tensor]:
    """Three linear layers on the mesh and the loss of one batch (each rank its own)."""
    with mesh.activate():
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                              nn.Linear(5, 1))  # fmt: skip
        x = torch.randn(8, 4)
        loss = (model(x) ** 2).mean()
    return model, loss


def shards(t: Any) -> list[torch.Tensor]:
    return [inspect(t, proc=r) for r in RANKS]


def torch_grads(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each parameter's gradient from torch's own ``loss.backward()``, rank by rank (the
    graph is kept for the generator)."""
    for p in params:
        p.grad = None
    loss.backward(retain_graph=True)
    return [shards(p.grad) for p in params]


def test_the_gradients_equal_torchs_backward_shard_by_shard(mesh: DeviceMesh) -> None:
    model, loss = model_and_loss(mesh)
    params = list(model.parameters())
    want = torch_grads(loss, params)
    got = list(grad_generator(loss, params))
    assert all(isinstance(g, palatine.Tensor) for g in got)
    for g, w in zip(got, want, strict=True):
        for mine, theirs in zip(shards(g), w, strict=True):
            torch.testing.assert_close(mine, theirs)
    assert not torch.equal(want[0][0], want[0][1])  # (the ranks' data differ)


def test_each_reduce_is_issued_before_the_rest_of_the_backward_and_averages_the_gradients(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, loss = model_and_loss(mesh)
    params = list(model.parameters())
    order = gradient_execution_order(loss, params)
    assert order == [5, 4, 3, 2, 1, 0]  # the last layer's bias first
    ordered = [params[i] for i in order]
    want = torch_grads(loss, ordered)

    issued: list[str] = []
    session = mesh.session
    real_issue = session.issue

    def logged(label: str, *args: Any, **kwargs: Any) -> int:
        issued.append(label)
        return real_issue(label, *args, **kwargs)

    monkeypatch.setattr(session, "issue", logged)
    got = []
    for g in grad_generator(loss, ordered):
        assert g is not None
        g.reduce_("proc", "avg")
        got.append(g)
    monkeypatch.undo()

    reduces = [i for i, label in enumerate(issued) if label.startswith("reduce")]
    assert len(reduces) == len(params)
    backward_after = [label for label in issued[reduces[0] :] if label.startswith("aten.")]
    assert any("mm" in label for label in backward_after)  # the earlier layers' gradients
    for g, w in zip(got, want, strict=True):
        mean = (w[0] + w[1]) / 2
        for shard in shards(g):
            torch.testing.assert_close(shard, mean)


def test_closing_the_generator_early_leaves_the_session_usable(mesh: DeviceMesh) -> None:
    model, loss = model_and_loss(mesh)
    params = list(reversed(list(model.parameters())))
    gen = grad_generator(loss, params)
    first = next(gen)
    gen.close()
    assert next(gen, None) is None
    want = torch_grads(loss, params)  # the same graph still runs
    for mine, theirs in zip(shards(first), want[0], strict=True):
        torch.testing.assert_close(mine, theirs)
    with mesh.activate():
        assert inspect(torch.ones(2) * 3, proc=1).tolist() == [3.0, 3.0]


def test_a_backward_runs_on_the_stream_its_forward_ran_on(mesh: DeviceMesh) -> None:
    with mesh.activate():
        with Stream("side").activate():
            side = torch.full((3,), 2.0, requires_grad=True)
            loss = (side * side * (mesh.rank("proc") + 1)).sum()
        (g,) = grad_generator(loss, [side])  # `main` is active here
        assert g is not None and g.stream.name == "side"
        assert inspect(g, proc=1).tolist() == [8.0, 8.0, 8.0]


def test_a_grad_function_backward_can_use_the_mesh_tensors_it_captured(mesh: DeviceMesh) -> None:
    @grad_function
    def scaled(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return x * scale, lambda g: (g * scale, None)

    with mesh.activate():
        x = torch.ones(3, requires_grad=True)
        scale = mesh.rank("proc") + 2.0
        y = scaled(x, scale)
        (g,) = grad_generator(y.sum(), [x])
    assert [s.tolist() for s in shards(g)] == [[2.0] * 3, [3.0] * 3]
