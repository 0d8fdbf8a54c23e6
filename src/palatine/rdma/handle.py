"""What travels with an `RDMABuffer`: where its bytes live and who owns them.

A `BufferHandle` is plain data (a msgspec struct), so a buffer pickles into any actor
message. It names the owner as humans know it (world and rank of its proc, host, pid)
for errors, says which machine the owner runs on (`locality`), and carries what each
backend needs: the owner's shared-memory file or address (`palatine.rdma.shm`) and the
address of its proc's buffer server (`palatine.rdma.server`).
"""

from __future__ import annotations

import functools
import os
import socket

import msgspec

from palatine.errors import DeviceException

__all__ = ["Owner", "BufferHandle", "locality", "owner_gone"]


class Owner(msgspec.Struct, frozen=True, kw_only=True):
    """The process that owns a buffer: its proc (``world[rank]``, or ``client``), host, pid."""

    proc: str
    host: str
    pid: int

    def __str__(self) -> str:
        return f"{self.proc} on host {self.host} (pid {self.pid})"


class BufferHandle(msgspec.Struct, frozen=True, kw_only=True):
    """One registered buffer, as a reader sees it.

    ``slot``/``generation`` name its entry in the owner's liveness table (the entry holds
    ``generation`` while the buffer is registered; `drop` clears it). ``shm_fd`` is the
    owner's descriptor of the shared-memory file holding the bytes at ``shm_offset``
    (-1: none; then ``address`` is where they are in the owner's memory, for
    cross-memory attach). ``server`` is ``host:port`` of the owner proc's buffer
    server, ``tls`` whether it speaks TLS, ``key`` the secret a request must show.
    """

    buffer_id: int
    size: int
    owner: Owner
    locality: str
    pid_start: int
    table_fd: int
    table_ino: int
    slot: int
    generation: int
    shm_fd: int = -1
    shm_ino: int = 0
    shm_offset: int = 0
    address: int = 0
    writable: bool = True
    device: str = "cpu"
    server_host: str = ""
    server_port: int = 0
    tls: bool = False
    key: str = ""


@functools.cache
def locality() -> str:
    """Which machine this process sees memory on: the kernel's boot id and this process's
    pid and network namespaces. Two processes with the same text can reach each other's
    memory; processes of the network test bed's nodes differ by network namespace, as
    two hosts would."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    parts = [boot]
    for ns in ("pid", "net"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    return ":".join(parts)


def owner_gone(owner: Owner, op: str, why: str) -> DeviceException:
    """The error of a transfer whose owner died or cannot be reached."""
    world, _, rank = owner.proc.partition("[")
    return DeviceException(
        f"rdma {op}: the buffer's owner {owner} is gone: {why}",
        "proc_failed",
        world=world,
        rank=int(rank.rstrip("]")) if rank.rstrip("]").isdigit() else None,
        host=owner.host,
        pid=owner.pid,
    )
