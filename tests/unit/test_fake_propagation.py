"""Fake propagation (`palatine.tensor.client.fake`): what an op returns, learned on the
client from fake tensors, with no worker involved."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from palatine.tensor.client import fake
from palatine.tensor.client.fake import Meta, fake_call, op_key, propagate

aten = torch.ops.aten


class Handle:
    """Stands for a mesh tensor: the client knows its metadata only."""

    def __init__(self, *shape: int, dtype: torch.dtype = torch.float32) -> None:
        stride = tuple(int(torch.tensor(shape[i + 1 :]).prod()) for i in range(len(shape)))
        self.meta = Meta(tuple(shape), stride, dtype, torch.device("cpu"))


def meta(x: Any) -> Meta | None:
    return x.meta if isinstance(x, Handle) else None


def test_an_op_result_has_the_broadcast_shape_and_promoted_dtype() -> None:
    a, b = Handle(3, 1), Handle(1, 4, dtype=torch.float64)
    spec = propagate(aten.add.Tensor, (a, b), {}, meta)
    (out,) = spec.outs
    assert out.meta.shape == (3, 4) and out.meta.dtype == torch.float64
    assert out.alias is None and not out.written and spec.mutated == []


def test_an_in_place_op_writes_its_input_and_returns_it() -> None:
    a = Handle(2, 2)
    spec = propagate(aten.mul_.Tensor, (a, 3), {}, meta)
    (out,) = spec.outs
    assert out.written and out.alias == 0 and spec.mutated == [0]


def test_out_arguments_are_writes_by_the_schema() -> None:
    a, o = Handle(4), Handle(4)
    spec = propagate(aten.add.out, (a, 1), {"out": o}, meta)
    assert spec.mutated == [1] and spec.outs[0].written and spec.outs[0].alias == 1


def test_a_view_aliases_its_input_without_writing_it() -> None:
    a = Handle(2, 3)
    spec = propagate(aten.t.default, (a,), {}, meta)
    (out,) = spec.outs
    assert out.alias == 0 and not out.written and out.meta.stride == (1, 3)


def test_multi_output_and_list_results_rebuild_their_structure() -> None:
    a = Handle(5)
    spec = propagate(aten.split.Tensor, (a, 2), {}, meta)
    assert [o.meta.shape for o in spec.outs] == [(2,), (2,), (1,)]
    assert spec.rebuild(["x", "y", "z"]) == ["x", "y", "z"]
    spec = propagate(aten.max.dim, (Handle(2, 3), 1), {}, meta)
    assert [o.meta.dtype for o in spec.outs] == [torch.float32, torch.int64]
    assert spec.rebuild([1, 2]) == (1, 2)


def test_answers_are_cached_by_op_and_input_metadata_with_scalar_types_apart() -> None:
    fake._cache.clear()
    first = propagate(aten.add.Tensor, (Handle(8), 1), {}, meta)
    assert propagate(aten.add.Tensor, (Handle(8), 1), {}, meta) is first
    # a number taken as a tensor or scalar counts by its type: x + i is learned once
    assert propagate(aten.add.Tensor, (Handle(8), 2), {}, meta) is first
    assert propagate(aten.add.Tensor, (Handle(8), 2), {"alpha": 3}, meta) is not first
    # numbers that are sizes count by value
    wide = propagate(aten.view.default, (Handle(8), [2, 4]), {}, meta)
    tall = propagate(aten.view.default, (Handle(8), [4, 2]), {}, meta)
    assert wide.outs[0].meta.shape == (2, 4) and tall.outs[0].meta.shape == (4, 2)
    as_float = propagate(aten.add.Tensor, (Handle(8, dtype=torch.int32), 1.0), {}, meta)
    as_int = propagate(aten.add.Tensor, (Handle(8, dtype=torch.int32), 1), {}, meta)
    assert as_float.outs[0].meta.dtype == torch.float32
    assert as_int.outs[0].meta.dtype == torch.int32
    assert op_key(aten.add.Tensor, ([object()],), {}, meta) is None  # not keyable


def test_a_shape_error_is_raised_before_anything_is_sent() -> None:
    with pytest.raises(RuntimeError, match="broadcast"):
        propagate(aten.add.Tensor, (Handle(3), Handle(4)), {}, meta)


def test_a_shape_function_that_writes_its_input_marks_it_mutated() -> None:
    def shape(x: Any) -> None:
        x.add_(1)

    spec = fake_call(shape, (Handle(3),), {}, meta)
    assert spec.outs == [] and spec.mutated == [0]
    spec = fake_call(lambda x: x, (Handle(3),), {}, meta)
    assert spec.outs[0].alias == 0 and not spec.outs[0].written and spec.mutated == []


def test_propagation_leaves_the_environment_as_it_found_it() -> None:
    before = dict(os.environ)
    fake._local.__dict__.pop("mode", None)  # a first fake mode, as a new thread makes
    propagate(aten.sin.default, (Handle(2, 2),), {}, meta)
    assert dict(os.environ) == before
