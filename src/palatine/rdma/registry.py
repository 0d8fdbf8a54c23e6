"""The owner's side: the buffers this process registered, and their liveness table.

Registering a CPU tensor moves its storage into shared memory (torch's own
``share_memory_``: every view of the storage follows, so the owner's later in-place
updates are what readers see) and publishes the descriptor of that memory file; a
reader on the same host maps it (`palatine.rdma.shm`). Other bytes (a bytearray, a
memoryview) cannot move: a reader on the same host copies them out of the owner's
address space by cross-memory attach. CUDA tensors are served by the proc's buffer
server (`palatine.rdma.server`) with a device copy.

The liveness table is one small shared-memory file of 8-byte slots: a registered
buffer's slot holds its generation, `drop` sets it to 0. A reader maps the table
once per owner and checks the slot before and after each copy, so a dropped buffer
fails the transfer without asking the owner.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import socket
import threading
from typing import Any

from palatine.rdma.handle import BufferHandle, Owner, locality
from palatine.rdma.memory import Region, is_tensor, region_of

__all__ = ["Entry", "register", "drop", "lookup", "TABLE_SLOTS", "process_start"]

TABLE_SLOTS = 1 << 17  # 1 MiB of 8-byte slots: buffers registered at once by one process


class Entry:
    """One registered buffer: its bytes (``region``), the object that owns them, and the
    secret a server request must show."""

    def __init__(self, buffer_id: int, obj: Any, region: Region | None, key: str, slot: int):
        self.buffer_id = buffer_id
        self.obj = obj
        self.region = region
        self.key = key
        self.slot = slot


class _Table:
    """The liveness table: a shared-memory file of `TABLE_SLOTS` 8-byte generations."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("palatine-rdma-table", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, TABLE_SLOTS * 8)
        self.ino = os.fstat(self.fd).st_ino
        self.map = mmap.mmap(self.fd, TABLE_SLOTS * 8)
        self.slots = memoryview(self.map).cast("Q")
        self.free = list(range(TABLE_SLOTS - 1, -1, -1))


_lock = threading.Lock()
_table: _Table | None = None
_entries: dict[int, Entry] = {}
_ids = itertools.count(1)


def process_start(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (0 when unknown): a pid
    given again to a later process has a later start."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat.rsplit(b")", 1)[1].split()[19])


def _owner() -> Owner:
    """This process as an owner: its proc (the running actor's, else the one it was
    started for, else ``client``), host and pid."""
    proc = "client"
    try:
        from palatine.core.actor import context

        proc = str(context().actor_id.proc)
    except (RuntimeError, LookupError):
        handed = os.environ.get("PALATINE_PROC_ID", "")
        if handed:
            proc = handed
    return Owner(proc=proc, host=socket.gethostname(), pid=os.getpid())


def _shared_file(t: Any) -> tuple[int, int, int] | None:
    """Move CPU tensor ``t``'s storage to shared memory; (fd, inode, offset of ``t``'s bytes
    in the file), or None when torch shares by file name and has no descriptor."""
    storage = t.untyped_storage()
    try:
        if not storage.is_shared():
            storage.share_memory_()
        fd, _size = storage._share_fd_cpu_()
    except (RuntimeError, AttributeError):
        return None
    return int(fd), os.fstat(fd).st_ino, t.data_ptr() - storage.data_ptr()


def register(obj: Any, server: tuple[str, int, bool]) -> BufferHandle:
    """Register ``obj``'s bytes; the handle readers use. ``server`` is the buffer server's
    (host, port, tls). `ValueError` for empty or non-contiguous bytes."""
    global _table
    cuda = is_tensor(obj) and obj.device.type != "cpu"
    region = None if cuda else region_of(obj, "an RDMABuffer's data", for_write=False)
    if cuda:
        if not obj.is_contiguous():
            raise ValueError("rdma: an RDMABuffer's data must be a contiguous tensor")
        size = obj.numel() * obj.element_size()
    else:
        assert region is not None
        size = region.nbytes
    if size == 0:
        raise ValueError("rdma: cannot make an RDMABuffer of 0 bytes")
    shared = _shared_file(obj) if (is_tensor(obj) and not cuda) else None
    if shared is not None:  # the storage moved: its address changed
        region = region_of(obj, "an RDMABuffer's data", for_write=False)
    with _lock:
        if _table is None:
            _table = _Table()
        table = _table
        if not table.free:
            raise RuntimeError(f"rdma: more than {TABLE_SLOTS} buffers registered at once")
        slot = table.free.pop()
        buffer_id = next(_ids)
        key = secrets.token_hex(16)
        _entries[buffer_id] = Entry(buffer_id, obj, region, key, slot)
        table.slots[slot] = buffer_id
    host, port, tls = server
    return BufferHandle(
        buffer_id=buffer_id,
        size=size,
        owner=_owner(),
        locality=locality(),
        pid_start=process_start(os.getpid()),
        table_fd=table.fd,
        table_ino=table.ino,
        slot=slot,
        generation=buffer_id,
        shm_fd=shared[0] if shared else -1,
        shm_ino=shared[1] if shared else 0,
        shm_offset=shared[2] if shared else 0,
        address=region.address if (region is not None and shared is None) else 0,
        writable=True if region is None else region.writable,
        device=str(obj.device) if cuda else "cpu",
        server_host=host,
        server_port=port,
        tls=tls,
        key=key,
    )


def lookup(buffer_id: int, key: str) -> Entry | None:
    """The registered buffer ``buffer_id`` if ``key`` is its secret."""
    entry = _entries.get(buffer_id)
    if entry is None or not secrets.compare_digest(entry.key, key):
        return None
    return entry


def drop(buffer_id: int) -> bool:
    """Unregister ``buffer_id`` (readers' transfers fail from now on); False if unknown."""
    with _lock:
        entry = _entries.pop(buffer_id, None)
        if entry is None:
            return False
        assert _table is not None
        _table.slots[entry.slot] = 0
        _table.free.append(entry.slot)
        return True
