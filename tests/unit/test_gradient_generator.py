"""`grad_generator` on local CPU tensors: the same gradients as ``torch.autograd.grad``,
each yielded before the backward runs what only later ones need, and `grad_function`.

No mesh is involved: the generator runs any autograd graph, and local tensors make its
order and values quick to check (tests/integration/test_mesh_gradients.py runs it on
workers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.functional import relu

from palatine.tensor.client.gradients import (
    GradientGenerator,
    grad_function,
    grad_generator,
    gradient_execution_order,
)

pytestmark = pytest.mark.timeout(60)


def assert_same(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, f"gradient {i}: expected None"
        else:
            assert g is not None, f"gradient {i}: expected a tensor"
            torch.testing.assert_close(g, w)


def leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.rand(*s, generator=gen).requires_grad_() for s in shapes]


class Tag(torch.autograd.Function):
    """Identity whose backward notes its name in a log: shows when a node ran."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str, log: list[str]) -> torch.Tensor:
        ctx.name, ctx.log = name, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.log.append(ctx.name)
        return g, None, None


# --------------------------------------------------------------------------- values


def test_two_roots_give_the_gradients_torch_gives() -> None:
    t, t2 = leaves((2,), (2,))
    std, mean = torch.std_mean(t + t2)
    want = torch.autograd.grad([std, mean], [t2, t], retain_graph=True)
    assert_same(list(grad_generator([std, mean], [t2, t])), want)


def test_a_stack_of_layers_gives_torchs_gradients_and_none_for_an_unused_input() -> None:
    t, w1, w2, w3, u, w4, w5, w6 = leaves((3, 3), (3, 2), (3, 2), (3, 2), (3, 2), (2, 3),
                                         (2, 3), (2, 3))  # fmt: skip
    _ = u * u
    a = relu(t @ (w1 @ w4))
    a = relu(a @ (w2 @ w5))
    a = relu(a @ (w3 @ w6))
    std, _mean = torch.std_mean(a)
    loss = std + std
    wrt = [t, w3, w6, u, w2, w5]
    want = torch.autograd.grad([loss], wrt, allow_unused=True, retain_graph=True)
    assert want[3] is None
    assert_same(list(grad_generator(loss, wrt)), want)


def test_a_value_used_by_many_branches_sums_every_contribution() -> None:
    (t,) = leaves((3, 3))
    t2, t3, t4, t5 = t + t, t * t, t / t, t - t
    total = (t2 * t3 + t4 * t5 + t2 * t4 + t3 * t5).sum()
    want = torch.autograd.grad([total], [t2, t], retain_graph=True)
    assert_same(list(grad_generator(total, [t2, t])), want)


def test_a_broadcast_input_gets_its_gradient_summed_to_its_shape() -> None:
    t, t2 = leaves((3, 3), (3,))
    r = (t * (t2 / t2)).sum()
    want = torch.autograd.grad([r], [t, t2], retain_graph=True)
    got = list(grad_generator(r, [t, t2]))
    assert got[1] is not None and got[1].shape == (3,)
    assert_same(got, want)


def test_any_order_of_the_inputs_gives_the_same_gradients() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    loss = model(torch.randn(6, 4)).pow(2).mean()
    params = list(model.parameters())
    want = torch.autograd.grad(loss, params, retain_graph=True)
    assert_same(list(grad_generator(loss, params)), want)
    backwards = list(reversed(params))
    assert_same(list(grad_generator(loss, backwards)), list(reversed(want)))


def test_grad_roots_weigh_each_root_and_a_missing_one_is_ones() -> None:
    x, y = leaves((3,), (3,))
    a, b = x * y, x.exp()
    weight = torch.tensor([1.0, 2.0, 3.0])
    want = torch.autograd.grad([a, b], [x, y], [weight, torch.ones(3)], retain_graph=True)
    assert_same(list(grad_generator([a, b], [x, y], [weight])), want)
    with pytest.raises(RuntimeError, match="grad_roots\\[0\\] has shape"):
        grad_generator(a, [x], [torch.ones(2)])


