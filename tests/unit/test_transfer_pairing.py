"""Moving a value between meshes: which rank sends to which, what each rank runs on which
stream, and which slices the one command is cast to."""

from __future__ import annotations

import itertools

import pytest

from palatine.protocol.worker import SendTensor, Slice
from palatine.tensor.client.transfer import by_names, casts
from palatine.tensor.worker.transfer import Pairing, pairing, parts

# A 2x2 mesh (dp, pp) over ranks 0-3: dp varies slowest.
MESH = Slice(0, [2, 2], [2, 1])
PP0 = Slice(0, [2], [2])  # mesh(pp=0): ranks 0, 2
PP1 = Slice(1, [2], [2])  # mesh(pp=1): ranks 1, 3
DP0 = Slice(0, [2], [1])  # mesh(dp=0): ranks 0, 1
DP1 = Slice(2, [2], [1])  # mesh(dp=1): ranks 2, 3


def cmd(src: Slice, dst: Slice, stream: int = 0, to_stream: int | None = None) -> SendTensor:
    return SendTensor(
        seq=7, result=9, value=8, from_ranks=src, to_ranks=dst, stream=stream, to_stream=to_stream
    )


def test_pipeline_stage_to_the_next_pairs_ranks_by_coordinate() -> None:
    assert [pairing(PP0, PP1, r) for r in range(4)] == [
        Pairing(send_to=1, recv_from=None),
        Pairing(send_to=None, recv_from=0),
        Pairing(send_to=3, recv_from=None),
        Pairing(send_to=None, recv_from=2),
    ]
    assert [pairing(DP0, DP1, r) for r in range(4)] == [
        Pairing(2, None),
        Pairing(3, None),
        Pairing(None, 0),
        Pairing(None, 1),
    ]


def test_a_rank_outside_both_meshes_has_no_part() -> None:
    assert pairing(Slice(0, [1], [1]), Slice(1, [1], [1]), 3) == Pairing(None, None)


def test_pairing_follows_row_major_order_not_rank_order() -> None:
    transposed = Slice(0, [2, 2], [1, 2])  # ranks 0, 2, 1, 3
    assert [pairing(MESH, transposed, r) for r in range(4)] == [
        Pairing(0, 0),  # paired with itself: a local copy
        Pairing(2, 2),  # sends to 2 and receives from 2: a swap
        Pairing(1, 1),
        Pairing(3, 3),
    ]


def test_overlapping_meshes_make_a_rank_send_and_receive_with_different_peers() -> None:
    assert pairing(Slice(0, [2], [1]), Slice(1, [2], [1]), 1) == Pairing(send_to=2, recv_from=0)


def test_a_mesh_to_itself_pairs_every_rank_with_itself() -> None:
    assert all(pairing(MESH, MESH, r) == Pairing(r, r) for r in range(4))


def test_meshes_of_different_sizes_name_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"source has 2 ranks, sizes \[2\].*destination 4"):
        pairing(PP0, MESH, 0)


def test_a_slice_that_repeats_a_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="destination repeats a rank"):
        pairing(PP0, Slice(1, [2], [0]), 0)


def test_one_part_on_one_stream_when_a_rank_sends_and_receives() -> None:
    (only,) = parts(cmd(MESH, Slice(0, [2, 2], [1, 2])), 1)
    sid, part = only
    assert sid == 0 and (part.send_to, part.recv_from, part.seq) == (2, 2, 7)
    assert part.receives


def test_a_send_runs_on_the_values_stream_and_a_receive_on_the_results() -> None:
    assert [(s, p.send_to, p.recv_from) for s, p in parts(cmd(PP0, PP1, 1, 2), 0)] == [(1, 1, None)]
    assert [(s, p.send_to, p.recv_from) for s, p in parts(cmd(PP0, PP1, 1, 2), 1)] == [(2, None, 0)]
    shifted = cmd(Slice(0, [2], [1]), Slice(1, [2], [1]), 1, 2)
    got = [(s, p.send_to, p.recv_from, p.receives) for s, p in parts(shifted, 1)]
    assert got == [(1, 2, None, False), (2, None, 0, True)]


def test_a_rank_paired_with_itself_needs_one_stream() -> None:
    with pytest.raises(ValueError, match="rank 3 is paired with itself"):
        parts(cmd(MESH, MESH, 0, 1), 3)


def test_a_command_for_a_rank_outside_both_meshes_is_refused() -> None:
    with pytest.raises(ValueError, match="reached rank 3, which is in neither"):
        parts(cmd(Slice(0, [1], [1]), Slice(1, [1], [1])), 3)


def _slices(world: int) -> list[Slice]:
    out = []
    for offset in range(world):
        for size in (1, 2):
            for stride in (1, 2, 3):
                s = Slice(offset, [size], [stride])
                if all(r < world for r in s.ranks()):
                    out.append(s)
    return out


def test_the_command_reaches_every_rank_of_both_meshes_exactly_once() -> None:
    for src, dst in itertools.product(_slices(6), repeat=2):
        if len(src) != len(dst):
            continue
        reached = [r for s in casts(src, dst) for r in s.ranks()]
        assert sorted(reached) == sorted(set(src.ranks()) | set(dst.ranks())), (src, dst)
    assert casts(PP0, PP1) == [PP0, PP1]
    assert casts(MESH, Slice(0, [2, 2], [1, 2])) == [MESH]


def test_dtype_codes_name_every_torch_dtype_once() -> None:
    torch = pytest.importorskip("torch")
    from palatine.tensor.worker.transfer import _dtype_code, _dtype_of

    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert len({_dtype_code(d) for d in dtypes}) == len(dtypes)
    assert all(_dtype_of(torch, _dtype_code(d)) is d for d in dtypes)


def test_meshes_naming_the_same_dims_in_another_order_pair_by_name() -> None:
    # ranks 0-3 as (dp=2, pp=2); the destination names them (pp, dp)
    src = Slice(offset=0, sizes=[2, 2], strides=[2, 1])
    turned = by_names(src, ["dp", "pp"], ["pp", "dp"])
    assert turned.ranks() == [0, 2, 1, 3]  # dest index i = (pp, dp) row-major
    assert by_names(src, ["dp", "pp"], ["dp", "pp"]) is src
    assert by_names(src, ["host", "proc"], ["dp", "pp"]) is src  # other names: by index
