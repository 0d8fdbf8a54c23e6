"""The torch elastic environment of one rank: the variables ``torchrun`` sets for a worker.

``init_process_group()`` with ``env://`` reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``
and ``WORLD_SIZE``; scripts read ``LOCAL_RANK`` (their device), ``LOCAL_WORLD_SIZE``,
``GROUP_RANK`` / ``NODE_RANK`` and ``TORCHELASTIC_RESTART_COUNT`` (to know they resume).
A proc mesh's last dimension is the local one (the procs of one node, as in Monarch's
``monarch.spmd``): ``{"hosts": 2, "gpus": 4}`` is 2 groups of 4, ``{"procs": 4}`` one group.
"""

from __future__ import annotations

import math
import socket

import psutil

from palatine.channel.addr import ChannelAddr, is_loopback_host, pick_host
from palatine.errors import AddrParseError
from palatine.hosting.child_env import Handoff

__all__ = ["elastic_env", "free_port", "interface_to", "master_host"]


def elastic_env(
    dims: list[tuple[str, int]],
    rank: int,
    master_addr: str,
    master_port: int,
    restart_count: int = 0,
    max_restarts: int = 0,
    run_id: str = "none",
) -> dict[str, str]:
    """The variables of flat ``rank`` of a mesh over ``dims`` (row-major), as torchrun
    names them (its docs' "Environment Variables" table)."""
    world_size = math.prod(n for _, n in dims)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a mesh of {world_size} procs ({dict(dims)})")
    local_world_size = dims[-1][1] if dims else 1
    group_rank, local_rank = divmod(rank, local_world_size)
    groups = world_size // local_world_size
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "NODE_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(groups),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
    }


def master_host() -> str:
    """The address the other ranks reach this proc's machine at: the one this proc would
    serve tcp on towards its system (``PALATINE_HOST_IP``, else the route to the system);
    ``127.0.0.1`` when the system is on a unix socket (then every proc is on this machine)."""
    text = Handoff.from_env().bootstrap_addr
    try:
        system = ChannelAddr.parse(text) if text else None
    except AddrParseError:
        system = None
    if system is None or system.transport not in ("tcp", "tls"):
        return "127.0.0.1"
    return pick_host([system])[0]


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the OS picks it; ``MASTER_PORT`` for rank 0's
    TCPStore, bound a moment later: the same small race torchrun's own choice has)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def interface_to(master_addr: str) -> str | None:
    """The network interface this machine reaches ``master_addr`` through (None when it
    is this machine's loopback, or no interface has the address): gloo's
    ``GLOO_SOCKET_IFNAME``. Without it gloo takes the address the hostname resolves to,
    which on many containers and test beds is a loopback one, that other machines cannot
    connect to."""
    if is_loopback_host(master_addr):
        return None
    local, _ = pick_host([ChannelAddr.tcp(master_addr, 9)])
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == local for a in addrs):
            return str(name)
    return None
