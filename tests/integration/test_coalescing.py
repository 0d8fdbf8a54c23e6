"""Coalescing on real workers: ``palatine.compile`` records a call once and replays it as
one message per rank; ``palatine.coalescing()`` sends a block's ops together.

One 1 × 2 local mesh serves every test. Training results are compared with the same
program run by local torch; what a recording cannot replay must be an error that says
why, never a wrong answer.
"""

from __future__ import annotations

from typing import Any

import cloudpickle
import pytest
import torch
from meshes import module_mesh
from torch import nn

import palatine
from palatine import CoalescingError, RemoteException, inspect, no_mesh, remote
from palatine.protocol.worker import CallFunction, CallRecording
from palatine.tensor.client.mesh import DeviceMesh

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(__import__("sys").modules[__name__])

mesh = module_mesh(1, 2)


def sent_commands(session: Any, fn: Any) -> list[Any]:
    """The commands the session issues while ``fn()`` runs (every seq's)."""
    seen: list[Any] = []
    put = session.outbox.put

    def spy(node: Any, cmds: Any, fetch: bool) -> None:
        seen.extend(c for _, c in cmds)
        put(node, cmds, fetch)

    session.outbox.put = spy
    try:
        fn()
    finally:
        del session.outbox.put
    return seen


def test_a_compiled_function_runs_its_python_once_and_replays_as_one_message(
    mesh: DeviceMesh,
) -> None:
    runs = []
    with mesh.activate():
        a = torch.zeros(())

        @palatine.compile(warmup=0)
        def fn() -> Any:
            runs.append(1)
            z = torch.ones(())
            a.add_(z)
            return z

        zs = [fn() for _ in range(3)]
        cmds = sent_commands(mesh.session, fn)
        assert len(runs) == 1  # recorded once; the other calls replayed
        assert fn.recordings() == 1
        assert [type(c) for c in cmds].count(CallRecording) == 1
        assert not any(type(c) is CallFunction and "aten" in str(c.function) for c in cmds)
        assert inspect(a).item() == 4.0
        assert [inspect(z).item() for z in zs] == [1.0, 1.0, 1.0]
        assert inspect(a, proc=1).item() == 4.0


