"""`palatine worker` narrows the visible GPUs to one per proc."""

from __future__ import annotations

import pytest

from palatine.cli.worker import narrow_visible_devices


def test_without_devices_per_host_nothing_changes() -> None:
    env = {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert narrow_visible_devices(env) is None
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize(
    ("per_host", "local_rank", "visible", "seen"),
    [
        ("2", "0", None, "0"),
        ("2", "3", None, "1"),  # LOCAL_RANK % n of 0..n-1
        ("4", "2", "4,5,6,7", "6"),
        ("2", "5", "GPU-aa, GPU-bb", "GPU-bb"),  # uuids, spaces trimmed
        ("1", "7", "3", "3"),
        ("2", "1", "0,1,2,3", "1"),  # more visible than per host: the first n are used
    ],
)
def test_each_proc_sees_entry_local_rank_mod_n(
    per_host: str, local_rank: str, visible: str | None, seen: str
) -> None:
    env = {"PALATINE_DEVICES_PER_HOST": per_host, "LOCAL_RANK": local_rank}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    assert narrow_visible_devices(env) is None
    assert env["CUDA_VISIBLE_DEVICES"] == seen
    assert env["PALATINE_DEVICES_PER_HOST"] == "1"
    assert narrow_visible_devices(env) is None  # a worker started from this one
    assert env["CUDA_VISIBLE_DEVICES"] == seen


@pytest.mark.parametrize("local_rank", [None, ""])
def test_palatine_local_rank_is_used_when_local_rank_is_not_set(local_rank: str | None) -> None:
    env = {"PALATINE_DEVICES_PER_HOST": "2", "PALATINE_LOCAL_RANK": "1"}
    if local_rank is not None:
        env["LOCAL_RANK"] = local_rank
    assert narrow_visible_devices(env) is None
    assert env["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"PALATINE_DEVICES_PER_HOST": "0"}, "must be a positive integer, not '0'"),
        ({"PALATINE_DEVICES_PER_HOST": "two"}, "must be a positive integer, not 'two'"),
        (
            {"PALATINE_DEVICES_PER_HOST": "2", "LOCAL_RANK": "x"},
            "LOCAL_RANK must be a non-negative integer, not 'x'",
        ),
        (
            {"PALATINE_DEVICES_PER_HOST": "2", "PALATINE_LOCAL_RANK": "-1"},
            "PALATINE_LOCAL_RANK must be a non-negative integer, not '-1'",
        ),
        (
            {"PALATINE_DEVICES_PER_HOST": "4", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "0,1"},
            "PALATINE_DEVICES_PER_HOST=4 but CUDA_VISIBLE_DEVICES='0,1' lists 2 device(s)",
        ),
    ],
)
def test_bad_settings_are_named_and_change_nothing(env: dict[str, str], problem: str) -> None:
    before = dict(env)
    text = narrow_visible_devices(env)
    assert text is not None and problem in text
    assert env == before
