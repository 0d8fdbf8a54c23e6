"""`fuse_reduces`: a recording's in-place all-reduces bucketed into one collective per
run of them, without moving any across a command that touches its tensor."""

from __future__ import annotations

import itertools

from palatine.protocol.worker import CallFunction, Factory, FunctionPath, Pickled, Reduce, Slice
from palatine.tensor.client.recording import fuse_reduces

SL = Slice(0, [2], [1])


def op(result: int) -> CallFunction:
    return CallFunction(
        seq=1,
        results=[result],
        function=FunctionPath("torch.ops.aten.mul.Tensor"),
        args=Pickled(b""),
        stream=0,
    )


def reduce(ref: int, op_: str = "avg", dtype: str = "float32") -> Reduce:
    return Reduce(
        seq=1,
        result=ref,
        value=ref,
        factory=Factory(size=[2, 3], dtype=dtype),
        mesh=5,
        dims=["proc"],
        op=op_,
        in_place=True,
        stream=0,  # type: ignore[arg-type]
    )


def kinds(cmds: list[tuple[Slice, object]]) -> list[str]:
    out = []
    for _, c in cmds:
        if type(c) is CallFunction:
            out.append(c.function.path.rsplit(".", 1)[-1])  # type: ignore[union-attr]
        else:
            assert type(c) is Reduce
            out.append(f"reduce r{c.value} of {c.factory.size}")  # type: ignore[union-attr]
    return out


def test_reduces_of_a_backward_become_one_bucket_before_the_first_use() -> None:
    cmds = [(SL, op(10)), (SL, reduce(10)), (SL, op(11)), (SL, reduce(11)), (SL, op(12))]
    touched = [
        frozenset({10}),
        frozenset({10}),
        frozenset({11}),
        frozenset({11}),
        frozenset({10, 11, 12}),
    ]
    new = itertools.count(100)
    out, added = fuse_reduces(cmds, touched, lambda: next(new))
    assert added == [100]
    assert kinds(out) == [
        "Tensor",
        "Tensor",
        "pack_flat",
        "reduce r100 of [12]",
        "unpack_flat",
        "Tensor",
    ]
    unpack = out[4][1]
    assert type(unpack) is CallFunction and unpack.mutates == [10, 11]


def test_a_use_in_between_flushes_and_other_kinds_of_reduce_are_not_mixed() -> None:
    cmds = [
        (SL, reduce(10)),
        (SL, op(13)),
        (SL, reduce(11)),
        (SL, reduce(12, "sum")),
        (SL, reduce(14, dtype="float64")),
    ]
    touched = [
        frozenset({10}),
        frozenset({10, 13}),
        frozenset({11}),
        frozenset({12}),
        frozenset({14}),
    ]
    new = itertools.count(100)
    out, added = fuse_reduces(cmds, touched, lambda: next(new))
    assert added == []  # no two alike in a row: nothing bucketed
    assert kinds(out) == [
        "reduce r10 of [2, 3]",
        "Tensor",
        "reduce r11 of [2, 3]",
        "reduce r12 of [2, 3]",
        "reduce r14 of [2, 3]",
    ]
