"""Device mesh views and collectives over torch.distributed.

* `DeviceMeshView` is one rank's view of a device mesh (a strided `Slice` of the worker
  world with dim names): its coordinate, the size and the **members** (ranks differing
  only along that dim) of every dim. User functions receive it for a mesh ref.
* Collectives run on a stream thread (`run` is called by `Stream.run_collective`):
  `BackendNetworkInit` joins the world-wide group through a TCPStore opened by rank 0
  (`open_store`, fetched by the client first), choosing NCCL iff every rank has its
  own CUDA device, else gloo (``PALATINE_COLLECTIVE_BACKEND`` overrides);
  `CreateProcessGroup` and `Reduce` make subgroups of a mesh's members with torch's
  local synchronisation, so only members take part.
* A `Reduce` whose input failed on some rank must not hang its peers: with a `Factory`
  the failed rank takes part with zeros; without one every member first all-gathers a
  small header ``(status, root seq, dtype, shape)`` and nobody runs the data collective
  when any header is not ok.

torch is imported lazily, only here and only on workers (``import torch`` costs ~2 s).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from palatine import config
from palatine.errors import CollectivePeerLost, InfrastructureError
from palatine.protocol.worker import (
    BackendNetworkInit,
    CreateProcessGroup,
    Slice,
)
from palatine.tensor.worker.peers import abandon, run_abortable
from palatine.tensor.worker.state import current_stream
from palatine.tensor.worker.values import SeqError

if TYPE_CHECKING:
    from palatine.tensor.worker.state import StreamView, WorkerState

__all__ = [
    "CollectiveContext",
    "DeviceMeshView",
    "abandon_groups",
    "backend_name",
    "collective_timeout_s",
    "destroy",
    "mesh_rank",
    "open_store",
    "run",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- meshes


class DeviceMeshView:
    """One rank's view of a device mesh: coordinates, sizes and members per dim.

    For slice ``(offset, sizes, strides)`` and this rank ``g`` the coordinates are the
    index vector with ``offset + Σ idx·stride = g``. ``members(dim)`` are the ranks that
    differ from ``g`` only along ``dim`` (several dims: along any of them), in index
    order. Example: 2×3 strides ``[3, 1]``, rank 1 → dim 0 members ``[1, 4]``, dim 1
    members ``[0, 1, 2]``.
    """

    __slots__ = ("coords", "global_rank", "names", "offset", "ref", "sizes", "strides")

    def __init__(
        self,
        ref: int,
        names: Sequence[str],
        sizes: Sequence[int],
        strides: Sequence[int],
        offset: int,
        coords: Sequence[int],
        global_rank: int,
    ) -> None:
        self.ref = ref
        self.names = tuple(names)
        self.sizes = tuple(sizes)
        self.strides = tuple(strides)
        self.offset = offset
        self.coords = tuple(coords)
        self.global_rank = global_rank

    @classmethod
    def create(cls, ref: int, names: Sequence[str], ranks: Slice, rank: int) -> DeviceMeshView:
        """This ``rank``'s view; ValueError when the rank is not in the slice."""
        if len(names) != len(ranks.sizes) or len(ranks.sizes) != len(ranks.strides):
            raise ValueError(
                f"device mesh r{ref} has {len(names)} names, {len(ranks.sizes)} sizes and "
                f"{len(ranks.strides)} strides"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"device mesh r{ref} has duplicate dim names {list(names)}")
        for idx in itertools.product(*(range(s) for s in ranks.sizes)):
            g = ranks.offset + sum(i * st for i, st in zip(idx, ranks.strides, strict=True))
            if g == rank:
                return cls(ref, names, ranks.sizes, ranks.strides, ranks.offset, idx, rank)
        raise ValueError(
            f"rank {rank} is outside device mesh r{ref} (offset {ranks.offset}, sizes "
            f"{list(ranks.sizes)}, strides {list(ranks.strides)})"
        )

    def _dim(self, dim: str) -> int:
        try:
            return self.names.index(dim)
        except ValueError:
            raise ValueError(
                f"unknown dimension {dim!r}; this mesh has {list(self.names)}"
            ) from None

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self.coords[self._dim(dim)]

    def size(self, dim: str | None = None) -> int:
        """The size of ``dim`` (all dims: the number of ranks in the mesh)."""
        if dim is None:
            n = 1
            for s in self.sizes:
                n *= s
            return n
        return self.sizes[self._dim(dim)]

    def members(self, dims: str | Sequence[str] | None = None) -> list[int]:
        """Ranks that differ from this one only along ``dims`` (None: the whole mesh)."""
        if dims is None:
            sel = list(range(len(self.names)))
        elif isinstance(dims, str):
            sel = [self._dim(dims)]
        else:
            sel = [self._dim(d) for d in dims]
        out = []
        for vals in itertools.product(*(range(self.sizes[d]) for d in sel)):
            idx = list(self.coords)
            for d, v in zip(sel, vals, strict=True):
                idx[d] = v
            out.append(self.offset + sum(i * st for i, st in zip(idx, self.strides, strict=True)))
        return out

    @property
    def coordinates(self) -> dict[str, int]:
        """``{dim: coordinate}`` of this rank."""
        return dict(zip(self.names, self.coords, strict=True))

    def __repr__(self) -> str:
        dims = ", ".join(
            f"{n}={c}/{s}" for n, c, s in zip(self.names, self.coords, self.sizes, strict=True)
        )
        return f"DeviceMeshView(r{self.ref}, rank {self.global_rank}: {dims})"


