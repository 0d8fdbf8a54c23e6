"""Mesh shapes: slice, split, rename and flatten over (names, sizes, strides, offset)."""

from __future__ import annotations

import pytest

from palatine.protocol.worker import Slice
from palatine.tensor.client.shapes import (
    MeshShape,
    flatten,
    rename,
    row_major_strides,
    size_of,
    slice_shape,
    split,
)
from palatine.tensor.worker.collectives import DeviceMeshView


def ranks(shape: MeshShape) -> list[int]:
    return Slice(shape.offset, list(shape.sizes), list(shape.strides)).ranks()


def view(shape: MeshShape, rank: int) -> DeviceMeshView:
    """The worker's view of ``shape`` on ``rank`` (what CreateDeviceMesh builds)."""
    spec = Slice(shape.offset, list(shape.sizes), list(shape.strides))
    return DeviceMeshView.create(1, shape.names, spec, rank)


HOST_GPU = MeshShape.row_major(["host", "gpu"], [2, 4])
TWO_BY_TWO = MeshShape.row_major(["host", "proc"], [2, 2])


def test_row_major_strides_have_the_last_dim_fastest() -> None:
    assert row_major_strides([2, 3, 4]) == (12, 4, 1)
    assert row_major_strides([]) == ()
    assert HOST_GPU.strides == (4, 1) and HOST_GPU.describe() == "(host=2, gpu=4)"


def test_split_two_by_two_into_dp_and_pp_keeps_the_ranks_in_row_major_order() -> None:
    s = split(TWO_BY_TWO, {"host": ("dp", "pp"), "pp": 2})
    assert s == MeshShape(("dp", "pp", "proc"), (1, 2, 2), (4, 2, 1), 0)
    assert ranks(s) == [0, 1, 2, 3]
    # The whole 2x2 as dp x pp: pp (the last new dim) varies fastest.
    flat = flatten(TWO_BY_TWO, "r")
    dp_pp = split(flat, {"r": ("dp", "pp"), "pp": 2})
    assert dp_pp == MeshShape(("dp", "pp"), (2, 2), (2, 1), 0)
    coords = {r: view(dp_pp, r).coordinates for r in range(4)}
    assert coords == {
        0: {"dp": 0, "pp": 0},
        1: {"dp": 0, "pp": 1},
        2: {"dp": 1, "pp": 0},
        3: {"dp": 1, "pp": 1},
    }
    # Members along a split dim: the ranks sharing the other coordinate.
    assert view(dp_pp, 1).members("dp") == [1, 3]
    assert view(dp_pp, 1).members("pp") == [0, 1]


def test_split_infers_the_one_size_left_out_from_either_side() -> None:
    by_pp = split(HOST_GPU, {"gpu": ("tp", "cp"), "cp": 2})
    by_tp = split(HOST_GPU, {"gpu": ("tp", "cp"), "tp": 2})
    assert by_pp == by_tp == MeshShape(("host", "tp", "cp"), (2, 2, 2), (4, 2, 1), 0)
    both = split(HOST_GPU, {"host": ("dp", "pp"), "gpu": ("tp", "cp"), "pp": 2, "cp": 4})
    assert both.names == ("dp", "pp", "tp", "cp") and both.sizes == (1, 2, 1, 4)
    assert ranks(both) == list(range(8))
    three = split(MeshShape.row_major(["r"], [12]), {"r": ("a", "b", "c"), "a": 2, "c": 3})
    assert three == MeshShape(("a", "b", "c"), (2, 2, 3), (6, 3, 1), 0)


def test_split_of_a_strided_sub_mesh_scales_its_stride() -> None:
    # Every other gpu of host 1: ranks 5 and 7 of a 2x4 mesh.
    odd = slice_shape(HOST_GPU, {"host": 1, "gpu": slice(1, None, 2)})
    assert ranks(odd) == [5, 7]
    s = split(odd, {"gpu": ("a", "b"), "b": 1})
    assert s == MeshShape(("a", "b"), (2, 1), (2, 2), 5)
    assert ranks(s) == [5, 7]