def test_gradient_edges_name_inputs_and_an_intermediate_value_can_be_asked_for() -> None:
    x, w = leaves((2, 3), (3, 3))
    h = x @ w
    loss = h.tanh().sum()
    want = torch.autograd.grad(loss, [h, w], retain_graph=True)
    got = list(grad_generator(loss, [get_gradient_edge(h), w]))
    assert_same(got, want)


def test_a_tensor_that_requires_no_grad_gets_none_and_a_root_that_does_not_is_an_error() -> None:
    (x,) = leaves((3,))
    frozen = torch.rand(3)
    loss = (x * frozen).sum()
    assert_same(list(grad_generator(loss, [frozen, x])), [None, frozen])
    with pytest.raises(RuntimeError, match="element 0 of roots does not require grad"):
        grad_generator(frozen.sum(), [x])


def test_a_tensor_named_twice_gets_its_gradient_twice() -> None:
    (x,) = leaves((3,))
    loss = (x * 3).sum()
    got = list(grad_generator(loss, [x, x]))
    assert_same(got, [torch.full((3,), 3.0)] * 2)
    assert got[0] is not got[1]


def test_a_custom_function_runs_by_the_engines_rules() -> None:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, k: float, x: torch.Tensor, c: torch.Tensor) -> Any:
            ctx.k = k
            return x * k, x + c  # two outputs; the loss uses only the first

        @staticmethod
        def backward(ctx: Any, gx: torch.Tensor, gc: torch.Tensor) -> Any:
            assert gc is not None  # a missing gradient is materialized as zeros
            return None, gx * ctx.k + gc, gc

    x, c = leaves((3,), (3,))
    out, _ = Scale.apply(2.0, x, c)  # type: ignore[no-untyped-call]
    loss = out.sum()
    want = torch.autograd.grad(loss, [x, c], retain_graph=True)
    assert_same(list(grad_generator(loss, [x, c])), want)


# --------------------------------------------------------------------------- order


def test_gradient_execution_order_is_the_reverse_of_each_inputs_last_use() -> None:
    t, w1, w2, w3 = leaves((3, 3), (3, 3), (3, 3), (3, 3))
    _ = leaves((3, 2))[0] * 2
    a = relu(t @ w1)
    a = relu(a @ w2)
    a = relu(a @ w3)
    std, _mean = torch.std_mean(a)
    loss = std + std
    assert gradient_execution_order([loss], [w2, w3, w1, a]) == [3, 1, 0, 2]


def test_a_stack_of_linear_layers_completes_its_parameters_last_layer_first() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    loss = model(torch.randn(3, 4)).sum()
    params = list(model.parameters())
    assert gradient_execution_order(loss, params) == [5, 4, 3, 2, 1, 0]


def tagged_mlp(log: list[str]) -> tuple[torch.Tensor, list[nn.Parameter]]:
    """Three linear layers with a `Tag` between each: the loss and the parameters in
    the order the backward completes them."""
    l1, l2, l3 = nn.Linear(4, 5), nn.Linear(5, 6), nn.Linear(6, 2)
    h = Tag.apply(l1(torch.randn(3, 4)), "tag1", log)  # type: ignore[no-untyped-call]
    h = Tag.apply(l2(h.tanh()), "tag2", log)  # type: ignore[no-untyped-call]
    loss = l3(h.tanh()).pow(2).sum()
    return loss, [l3.bias, l3.weight, l2.bias, l2.weight, l1.bias, l1.weight]


def test_each_gradient_is_yielded_before_the_backward_runs_what_only_later_ones_need() -> None:
    log: list[str] = []
    loss, params = tagged_mlp(log)
    names = ["b3", "w3", "b2", "w2", "b1", "w1"]
    for name, _g in zip(names, grad_generator(loss, params), strict=True):
        log.append(name)
    assert log == ["b3", "w3", "tag2", "b2", "w2", "tag1", "b1", "w1"]


