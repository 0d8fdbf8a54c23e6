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
        self.lock = threading.Lock()
        self.maps: dict[int, _Map] = {}  # by the shared file's inode
        self.copying = 0  # copies under way (nothing is unmapped meanwhile)
        self.forgotten = False

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

    def acquire(self, h: BufferHandle) -> int:
        """Start a copy of ``h``; the address of its shared file here (mapped on first use;
        files of buffers dropped since are unmapped first, when no copy is under way)."""
        with self.lock:
            if self.copying == 0:
                for ino in [i for i, m in self.maps.items() if self.slots[m.slot] != m.generation]:
                    self.maps.pop(ino).close()
            self.copying += 1
            if h.shm_fd < 0:
                return 0
            got = self.maps.get(h.shm_ino)
            if got is None:
                fd = self._open(h, h.shm_fd, h.shm_ino)
                try:
                    got = _Map(fd, h.slot, h.generation)
                finally:
                    os.close(fd)
                self.maps[h.shm_ino] = got
            return got.address

    def release(self) -> None:
        with self.lock:
            self.copying -= 1
            if self.forgotten and self.copying == 0:
                self._close()

    def forget(self) -> None:
        """The owner died: unmap everything once the copies under way are done."""
        with self.lock:
            self.forgotten = True
            if self.copying == 0:
                self._close()

    def _close(self) -> None:
        for m in self.maps.values():
            m.close()
        self.maps.clear()
        self.slots.release()
        self.table.close()
        os.close(self.pidfd)


class _Map:
    """One of the owner's shared files, mapped here; ``slot``/``generation``: the buffer it
    was mapped for, whose drop unmaps it."""

    def __init__(self, fd: int, slot: int, generation: int) -> None:
        size = os.fstat(fd).st_size
        populate = getattr(mmap, "MAP_POPULATE", 0)
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        self.anchor = (ctypes.c_char * size).from_buffer(self.map) if size else None
        self.address = ctypes.addressof(self.anchor) if self.anchor is not None else 0
        self.slot, self.generation = slot, generation

    def close(self) -> None:
        self.anchor = None
        self.map.close()


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
        peer.forget()


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
    base = peer.acquire(h)
    try:
        write = op == "write"
        if h.shm_fd >= 0:
            remote = base + h.shm_offset + offset
            if write:
                ctypes.memmove(remote, local, n)
            else:
                ctypes.memmove(local, remote, n)
        else:
            _cma(h, write, h.address + offset, local, n)
        peer.check(h, op)
    finally:
        peer.release()