def test_split_into_one_name_renames_and_a_size_may_be_given_for_it() -> None:
    assert split(HOST_GPU, {"host": ("dp",)}).names == ("dp", "gpu")
    assert split(HOST_GPU, {"host": ("dp",), "dp": 2}).names == ("dp", "gpu")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"host": ("dp", "pp"), "pp": 3},
            r"dimension 'host' \(size 2\).*sizes \('\?', 3\).*2 is not divisible by 3",
        ),
        ({"host": ("dp", "pp"), "dp": 1, "pp": 3}, r"sizes \(1, 3\): they multiply to 3, not 2"),
        ({"host": ("dp", "pp")}, r"sizes of \['dp', 'pp'\] are all unknown"),
        ({"host": "dp"}, r"needs a sequence of new dimension names"),
        ({"host": 2}, r"needs a sequence of new dimension names"),
        ({"host": ()}, r"names no new dimension"),
        ({"host": ("dp", "gpu"), "dp": 1}, r"\['gpu'\] more than once"),
        ({"host": ("dp", "dp")}, r"\['dp'\] more than once"),
        ({"host": ("dp", "pp"), "pp": 2, "tp": 2}, r"size\(s\) given for \['tp'\], which no split"),
        ({"host": ("dp", "pp"), "pp": 0}, r"size pp=0 must be >= 1"),
        ({"pp": "x"}, r"'pp' is not a dimension of mesh of world w.*give an int, not 'x'"),
    ],
    ids=[
        "not-divisible",
        "wrong-product",
        "two-unknown",
        "name-not-sequence",
        "size-for-existing-dim",
        "no-names",
        "collides-with-kept-dim",
        "name-twice",
        "unused-size",
        "zero-size",
        "new-name-without-int",
    ],
)
def test_a_bad_split_is_a_value_error_naming_the_dim_the_sizes_and_the_mesh(
    spec: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as ei:
        split(HOST_GPU, spec, mesh="mesh of world w")  # type: ignore[arg-type]
    assert "mesh of world w (host=2, gpu=4)" in str(ei.value)


def test_rename_keeps_sizes_and_strides_and_may_swap_names() -> None:
    assert rename(HOST_GPU, {"host": "dp"}) == MeshShape(("dp", "gpu"), (2, 4), (4, 1), 0)
    swapped = rename(HOST_GPU, {"host": "gpu", "gpu": "host"})
    assert swapped == MeshShape(("gpu", "host"), (2, 4), (4, 1), 0)
    with pytest.raises(ValueError, match=r"unknown dimension 'proc'.*\['host', 'gpu'\]"):
        rename(HOST_GPU, {"proc": "x"})
    with pytest.raises(ValueError, match=r"\['gpu'\] more than once"):
        rename(HOST_GPU, {"host": "gpu"})
    with pytest.raises(ValueError, match="non-empty string"):
        rename(HOST_GPU, {"host": ""})


def test_flatten_merges_evenly_spaced_ranks_into_one_dim() -> None:
    assert flatten(HOST_GPU, "r") == MeshShape(("r",), (8,), (1,), 0)
    # A row of the mesh, and every other gpu of it: one strided dim.
    row = slice_shape(HOST_GPU, {"host": slice(1, 2)})
    assert flatten(row, "r") == MeshShape(("r",), (4,), (1,), 4)
    every_other = slice_shape(HOST_GPU, {"gpu": slice(0, None, 2), "host": 0})
    assert flatten(every_other, "r") == MeshShape(("r",), (2,), (2,), 0)
    # Split then flatten gives the mesh back as one dim.
    s = split(HOST_GPU, {"gpu": ("tp", "cp"), "cp": 2})
    assert flatten(s, "r") == MeshShape(("r",), (8,), (1,), 0)
    # Every gpu 0: ranks 0 and 4, stride 4.
    column = slice_shape(HOST_GPU, {"gpu": slice(0, 1)})
    assert flatten(column, "r") == MeshShape(("r",), (2,), (4,), 0)
    # A mesh of one rank.
    one = slice_shape(HOST_GPU, {"host": 1, "gpu": 3})
    assert flatten(one, "r") == MeshShape(("r",), (1,), (1,), 7)


def test_flatten_of_unevenly_spaced_ranks_is_a_value_error() -> None:
    two_columns = slice_shape(HOST_GPU, {"gpu": slice(0, 2)})
    assert ranks(two_columns) == [0, 1, 4, 5]
    with pytest.raises(ValueError, match=r"cannot flatten mesh \(host=2, gpu=2\).*not evenly"):
        flatten(two_columns, "r")


def test_slice_removes_int_dims_and_keeps_sliced_ones() -> None:
    s = slice_shape(HOST_GPU, {"host": -1, "gpu": slice(1, 4, 2)})
    assert s == MeshShape(("gpu",), (2,), (2,), 5) and ranks(s) == [5, 7]
    with pytest.raises(IndexError, match=r"index 2 out of range for dimension 'host' of size 2"):
        slice_shape(HOST_GPU, {"host": 2})
    with pytest.raises(IndexError, match="empty slice"):
        slice_shape(HOST_GPU, {"gpu": slice(4, None)})
    with pytest.raises(ValueError, match="unknown dimension 'proc'"):
        slice_shape(HOST_GPU, {"proc": 0})
    with pytest.raises(TypeError, match="takes an int or a slice"):
        slice_shape(HOST_GPU, {"host": "0"})  # type: ignore[dict-item]


def test_size_of_one_dim_several_dims_or_all_ranks() -> None:
    assert size_of(HOST_GPU) == 8
    assert size_of(HOST_GPU, "gpu") == 4
    assert size_of(HOST_GPU, ("host", "gpu")) == 8 and size_of(HOST_GPU, ["gpu"]) == 4
    assert size_of(HOST_GPU, ()) == 1
    with pytest.raises(ValueError, match="unknown dimension 'tp'"):
        size_of(HOST_GPU, ["host", "tp"])