def mesh_rank(mesh: DeviceMeshView, dims: str | Sequence[str]) -> int | tuple[int, ...]:
    """A remote function: this rank's coordinate along ``dims`` (a tuple for several)."""
    if isinstance(dims, str):
        return mesh.rank(dims)
    return tuple(mesh.rank(d) for d in dims)


# --------------------------------------------------------------------------- setup


def collective_timeout_s() -> float:
    """The bound of a collective (``collective_timeout_s``, ``PALATINE_COLLECTIVE_TIMEOUT``)."""
    return config.get().collective_timeout_s


class CollectiveContext:
    """The world-wide collective session of this process.

    ``palatine_group`` is what a user function receives for the context's ref: the
    world process group.
    """

    __slots__ = ("backend", "device", "palatine_group", "store")

    def __init__(self, backend: str, store: Any, group: Any, device: Any) -> None:
        self.backend = backend
        self.store = store
        self.palatine_group = group
        self.device = device

    def __repr__(self) -> str:
        return f"CollectiveContext({self.backend})"


_masters: list[Any] = []
_masters_lock = threading.Lock()


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def open_store() -> str:
    """A remote function for rank 0: open a TCPStore master on a free port; ``host:port``.

    The host is this worker's address host (``127.0.0.1`` for unix and local
    transports). The store lives until the worker exits.
    """
    import torch.distributed as dist

    s = current_stream()
    host = s.worker.store_host if s is not None else "127.0.0.1"
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=collective_timeout_s()),
    )
    with _masters_lock:
        _masters.append(store)
    return f"{_fmt_host(host)}:{store.port}"


def backend_name() -> str:
    """A remote function: the backend of the world collective group (``gloo``/``nccl``)."""
    import torch.distributed as dist

    return str(dist.get_backend())


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"invalid store address {addr!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def _device_info(w: WorkerState) -> tuple[str, str]:
    if w.device.startswith("cuda") and w.device_index is not None:
        import torch

        props = torch.cuda.get_device_properties(w.device_index)
        return "cuda", str(getattr(props, "uuid", w.device_index))
    return "cpu", ""


def _choose_backend(infos: list[list[str]]) -> str:
    override = config.get().collective_backend
    if override:
        return override
    if all(info[1] == "cuda" for info in infos):
        devices = {(info[0], info[2]) for info in infos}
        if len(devices) == len(infos):
            return "nccl"
    return "gloo"


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address ``host`` (None: none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == host for a in addrs):
            return str(name)
    return None


