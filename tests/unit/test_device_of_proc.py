"""Which GPU a tensor worker takes: the one its host gave it, or, in a proc that sees
all of its host's (a tensor engine's actor proc), the one of its local rank."""

from __future__ import annotations

import pytest

from palatine.tensor.worker.actor import _device_of_proc


@pytest.mark.parametrize(
    ("local_rank", "count", "index"),
    [
        ("3", 1, 0),  # narrowed to its one GPU: cuda:0 whatever its rank
        ("0", 4, 0),
        ("1", 4, 1),
        ("5", 4, 1),  # more procs than GPUs: they share, round robin
        ("", 2, 0),  # no local rank: the first
        ("x", 2, 0),
    ],
)
def test_a_worker_takes_the_gpu_of_its_local_rank(
    monkeypatch: pytest.MonkeyPatch, local_rank: str, count: int, index: int
) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert _device_of_proc(0, count) == index