def test_what_a_loop_writes_into_a_yielded_gradient_is_issued_before_the_rest_of_the_backward(
) -> None:  # fmt: skip
    log: list[str] = []
    loss, params = tagged_mlp(log)
    want = torch.autograd.grad(loss, params, retain_graph=True)
    got = []
    for g in grad_generator(loss, params):
        assert g is not None
        g.mul_(2)  # a stand-in for g.reduce_(...): in place, before the next node runs
        got.append(g)
    assert_same(got, [w * 2 for w in want])


def test_a_gradient_shared_with_the_rest_of_the_backward_is_yielded_as_a_copy() -> None:
    x, b = leaves((3,), (3,))
    loss = (x.tanh() + b).exp().sum()  # add's backward hands one tensor to b and to tanh's
    want = torch.autograd.grad(loss, [b, x], retain_graph=True)
    got = []
    for g in grad_generator(loss, [b, x]):
        assert g is not None
        got.append(g.clone())
        g.zero_()  # must not reach x's gradient
    assert_same(got, want)


def test_closing_early_runs_nothing_more() -> None:
    log: list[str] = []
    loss, params = tagged_mlp(log)
    gen = grad_generator(loss, params)
    assert isinstance(gen, GradientGenerator)
    with gen:
        next(gen)
        next(gen)
    assert next(gen, "done") == "done"
    assert log == []  # tag2's node belongs to the third gradient's stage: never run
    full = torch.autograd.grad(loss, params)  # the graph is intact
    assert len(full) == len(params)


def test_the_order_of_issue_is_the_same_on_every_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # (a dispatch mode sets it)

    def ops_of_one_run() -> list[str]:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(),
                              nn.Linear(5, 1))  # fmt: skip
        loss = model(torch.randn(7, 4)).mean()
        with OpLog() as seen:
            for _ in grad_generator(loss, list(reversed(list(model.parameters())))):
                seen.append("yield")
        return seen

    first = ops_of_one_run()
    assert first.count("yield") == 6
    assert all(ops_of_one_run() == first for _ in range(3))


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Names every aten op run inside the block, in order."""

    def __enter__(self) -> list[str]:  # type: ignore[override]
        self.seen: list[str] = []
        super().__enter__()
        return self.seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- grad_function


def test_grad_function_runs_the_closure_it_returned_as_the_backward() -> None:
    @grad_function
    def cube(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        squared = x * x

        def backward(g: torch.Tensor) -> torch.Tensor:
            return 3 * squared * g

        return squared * x, backward

    (x,) = leaves((4,))
    y = cube(x)
    assert y.grad_fn is not None
    (got,) = torch.autograd.grad(y.sum(), [x], retain_graph=True)
    torch.testing.assert_close(got, 3 * x.detach() ** 2)
    assert_same(list(grad_generator(y.sum(), [x])), [3 * x.detach() ** 2])


def test_grad_function_gives_none_to_arguments_without_a_gradient_and_takes_keywords() -> None:
    @grad_function
    def scale(x: torch.Tensor, k: float, *, shift: float = 0.0) -> tuple[torch.Tensor, Any]:
        return x * k + shift, lambda g: (g * k, None)

    (x,) = leaves((3,))
    y = scale(x, 5.0, shift=1.0)
    torch.testing.assert_close(y, x.detach() * 5 + 1)
    (got,) = list(grad_generator(y.sum(), [x]))
    torch.testing.assert_close(got, torch.full((3,), 5.0))


def test_grad_function_saves_the_closures_tensors_so_an_in_place_change_is_caught() -> None:
    @grad_function
    def times(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return x * w, lambda g: (g * w, g * x)

    x, w = leaves((3,), (3,))
    y = times(x, w)
    with torch.no_grad():
        w.add_(1)  # w was saved for the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y.sum(), [x])