def bind_to_interface_of(host: str) -> None:
    """Make gloo and NCCL use the interface the worker is reached on.

    Left alone, both pick the address the machine's hostname resolves to, which is often
    a loopback address: ranks on other machines then dial themselves, and the error
    comes only after the collective timeout. The worker's own address (``host``) is the
    one the rest of the job reaches it on. A user's ``GLOO_SOCKET_IFNAME`` or
    ``NCCL_SOCKET_IFNAME`` wins.
    """
    name = interface_of(host)
    if name is None:
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, name)


def _backend_network_init(stream: StreamView, cmd: BackendNetworkInit) -> None:
    import torch
    import torch.distributed as dist

    w = stream.worker
    if cmd.generation > w.collective_generation:
        # A recovery: the group of an earlier generation lost a member; leave it (unless
        # the code that met the loss left it already).
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - its peers may be gone: rejoin anyway
                log.info("rank %d: leaving the old collective group: %s", w.rank, e)
        w.groups.clear()
        w.reduce_groups.clear()
        w.collective = None
        w.collective_abandoned = None
    elif dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialised in the process of worker rank {w.rank}"
        )
    host, port = _split_addr(cmd.store_addr)
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, w.world_size, is_master=False, timeout=timeout, wait_for_workers=False
    )
    kind, uuid = _device_info(w)
    me = [socket.gethostname(), kind, uuid, os.getpid()]
    store.set(f"palatine/device/{w.rank}", json.dumps(me))
    infos = [json.loads(store.get(f"palatine/device/{r}")) for r in range(w.world_size)]
    w.peers.new_generation({r: int(info[3]) for r, info in enumerate(infos)})
    backend = _choose_backend(infos)
    kwargs: dict[str, Any] = {}
    device = torch.device("cpu")
    if backend == "nccl" and w.device_index is not None:
        device = torch.device("cuda", w.device_index)
        kwargs["device_id"] = device
    bind_to_interface_of(w.store_host)
    prefix = "palatine/pg/" if cmd.generation == 0 else f"palatine/pg{cmd.generation}/"
    prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend,
        store=prefixed,
        rank=w.rank,
        world_size=w.world_size,
        timeout=timeout,
        **kwargs,
    )
    ctx = CollectiveContext(backend, store, dist.group.WORLD, device)
    w.groups[cmd.result] = ctx
    w.collective = ctx
    w.collective_generation = cmd.generation
    log.info("rank %d joined the collective group (%s, %d ranks)", w.rank, backend, w.world_size)


_named = threading.local()
_patch_lock = threading.Lock()
_patched = False


def _install_group_namer() -> None:
    """Let us choose subgroup names (identical on every member, by construction).

    torch names a locally synchronised group by hashing its ranks together with the
    number of groups *this process* has created so far; ranks that took part in
    different sub-mesh groups before would then disagree on the name (and the store
    prefix) and never rendezvous. Our names derive from the command (seq and ref), so
    members always agree. The override applies only while a thread has set a name.
    """
    global _patched
    with _patch_lock:
        if _patched:
            return
        from torch.distributed import distributed_c10d as c10d

        original = getattr(c10d, "_process_group_name", None)
        if original is None:  # a torch without the hook: keep its own names
            _patched = True
            return

        def name_for(ranks: Any, use_hashed_name: Any) -> Any:
            name = getattr(_named, "name", None)
            if name is not None:
                return name
            return original(ranks, use_hashed_name)

        c10d._process_group_name = name_for
        _patched = True


