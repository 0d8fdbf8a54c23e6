"""`DeviceMesh` and `Stream`: where remote calls run.

A mesh covers worker-world ranks laid out row-major over named dims (``host``,
``proc``); sub-meshes share the session. ``with mesh.activate():`` makes it the mesh
remote calls run on (a context variable, so it nests and is per thread/task).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from palatine.config import roles
from palatine.protocol.worker import CreateDeviceMesh, CreateStream, Slice
from palatine.tensor.client.collectives import process_group, reduce
from palatine.tensor.client.context import activated
from palatine.tensor.client.remote import remote, restore
from palatine.tensor.client.session import Handle, Session, Stream
from palatine.tensor.client.shutdown import LocalRoles, shutdown_at_exit, shutdown_session
from palatine.tensor.client.values import RemoteValue

__all__ = ["DeviceMesh"]


class _MeshHandle(Handle):
    """The worker-side device-mesh view of a `DeviceMesh` (created on first use)."""

    __slots__ = ()


class Recovery:
    """What `DeviceMesh.recover` did: the ranks it brought back, and how long it took."""

    __slots__ = ("ranks", "seconds")

    def __init__(self, ranks: list[int], seconds: float) -> None:
        self.ranks = ranks
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Recovery(ranks={self.ranks}, seconds={self.seconds:.2f})"


class DeviceMesh:
    """Ranks of the worker world over named dims; a context manager that shuts down."""

    def __init__(
        self,
        session: Session,
        names: list[str],
        sizes: list[int],
        offset: int = 0,
        strides: list[int] | None = None,
        local: LocalRoles | None = None,
    ) -> None:
        self.session = session
        self.names = list(names)
        self.sizes = list(sizes)
        self.offset = offset
        if strides is None:
            strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
        self.strides = list(strides)
        self.slice_spec = Slice(offset=offset, sizes=self.sizes, strides=self.strides)
        self.ranks = self.slice_spec.ranks()
        self._local = local
        shutdown_at_exit(session, local)  # a program that never shuts it down ends cleanly
        self._handle: _MeshHandle | None = None
        self._groups: dict[tuple[str, ...], Any] = {}

    # ------------------------------------------------------------ shape
    def __len__(self) -> int:
        return len(self.ranks)

    def size(self, dim: str | None = None) -> int:
        if dim is None:
            return len(self)
        return self.sizes[self._dim(dim)]

    def _dim(self, dim: str) -> int:
        try:
            return self.names.index(dim)
        except ValueError:
            raise ValueError(f"unknown dimension {dim!r}; this mesh has {self.names}") from None

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))
        return f"<DeviceMesh {self.session.worker_world} {dims} ranks {self.ranks}>"

    def slice(self, **dims: int | slice) -> DeviceMesh:
        """A sub-mesh: an int removes the dim, a Python slice keeps it."""
        names, sizes, strides, offset = [], [], [], self.offset
        for name in dims:
            self._dim(name)
        for i, name in enumerate(self.names):
            size, stride = self.sizes[i], self.strides[i]
            sel = dims.get(name)
            if sel is None:
                names.append(name)
                sizes.append(size)
                strides.append(stride)
            elif isinstance(sel, slice):
                start, stop, step = sel.indices(size)
                count = len(range(start, stop, step))
                if count == 0:
                    raise IndexError(f"empty slice {sel} of dimension {name!r} (size {size})")
                offset += start * stride
                names.append(name)
                sizes.append(count)
                strides.append(stride * step)
            else:
                if not -size <= sel < size:
                    raise IndexError(
                        f"index {sel} out of range for dimension {name!r} of size {size}"
                    )
                offset += (sel % size) * stride
        return DeviceMesh(self.session, names, sizes, offset, strides, self._local)

    # ------------------------------------------------------------ activation
    def activate(self) -> contextlib.AbstractContextManager[DeviceMesh]:
        """Make this the mesh remote calls run on, for a ``with`` block."""
        return activated(self)

    def __enter__(self) -> DeviceMesh:
        self._cm = self.activate()
        self._cm.__enter__()
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self._cm.__exit__(et, ev, tb)
        self.shutdown(error=ev)

    # ------------------------------------------------------------ streams, handles
    def stream(self, name: str) -> Stream:
        """The session's stream ``name`` (created on every rank on first use)."""
        s = self.session
        with s.lock:
            sid = s.streams.get(name)
            if sid is None:
                sid = 0 if name == "main" else s.ids.new_stream()
                s.streams[name] = sid
                whole = Slice(offset=0, sizes=[s.world_size], strides=[1])
                s.send_commands([(whole, CreateStream(id=sid, name=name, default=name == "main"))])
        return Stream(s, name, sid)

    def handle(self) -> _MeshHandle:
        """This mesh's device-mesh ref on its ranks (``CreateDeviceMesh`` on first use)."""
        if self._handle is None:
            s = self.session
            ref = s.ids.new_ref()
            s.send_commands(
                [
                    (
                        self.slice_spec,
                        CreateDeviceMesh(result=ref, names=self.names, ranks=self.slice_spec),
                    )
                ]
            )
            self._handle = _MeshHandle(s, ref)
            s.recovery.device_meshes.append((ref, list(self.names), self.slice_spec))
        return self._handle

    def rank(self, dim: str | tuple[str, ...]) -> RemoteValue:
        """Each worker's coordinate along ``dim`` (a tuple: row-major index over them)."""
        dims = (dim,) if isinstance(dim, str) else tuple(dim)
        for d in dims:
            self._dim(d)
        with self.activate():
            return remote("palatine.tensor.worker.functions.coordinate")(self.handle(), dims)  # type: ignore[no-any-return]

    def process_group(self, dims: str | tuple[str, ...] | None = None) -> Any:
        """A remote value that is a torch ProcessGroup over ``dims`` (all dims: the mesh)."""
        return process_group(self, dims)

    # `RemoteValue.reduce` of a value on this mesh (values sit below collectives).
    reduce_value = staticmethod(reduce)
    restore_value = staticmethod(restore)

    # ------------------------------------------------------------ recovery
    def recover(
        self,
        ranks: list[int] | None = None,
        timeout_s: float | None = None,
        *,
        timeout: float | None = None,
    ) -> Recovery:
        """Bring back the ranks this mesh lost (``ranks``, or every rank known dead and,
        after a `palatine.StuckWorkersException`, the stuck ranks not waiting in a
        collective) after a `palatine.DeviceException`, without restarting the job: each
        is respawned as a new incarnation on its host (on the least loaded live host of
        the mesh when its own is gone; a stuck rank is killed first) and joins a new
        generation of collectives (the next process group or reduce builds it over every
        rank).

        Values that lived on the lost ranks are lost there (using or fetching them there
        raises `palatine.errors.LostValue`; ``value.restore(make)`` makes them again) and
        stay valid on the other ranks; `palatine.resync` copies a model's and an
        optimizer's state from a surviving rank. Raises `palatine.errors.RecoveryError`,
        within ``timeout_s`` (default 120; ``timeout`` is its older name), when a rank
        cannot be brought back; the mesh stays failed."""
        wait_s = roles.renamed("recover", "timeout_s", timeout_s, "timeout", timeout)
        t0 = time.monotonic()
        back = self.session.recover(ranks, 120.0 if wait_s is None else wait_s)
        return Recovery(back, time.monotonic() - t0)

    # ------------------------------------------------------------ shutdown
    def shutdown(
        self,
        timeout_s: float | None = None,
        error: BaseException | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Drain, detach and stop the worlds (and a local mesh's processes), draining for
        at most ``timeout_s`` (default 30; ``timeout`` is its older name); ``error``: what
        ended the ``with`` block, if anything did (an interrupt drains nothing)."""
        wait_s = roles.renamed("shutdown", "timeout_s", timeout_s, "timeout", timeout)
        shutdown_session(self.session, self._local, 30.0 if wait_s is None else wait_s, error)
