"""Extents and points: row-major ranks over named dimensions."""

from __future__ import annotations

import pickle

import pytest

from palatine.core.shape import Extent, Point
from palatine.mesh.actor_mesh import ValueMesh


def test_a_rank_is_its_point_row_major_and_back() -> None:
    extent = Extent(["hosts", "gpus"], [2, 4])
    assert extent.nelements == 8
    point = extent.point(5)
    assert point == {"hosts": 1, "gpus": 1} and list(point) == ["hosts", "gpus"]
    assert point.rank == 5 and point.extent == extent
    assert [extent.rank_of(extent.point(r)) for r in range(8)] == list(range(8))
    assert pickle.loads(pickle.dumps(point)) == point
    assert pickle.loads(pickle.dumps(point)).rank == 5


def test_a_bad_extent_or_point_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="named twice"):
        Extent(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        Extent(["a"], [0])
    with pytest.raises(IndexError, match="outside"):
        Point(8, Extent(["hosts", "gpus"], [2, 4]))
    with pytest.raises(IndexError, match="dimension 'gpus' of size 4"):
        Extent(["hosts", "gpus"], [2, 4]).rank_of({"hosts": 0, "gpus": 4})
    with pytest.raises(KeyError, match="names"):
        Extent(["hosts", "gpus"], [2, 4]).rank_of({"hosts": 0})


def test_a_value_mesh_pairs_points_with_values_and_picks_one() -> None:
    vm = ValueMesh([("hosts", 2), ("gpus", 2)], [0, 1, 2, 3], ["a", "b", "c", "d"])
    assert [(dict(p), p.rank, v) for p, v in vm.items()][2] == ({"hosts": 1, "gpus": 0}, 2, "c")
    assert vm.item(hosts=1, gpus=1) == "d"
    assert vm.extent == Extent(["hosts", "gpus"], [2, 2])
    part = ValueMesh([("hosts", 2), ("gpus", 2)], [1], ["b"])
    assert part.item() == "b"
    with pytest.raises(KeyError, match="no value at"):
        part.item(hosts=1, gpus=1)


def test_a_value_mesh_slices_by_dimension_and_keeps_each_values_point() -> None:
    vm = ValueMesh([("hosts", 2), ("gpus", 3)], list(range(6)), [f"v{r}" for r in range(6)])
    one = vm.slice(hosts=1)
    assert one.values() == ["v3", "v4", "v5"]
    assert [dict(p) for p, _ in one.items()] == [{"hosts": 1, "gpus": g} for g in range(3)]
    assert vm.slice(gpus=slice(0, 2)).values() == ["v0", "v1", "v3", "v4"]
    assert vm.slice(hosts=0, gpus=2).item(hosts=0, gpus=2) == "v2"
    with pytest.raises(ValueError, match="unknown dimension 'x'"):
        vm.slice(x=0)


def test_select_takes_a_dimension_named_like_its_own_arguments() -> None:
    extent = Extent(["ranks", "sel"], [2, 2])
    assert extent.select(range(4), ranks=1) == [2, 3]
    assert extent.select(range(4), sel=0) == [0, 2]
