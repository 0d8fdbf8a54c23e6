"""The buffer pool (`palatine.wire.buffers`): big buffers recycled only once unreferenced."""

from __future__ import annotations

import gc
import pickle
import threading

import numpy as np
import pytest
import torch

from palatine.wire.buffers import BufferPool

pytestmark = pytest.mark.timeout(30)

MIB = 1 << 20


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_buffers_are_writable_flat_and_exactly_sized() -> None:
    pool = BufferPool(min_bytes=MIB)
    for n in (0, 10, MIB - 1, MIB, 3 * MIB + 5):
        view = pool.take(n)
        assert view.nbytes == n and view.format == "B" and view.ndim == 1
        assert not view.readonly
        view[:] = b"\xab" * n
        assert bytes(view[-3:]) == b"\xab" * min(n, 3)


def test_a_block_is_reused_only_after_every_reference_is_gone() -> None:
    pool = BufferPool(min_bytes=MIB)
    first = pool.take(4 * MIB)
    first[:4] = b"keep"
    where = address(first)
    tensor = torch.frombuffer(first[: 2 * MIB], dtype=torch.uint8)
    derived = pickle.PickleBuffer(first[MIB:])
    del first
    second = pool.take(4 * MIB)  # the first block is still referenced
    assert address(second) != where
    second[:4] = b"\0\0\0\0"
    assert bytes(tensor[:4].tolist()) == b"keep"
    del tensor
    assert pool.free_bytes == 0  # the PickleBuffer still holds it
    del derived
    gc.collect()
    assert pool.free_bytes >= 4 * MIB
    third = pool.take(4 * MIB)
    assert address(third) == where
    assert pool.free_bytes == 0


def test_sizes_share_a_block_within_a_size_class_only() -> None:
    pool = BufferPool(min_bytes=MIB)
    a = pool.take(64 * MIB + 100)
    where = address(a)
    del a
    assert address(pool.take(64 * MIB + 5000)) == where  # same class: reused
    b = pool.take(64 * MIB + 100)
    del b
    assert address(pool.take(8 * MIB)) != where  # much smaller: a block of its own


def test_small_buffers_are_not_pooled() -> None:
    pool = BufferPool(min_bytes=MIB)
    view = pool.take(1000)
    del view
    assert pool.free_bytes == 0


def test_idle_blocks_are_capped_oldest_dropped_first() -> None:
    pool = BufferPool(min_bytes=MIB, max_free_bytes=5 * MIB)
    views: list[memoryview | None] = [pool.take(2 * MIB) for _ in range(4)]
    addresses = [address(v) for v in views if v is not None]
    for i in range(4):
        views[i] = None  # returned in order 0, 1, 2, 3
    pool.take(10)  # files the returned blocks
    assert pool.free_bytes <= 5 * MIB
    kept = {address(pool.take(2 * MIB)) for _ in range(2)}
    assert kept == set(addresses[2:])  # the two most recently returned
    huge = pool.take(8 * MIB)  # larger than the cap: never kept
    del huge
    pool.take(10)
    assert pool.free_bytes <= 5 * MIB


def test_blocks_dropped_on_other_threads_come_back() -> None:
    pool = BufferPool(min_bytes=MIB)
    views = [pool.take(2 * MIB) for _ in range(8)]
    addresses = {address(v) for v in views}
    holders = [[v] for v in views]
    del views

    def drop(h: list[memoryview]) -> None:
        h.clear()

    threads = [threading.Thread(target=drop, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = {address(pool.take(2 * MIB)) for _ in range(8)}
    assert again == addresses


def test_clear_drops_idle_blocks() -> None:
    pool = BufferPool(min_bytes=MIB)
    view = pool.take(2 * MIB)
    del view
    assert pool.free_bytes
    pool.clear()
    assert pool.free_bytes == 0
