"""Contiguous bytes of the objects a buffer or a transfer names: tensors, bytearrays,
memoryviews.

`Region` is what the backends copy to and from: an address and a length in this
process (a CUDA tensor goes through a host staging copy, `Region.finish`). Only 1-d
contiguous bytes are taken, as in Monarch: a strided tensor would need a gather the
caller should see.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

__all__ = ["Region", "region_of", "is_tensor", "view_at"]


def is_tensor(obj: object) -> bool:
    """A torch tensor, without importing torch for programs that never use it."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def view_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address`` (memory someone else keeps alive)."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class Region:
    """``nbytes`` at ``address``; ``keep`` holds what owns the memory while it is used, and
    ``finish`` (a CUDA destination's copy back from its staging) runs after a read."""

    def __init__(
        self,
        address: int,
        nbytes: int,
        keep: Any,
        *,
        writable: bool = True,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self.address = address
        self.nbytes = nbytes
        self.keep = keep
        self.writable = writable
        self.finish = finish

    def view(self) -> memoryview:
        return view_at(self.address, self.nbytes)


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer``, for the address of a read-only buffer."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _address_of(mv: memoryview) -> int:
    """The address of a contiguous byte view (``ctypes`` takes only writable ones, so a
    read-only one asks CPython's buffer protocol directly)."""
    if len(mv) == 0:
        return 0
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    view = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(mv), ctypes.byref(view), 0)
    try:
        return int(view.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def _tensor_region(t: Any, what: str, *, for_write: bool) -> Region:
    if not t.is_contiguous():
        raise ValueError(f"rdma: {what} must be a contiguous tensor (got strides {t.stride()})")
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cpu":
        return Region(t.data_ptr(), nbytes, t)
    import torch

    # a CUDA tensor goes through a host copy: staged before a write, copied back after a read
    staging = torch.empty(nbytes, dtype=torch.uint8)
    flat = t.view(-1).view(torch.uint8)
    if not for_write:
        staging.copy_(flat)
        return Region(staging.data_ptr(), nbytes, (t, staging))

    def finish() -> None:
        flat.copy_(staging)

    return Region(staging.data_ptr(), nbytes, (t, staging), finish=finish)


def region_of(obj: Any, what: str, *, for_write: bool) -> Region:
    """The bytes of ``obj`` (a tensor, or anything with the buffer protocol).

    ``for_write``: the bytes will be written (a read's destination); a read-only object
    is refused with `ValueError`, as is a non-contiguous one."""
    if is_tensor(obj):
        return _tensor_region(obj, what, for_write=for_write)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"rdma: {what} must be a torch.Tensor, bytearray or memoryview, "
            f"not {type(obj).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise ValueError(f"rdma: {what} must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if for_write and mv.readonly:
        raise ValueError(f"rdma: {what} is read-only")
    return Region(_address_of(mv), len(mv), mv, writable=not mv.readonly)