def test_each_call_gets_its_own_results_computed_from_its_own_arguments(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        w = torch.rand(3, 4)

        @palatine.compile
        def affine(b: Any, scale: float) -> Any:
            return scale * w + b

        bs = [torch.rand(3, 4) for _ in range(4)]
        outs = [affine(b, 2.0) for b in bs]
        assert affine.recordings() == 1
        lw = inspect(w)
        for b, out in zip(bs, outs, strict=True):  # none overwritten by a later call
            assert torch.allclose(inspect(out), 2.0 * lw + inspect(b))
        # another plain value or another shape is another recording, never a stale one
        assert torch.allclose(inspect(affine(bs[0], 3.0)), 3.0 * lw + inspect(bs[0]))
        assert torch.allclose(inspect(affine(bs[0], 3.0)), 3.0 * lw + inspect(bs[0]))
        row = torch.rand(4)
        assert torch.allclose(inspect(affine(row, 2.0)), 2.0 * lw + inspect(row))
        assert torch.allclose(inspect(affine(row, 2.0)), 2.0 * lw + inspect(row))
        assert affine.recordings() == 3


def test_an_in_place_write_to_an_argument_reaches_the_callers_tensor(mesh: DeviceMesh) -> None:
    with mesh.activate():

        @palatine.compile(warmup=0)
        def bump(t: Any) -> None:
            t.add_(1.0)

        xs = [torch.zeros(2) for _ in range(3)]
        for x in xs:
            bump(x)
        bump(xs[0])
        assert [inspect(x).tolist() for x in xs] == [[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("foreach", [False, True])
def test_a_compiled_data_parallel_step_trains_exactly_as_local_torch(
    mesh: DeviceMesh, foreach: bool
) -> None:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 4, generator=gen) for _ in range(6)]
    ys = [torch.randn(16, 1, generator=gen) for _ in range(6)]
    with mesh.activate():
        palatine.random.set_manual_seed_remote(7)  # identical replicas
        model = make_model()
        with no_mesh():
            local = make_model()
        with torch.no_grad():
            for mine, theirs in zip(local.parameters(), model.parameters(), strict=True):
                mine.copy_(inspect(theirs))
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
        order = list(reversed(params))

        @palatine.compile
        def step(x: Any, y: Any) -> Any:
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            for p, g in zip(order, palatine.grad_generator(loss, order), strict=True):
                g.reduce_("proc", "avg")
                p.grad = g
            opt.step()
            return loss

        losses = [
            step(torch.tensor(x.tolist()), torch.tensor(y.tolist()))
            for x, y in zip(xs, ys, strict=True)
        ]
        assert step.recordings() == 1
        local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            local_opt.zero_grad()
            loss = ((local(x) - y) ** 2).mean()
            loss.backward()
            local_opt.step()
            assert inspect(losses[i]).item() == pytest.approx(loss.item(), rel=1e-5)
        for mine, theirs in zip(local.parameters(), params, strict=True):
            for rank in (0, 1):
                assert torch.allclose(inspect(theirs, proc=rank), mine, atol=1e-6)
            # the gradient a replay left in .grad is that step's, as a plain call leaves it
        for mine, theirs in zip(local.parameters(), params, strict=True):
            assert mine.grad is not None and theirs.grad is not None
            assert torch.allclose(inspect(theirs.grad), mine.grad, atol=1e-6)


def check_finite(x: Any) -> Any:
    if not torch.isfinite(x).all():
        raise ValueError("the batch holds a non-finite value")
    return x.sum()


def test_a_failing_op_inside_a_replay_names_the_op_and_the_next_call_works(
    mesh: DeviceMesh,
) -> None:
    checked = remote(check_finite, propagate=lambda x: x.sum())
    with mesh.activate():
        total = torch.zeros(())

        @palatine.compile
        def step(x: Any) -> Any:
            s = checked(x)
            total.add_(x.mean())
            return s

        assert inspect(step(torch.ones(4))).item() == 4.0
        assert inspect(step(torch.ones(4))).item() == 4.0  # the recorded call
        bad = step(torch.full((4,), float("nan")))  # a replay
        with pytest.raises(RemoteException) as info:
            inspect(bad)
        assert "check_finite" in str(info.value)
        assert "non-finite" in str(info.value)
        assert inspect(step(torch.full((4,), 2.0))).item() == 8.0
        assert step.recordings() == 1


def test_what_a_replay_cannot_reproduce_is_refused_with_the_reason(mesh: DeviceMesh) -> None:
    with mesh.activate():
        t = torch.zeros(3)

        @palatine.compile(warmup=0)
        def fetches(x: Any) -> Any:
            return inspect(x + 1)

        with pytest.raises(CoalescingError, match="fetches a value"):
            fetches(t)

        step = torch.zeros(())
        step += 1  # a value the client knows, made before the call

        @palatine.compile(warmup=0)
        def reads_a_count(x: Any) -> Any:
            step.add_(1)
            return x * step.item()

        with pytest.raises(CoalescingError, match=r"item\(\)"):
            reads_a_count(t)

        @palatine.compile(warmup=0)
        def returns_a_number(x: Any) -> Any:
            return 3

        with pytest.raises(CoalescingError, match="returns a int"):
            returns_a_number(t)

        with pytest.raises(CoalescingError, match="REQUIRES_GRAD"):
            fetches(torch.zeros(3, requires_grad=True))

        # Adam reads its step count on the client: refused, not replayed with step 1
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

        @palatine.compile
        def adam_step(x: Any) -> Any:
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            opt.step()
            return loss

        adam_step(torch.ones(2, 4))
        with pytest.raises(CoalescingError, match="optimizer"):
            adam_step(torch.ones(2, 4))
        # the mesh goes on
        assert inspect(t + 1).tolist() == [1.0, 1.0, 1.0]


def test_a_coalescing_block_sends_its_ops_together_when_it_ends(mesh: DeviceMesh) -> None:
    with mesh.activate():
        outbox = mesh.session.outbox
        with palatine.coalescing():
            a = torch.zeros(3, 4)
            for _ in range(9):
                a = a + torch.ones(3, 4)
            with palatine.coalescing():  # nested: the outer block sends
                a = a * 2
            assert len(outbox._nodes) >= 10  # held, not sent
        assert not outbox._nodes
        assert inspect(a).tolist() == [[18.0] * 4] * 3
        with palatine.coalescing():
            b = torch.ones(2) * 5
            assert inspect(b).tolist() == [5.0, 5.0]  # a fetch inside sends what it needs
