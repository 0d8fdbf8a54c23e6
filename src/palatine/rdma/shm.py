"""Transfers between processes of one host, without the owner's involvement.

Two ways, by what the owner registered (`palatine.rdma.registry`):

* a CPU tensor lives in a shared-memory file: the reader opens the owner's descriptor
  (``/proc/<pid>/fd/<n>``, checked by inode), maps the file once and keeps the
  mapping, and each transfer is one ``memmove`` between the mapping and the caller's
  bytes: memcpy bandwidth once mapped;
* other bytes stay where the owner has them: the reader copies them with
  ``process_vm_readv``/``process_vm_writev`` (cross-memory attach, one copy by the
  kernel; about half of memcpy bandwidth here).

Both check, before and after the copy, that the owner lives (a pidfd, opened once per
owner: a pid given again cannot pass) and that the buffer is registered (its slot in
the owner's liveness table). A host that forbids either (another user's process, a
ptrace policy) raises `Unreachable`, and the caller goes through the owner's buffer
server instead.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import threading
from typing import Any

from palatine.rdma.handle import BufferHandle, owner_gone
from palatine.rdma.registry import TABLE_SLOTS, process_start

__all__ = ["Unreachable", "copy", "forget"]


class Unreachable(Exception):
    """This host does not let us reach the owner's memory: use its buffer server."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_CMA_ARGS: list[Any] = [
    ctypes.c_int,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
for _fn in (_libc.process_vm_readv, _libc.process_vm_writev):
    _fn.argtypes = _CMA_ARGS
    _fn.restype = ctypes.c_ssize_t

_CMA_CHUNK = 1 << 30  # the kernel moves at most this much (well, MAX_RW_COUNT) per call


class _Peer:
    """One owner process: its pidfd, its liveness table, and the files mapped from it."""

    def __init__(self, h: BufferHandle) -> None:
        pid = h.owner.pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise owner_gone(h.owner, "open", "no such process") from None
        except OSError as e:
            raise Unreachable(f"pidfd_open({pid}): {e}") from None
        try:
            if process_start(pid) != h.pid_start:
                raise owner_gone(h.owner, "open", "its pid now names another process")
            tfd = self._open(h, h.table_fd, h.table_ino)
            try:
                self.table = mmap.mmap(tfd, TABLE_SLOTS * 8, prot=mmap.PROT_READ)
            finally:
                os.close(tfd)
        except BaseException:
            os.close(self.pidfd)
            raise
        self.slots = memoryview(self.table).cast("Q")
        self.maps: dict[int, tuple[mmap.mmap, Any, int]] = {}  # inode -> (map, anchor, address)

    def _open(self, h: BufferHandle, fd: int, ino: int) -> int:
        try:
            opened = os.open(f"/proc/{h.owner.pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            self.check_alive(h, "open")
            raise ValueError(f"rdma: buffer of {h.owner} was dropped") from None
        except PermissionError as e:
            raise Unreachable(str(e)) from None
        if os.fstat(opened).st_ino != ino:
            os.close(opened)
            raise ValueError(f"rdma: buffer of {h.owner} was dropped")
        return opened

    def check_alive(self, h: BufferHandle, op: str) -> None:
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        if p.poll(0):
            raise owner_gone(h.owner, op, "the process exited")

    def check(self, h: BufferHandle, op: str) -> None:
        self.check_alive(h, op)
        if self.slots[h.slot] != h.generation:
            raise ValueError(f"rdma {op}: buffer {h.buffer_id} of {h.owner} was dropped")

    def mapping(self, h: BufferHandle) -> int:
        """The address of the owner's shared file in our memory (mapped on first use)."""
        got = self.maps.get(h.shm_ino)
        if got is None:
            fd = self._open(h, h.shm_fd, h.shm_ino)
            try:
                size = os.fstat(fd).st_size
                m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            anchor = (ctypes.c_char * size).from_buffer(m) if size else None
            got = (m, anchor, ctypes.addressof(anchor) if anchor is not None else 0)
            self.maps[h.shm_ino] = got
        return got[2]

    def close(self) -> None:
        for m, anchor, _ in self.maps.values():
            del anchor
            try:
                m.close()
            except BufferError:
                pass
        self.maps.clear()
        self.slots.release()
        try:
            self.table.close()
        except BufferError:
            pass
        os.close(self.pidfd)


_peers: dict[tuple[int, int], _Peer] = {}
_lock = threading.Lock()


def _peer(h: BufferHandle) -> _Peer:
    key = (h.owner.pid, h.pid_start)
    with _lock:
        peer = _peers.get(key)
        if peer is None:
            peer = _peers[key] = _Peer(h)
        return peer


def forget(h: BufferHandle) -> None:
    """Unmap what we mapped of ``h``'s owner (it died)."""
    with _lock:
        peer = _peers.pop((h.owner.pid, h.pid_start), None)
    if peer is not None:
        peer.close()


def _cma(h: BufferHandle, write: bool, remote: int, local: int, n: int) -> None:
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    done = 0
    while done < n:
        step = min(_CMA_CHUNK, n - done)
        liov = _Iovec(local + done, step)
        riov = _Iovec(remote + done, step)
        got = fn(h.owner.pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                raise owner_gone(h.owner, "write" if write else "read", "no such process")
            if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                raise Unreachable(os.strerror(err))
            raise OSError(err, f"rdma: cross-memory copy with {h.owner}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"rdma: cross-memory copy with {h.owner} made no progress")
        done += got


def copy(h: BufferHandle, op: str, offset: int, local: int, n: int) -> None:
    """Copy ``n`` bytes between ``local`` (our address) and the buffer at ``offset``:
    ``op`` ``read`` into ``local``, ``write`` from it. Raises `Unreachable` when this
    host does not allow it."""
    if h.device != "cpu" or (h.shm_fd < 0 and not h.address):
        raise Unreachable(f"a {h.device} buffer goes through its owner's server")
    peer = _peer(h)
    peer.check(h, op)
    write = op == "write"
    if h.shm_fd >= 0:
        remote = peer.mapping(h) + h.shm_offset + offset
        if write:
            ctypes.memmove(remote, local, n)
        else:
            ctypes.memmove(local, remote, n)
    else:
        _cma(h, write, h.address + offset, local, n)
    peer.check(h, op)