def _new_group(w: WorkerState, ranks: list[int], what: str) -> Any:
    """A locally synchronised group of ``ranks`` named after the command ``what``.

    Sibling subgroups made by one command (the rows of a mesh) differ in their members,
    so the members are part of the name. Making it is a rendezvous of the members through
    the store, which nothing interrupts: it runs on a thread of its own, and a member
    declared lost meanwhile ends the wait at once (`palatine.tensor.worker.peers`).
    """
    import hashlib

    import torch.distributed as dist

    _install_group_namer()
    members = "_".join(map(str, ranks))
    if len(members) > 64:
        members = hashlib.blake2b(members.encode(), digest_size=12).hexdigest()
    name = f"{what}.{members}"
    timeout_s = collective_timeout_s()

    def make() -> Any:
        _named.name = name
        try:
            return dist.new_group(
                ranks,
                timeout=datetime.timedelta(seconds=timeout_s),
                use_local_synchronization=True,
            )
        finally:
            _named.name = None

    try:
        return run_abortable(w.peers, make, ranks, w.rank, what, timeout_s + 5.0)
    except CollectivePeerLost as e:
        abandon_groups(w, str(e), in_flight=True)
        raise


def _context(stream: StreamView) -> CollectiveContext | SeqError:
    """The session's collective context (waiting for an init still running elsewhere)."""
    pending = stream.worker.collective_pending
    if pending is not None and not pending.is_set():
        stream.wait_event(pending)
    ctx = stream.worker.collective
    abandoned = stream.worker.collective_abandoned
    if ctx is None and abandoned is not None:
        raise CollectivePeerLost(
            f"the collective group of worker rank {stream.worker.rank} was left after a "
            f"lost peer ({abandoned}); collectives run again after a recovery"
        )
    if ctx is None:
        raise RuntimeError(
            f"collectives are not initialised on worker rank {stream.worker.rank}: "
            "BackendNetworkInit must run first"
        )
    return ctx  # type: ignore[no-any-return]


def _mesh(stream: StreamView, ref: int, what: str) -> DeviceMeshView:
    view = stream.worker.meshes.get(ref)
    if view is None:
        raise InfrastructureError(
            f"unknown device mesh r{ref} in {what} on rank {stream.worker.rank}"
        )
    return view  # type: ignore[no-any-return]


def abandon_groups(w: WorkerState, reason: str, *, in_flight: bool) -> None:
    """Leave this generation's groups after a lost peer (`palatine.tensor.worker.peers`:
    ``in_flight``, an operation may still run in them): palatine's next collective fails
    at once with ``reason`` until a recovery's `BackendNetworkInit` joins a new group."""
    if w.collective_abandoned is not None:
        return
    groups = [g for g in list(w.groups.values()) + list(w.reduce_groups.values())]
    abandon([g for g in groups if not isinstance(g, CollectiveContext | SeqError)], in_flight)
    w.groups.clear()
    w.reduce_groups.clear()
    w.collective = None
    w.collective_abandoned = reason
    log.warning("rank %d left its collective group: %s", w.rank, reason)


def _create_process_group(stream: StreamView, cmd: CreateProcessGroup) -> None:
    view = _mesh(stream, cmd.mesh, f"CreateProcessGroup s{cmd.seq}")
    members = sorted(view.members(cmd.dims or None))
    ctx = _context(stream)
    if type(ctx) is SeqError:
        stream.poison_collective(cmd, ctx)
        return
    pg = _new_group(stream.worker, members, f"palatine.pg.s{cmd.seq}.r{cmd.result}")
    stream.worker.groups[cmd.result] = pg


# --------------------------------------------------------------------------- entry points


def run(stream: StreamView, cmd: BackendNetworkInit | CreateProcessGroup) -> None:
    """Set up collectives or a process group on ``stream``'s thread (errors: see `Stream`;
    a `Reduce` runs in `palatine.tensor.worker.reduce`)."""
    if type(cmd) is CreateProcessGroup:
        _create_process_group(stream, cmd)
    elif type(cmd) is BackendNetworkInit:
        _backend_network_init(stream, cmd)
    else:
        raise InfrastructureError(f"not a collective command: {type(cmd).__name__}")


def destroy() -> None:
    """Tear down this process's collective state (worker `Exit`): groups, store masters."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("destroying the process group failed: %s", e)
    with _masters_lock:
        _masters.clear()
