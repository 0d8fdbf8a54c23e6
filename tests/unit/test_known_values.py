"""The client's mirror of small constant mesh tensors (palatine.tensor.client.known)."""

from __future__ import annotations

from typing import Any

import torch

from palatine.tensor.client import known


class Held:
    """Stands for a mesh tensor: what `op_value` needs of one is its known value."""

    def __init__(self, value: torch.Tensor | None) -> None:
        self.value = value


def known_of(x: Any) -> torch.Tensor | None:
    return x.value


def test_deterministic_small_factories_are_known_and_random_or_big_ones_are_not() -> None:
    assert known.factory_value("full", ((2,), 3.0), {"device": "cuda"}, (2,)).tolist() == [3, 3]
    assert known.factory_value("rand", ((2,),), {}, (2,)) is None
    assert known.factory_value("empty", ((2,),), {}, (2,)) is None
    big = (known.KNOWN_MAX_NUMEL + 1,)
    assert known.factory_value("zeros", (big,), {}, big) is None


def test_an_op_runs_on_known_inputs_and_an_in_place_one_writes_them() -> None:
    a = Held(torch.tensor(2.0))
    out = known.op_value(torch.ops.aten.mul.Tensor, (a, a), {}, [a], known_of)
    assert out.item() == 4.0
    steps = [Held(torch.tensor(0.0)), Held(torch.tensor(5.0))]
    res = known.op_value(torch.ops.aten._foreach_add_.Scalar, (steps, 1), {}, steps, known_of)
    assert res is None  # an in-place op's own result: not UNKNOWN
    assert [s.value.item() for s in steps] == [1.0, 6.0]


def test_an_unknown_input_or_a_random_op_gives_unknown() -> None:
    a, b = Held(torch.tensor(1.0)), Held(None)
    assert known.op_value(torch.ops.aten.add.Tensor, (a, b), {}, [a, b], known_of) is known.UNKNOWN
    rand = torch.ops.aten.rand_like.default
    assert known.op_value(rand, (a,), {}, [a], known_of) is known.UNKNOWN


def test_results_line_up_leaf_by_leaf_or_not_at_all() -> None:
    outs = (torch.empty(2), torch.empty(()))
    assert known.results_known(outs, (torch.ones(2), torch.ones(()))) is not None
    assert known.results_known(outs, (torch.ones(3), torch.ones(()))) is None
    assert known.results_known(outs, torch.ones(2)) is None
