"""Large writable buffers, recycled once nothing refers to them (sans-IO).

Receiving a big frame (a fetched tensor) needs fresh memory for its body, and so does a
worker's snapshot of a fetched value. Fresh anonymous memory costs a page fault and a
page clear per 4 KiB: for 64 MiB that is tens of milliseconds, more than the copies
themselves (much more in a VM). `BufferPool.take` therefore hands out memory of blocks
that earlier buffers used and that nothing references any more.

Lifetime invariant: a buffer from `take` is a writable memoryview of a ctypes array laid
over a pooled block. Every view, `pickle.PickleBuffer`, tensor or array built on it keeps
that ctypes array alive; only when the last of them is gone does a weakref callback
return the block, so a block is never reused while anything can still read or write it.
Callbacks may run on any thread (whichever dropped the last reference, possibly inside
the garbage collector): they only append to a deque, which `take` drains under its lock.

Small requests (below ``min_bytes``) get a plain ``bytearray``; blocks are rounded up to
one of eight size classes per power of two, and at most ``max_free_bytes`` of idle blocks
are kept (the oldest are dropped first).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import sys
import threading
import weakref
from typing import Any, Final

__all__ = ["POOL", "BufferPool", "fresh_bytes", "take_buffer"]

_PAGE: Final = mmap.PAGESIZE
_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)


def _size_class(n: int) -> int:
    """``n`` rounded up to a multiple of 1/8 of its power of two (and of the page size)."""
    step = max(_PAGE, 1 << max(n.bit_length() - 4, 0))
    return -(-n // step) * step


# Blocks up to this size are pre-faulted; bigger ones get their pages as they are filled,
# so a peer that announces a huge frame and stalls holds only what it really sent.
_POPULATE_MAX_BYTES: Final = 16 << 20


def _new_block(size: int) -> Any:
    """Fresh anonymous memory; pre-faulted in one call where the OS allows it (up to
    `_POPULATE_MAX_BYTES`)."""
    if hasattr(mmap, "MAP_PRIVATE"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if _POPULATE and size <= _POPULATE_MAX_BYTES:
            flags |= _POPULATE
        try:
            return mmap.mmap(-1, size, flags=flags)
        except (OSError, ValueError):
            pass
    return bytearray(size)


class BufferPool:
    """Recycles blocks of at least ``min_bytes`` (thread-safe)."""

    def __init__(self, min_bytes: int = 1 << 20, max_free_bytes: int = 256 << 20) -> None:
        self.min_bytes = min_bytes
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()
        self._free: collections.OrderedDict[int, tuple[int, Any]] = collections.OrderedDict()
        self._free_bytes = 0
        self._next_key = 0
        # Blocks whose buffers died, waiting to be filed by `take` (appended by callbacks).
        self._returned: collections.deque[tuple[int, Any]] = collections.deque()
        # id(weakref to a handed-out array) -> (the weakref, its block's size, the block)
        self._live: dict[int, tuple[weakref.ref[Any], int, Any]] = {}

    @property
    def free_bytes(self) -> int:
        """Bytes of idle blocks held (returned blocks not yet filed included)."""
        return self._free_bytes + sum(size for size, _ in list(self._returned))

    def take(self, nbytes: int) -> memoryview:
        """A writable, flat, unsigned-byte buffer of exactly ``nbytes`` (contents undefined)."""
        if nbytes < self.min_bytes:
            if self._returned:
                with self._lock:
                    self._file_returned()
            return memoryview(bytearray(nbytes))
        size = _size_class(nbytes)
        block = None
        with self._lock:
            self._file_returned()
            for key, (bsize, b) in self._free.items():
                if bsize == size:
                    del self._free[key]
                    self._free_bytes -= bsize
                    block = b
                    break
        if block is None:
            block = _new_block(size)
        arr = (ctypes.c_char * size).from_buffer(block)
        ref = weakref.ref(arr, self._on_dead)
        self._live[id(ref)] = (ref, size, block)
        return memoryview(arr).cast("B")[:nbytes]

    def _on_dead(self, ref: weakref.ref[Any]) -> None:
        item = self._live.pop(id(ref), None)
        if item is not None:
            self._returned.append((item[1], item[2]))

    def _file_returned(self) -> None:
        """Move returned blocks to the free list, dropping the oldest over the cap (lock held)."""
        returned = self._returned
        while returned:
            size, block = returned.popleft()
            if size > self.max_free_bytes:
                continue
            self._free[self._next_key] = (size, block)
            self._next_key += 1
            self._free_bytes += size
        while self._free_bytes > self.max_free_bytes:
            _, (size, _block) = self._free.popitem(last=False)
            self._free_bytes -= size

    def clear(self) -> None:
        """Drop every idle block (buffers in use are unaffected)."""
        with self._lock:
            self._returned.clear()
            self._free.clear()
            self._free_bytes = 0


POOL: Final = BufferPool()
"""The process-wide pool (frame bodies, fetched-value snapshots)."""


def take_buffer(nbytes: int) -> memoryview:
    """`BufferPool.take` of the process-wide `POOL`."""
    return POOL.take(nbytes)


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTES_DATA: Final = sys.getsizeof(b"") - 1  # where a bytes object's data starts (CPython)


def fresh_bytes(nbytes: int) -> tuple[bytes, memoryview]:
    """A new `bytes` of ``nbytes`` not filled in yet, and a writable view of its data.

    What a C extension does with ``PyBytes_FromStringAndSize(NULL, n)``: the object is
    filled before anybody else sees it (a received buffer that is to become a `bytes`,
    so that it needs no copy). The view must not be used once the object is handed on.
    Raises `MemoryError` when there is no memory for it.
    """
    data = _new_bytes(None, nbytes)
    view = memoryview((ctypes.c_char * nbytes).from_address(id(data) + _BYTES_DATA)).cast("B")
    return data, view
