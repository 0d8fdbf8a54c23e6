"""`DeviceMesh` and `Stream`: where remote calls run.

A mesh covers worker-world ranks laid out row-major over named dims (``host``,
``proc``); sub-meshes share the session. As in Monarch, a mesh is reshaped by name:
``mesh.slice(host=0)`` (or ``mesh(host=0)``), ``mesh.split(host=("dp", "pp"), pp=2)``,
``mesh.rename(proc="gpu")``, ``mesh.flatten("rank")`` (the arithmetic is
`palatine.tensor.client.shapes`); each is a mesh remote calls, ranks, process groups and
reductions work on by its own dim names. ``with mesh.activate():`` makes it the mesh
remote calls run on (a context variable, so it nests and is per thread/task).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import time
from collections.abc import Sequence
from typing import Any

from palatine.config import roles
from palatine.hosting.child_env import Handoff
from palatine.protocol.worker import CreateDeviceMesh, CreateStream, Slice
from palatine.tensor.client import shapes
from palatine.tensor.client.activation import activate
from palatine.tensor.client.collectives import process_group, reduce
from palatine.tensor.client.context import get_active_mesh
from palatine.tensor.client.remote import remote, restore
from palatine.tensor.client.session import Handle, Session, Stream
from palatine.tensor.client.shapes import MeshShape
from palatine.tensor.client.shutdown import LocalRoles, shutdown_at_exit, shutdown_session
from palatine.tensor.worker.values import import_torch

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
    """Ranks of the worker world over named dims; a context manager that shuts down.

    ``names``, ``sizes``, ``strides`` and ``offset`` place rank ``offset + Σ idx·stride``
    at each index ``idx`` (row-major); a sub-mesh's are exact, since the workers build
    their view of it (coordinates, process-group members) from them alone."""

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
            strides = list(shapes.row_major_strides(sizes))
        self.strides = list(strides)
        self.slice_spec = Slice(offset=offset, sizes=self.sizes, strides=self.strides)
        self.ranks = self.slice_spec.ranks()
        self._local = local
        shutdown_at_exit(session, local)  # a program that never shuts it down ends cleanly
        self._handle: _MeshHandle | None = None
        self._groups: dict[tuple[str, ...], Any] = {}

    # ------------------------------------------------------------ the job
    @property
    def system_addr(self) -> str:
        """The address of the job's system (what ``palatine top --system-addr`` takes)."""
        return str(self.session.system_client.system_addr)

    @property
    def dashboard_url(self) -> str | None:
        """The link to the job's web dashboard (with its token), when this program
        started one (``local_mesh(dashboard=True)``); else None (``palatine dashboard``
        serves one for any job)."""
        url = getattr(self._local, "dashboard_url", None)
        return url if isinstance(url, str) and url else None

    @property
    def job_id(self) -> str | None:
        """The job's id, as ``palatine ps`` lists it and ``--job`` takes it (a local
        mesh's execution id; the job id ``palatine launch`` or a `SlurmJob` hands over);
        None for a mesh attached to a system of no known job."""
        env = dict(os.environ) | dict(getattr(self._local, "env", None) or {})
        handed = Handoff.from_env(env)
        return handed.execution_id or handed.job_id or None

    # ------------------------------------------------------------ shape
    @property
    def _shape(self) -> MeshShape:
        return MeshShape(tuple(self.names), tuple(self.sizes), tuple(self.strides), self.offset)

    def _where(self) -> str:
        return f"mesh of world {self.session.worker_world}"

    def _with_shape(self, shape: MeshShape) -> DeviceMesh:
        """A sub-mesh of the same session over ``shape`` (its ranks are this mesh's)."""
        return DeviceMesh(
            self.session,
            list(shape.names),
            list(shape.sizes),
            shape.offset,
            list(shape.strides),
            self._local,
        )

    def __len__(self) -> int:
        return len(self.ranks)

    def size(
        self, dims: str | Sequence[str] | None = None, *, dim: str | Sequence[str] | None = None
    ) -> int:
        """The size of ``dims``: one dim's size, the product of several dims' sizes, or
        (None) the number of ranks. ``dim`` is another spelling (Monarch's)."""
        if dim is not None:
            if dims is not None:
                raise TypeError("size() got both 'dims' and 'dim', two spellings of one option")
            dims = dim
        return shapes.size_of(self._shape, dims, self._where())

    def _dim(self, dim: str) -> int:
        return shapes.dim_index(self._shape, dim, self._where())

    def __repr__(self) -> str:
        dims = self._shape.describe()[1:-1]
        return f"<DeviceMesh {self.session.worker_world} {dims} ranks {self.ranks}>"

    def slice(self, **dims: int | builtins.slice) -> DeviceMesh:
        """A sub-mesh: an int removes the dim, a Python slice keeps it with the ranks it
        selects (``mesh.slice(host=0, gpu=slice(0, 2))``)."""
        return self._with_shape(shapes.slice_shape(self._shape, dims, self._where()))

    def __call__(self, **dims: int | builtins.slice) -> DeviceMesh:
        """`slice` (``mesh(host=0)``, as in Monarch)."""
        return self.slice(**dims)

    def split(self, **dims: Sequence[str] | int) -> DeviceMesh:
        """The same ranks with dims split into new dims, row-major (the last new dim
        varies fastest): on ``host=2, gpu=4``, ``mesh.split(host=("dp", "pp"), pp=2)``
        has dims ``dp=1, pp=2, gpu=4``. A dim's key names its new dims; any other key
        sizes a new dim; per split dim one size may be left out (the dim's size divided
        by the others'). See `palatine.tensor.client.shapes.split`."""
        return self._with_shape(shapes.split(self._shape, dims, self._where()))

    def rename(self, **names: str) -> DeviceMesh:
        """The same ranks with dims renamed: ``mesh.rename(host="dp", gpu="tp")``."""
        return self._with_shape(shapes.rename(self._shape, names, self._where()))

    def flatten(self, name: str) -> DeviceMesh:
        """The same ranks, in the same order, over one dim ``name``; a ValueError when
        they are not evenly spaced (e.g. two of four columns of each row)."""
        return self._with_shape(shapes.flatten(self._shape, name, self._where()))

    # ------------------------------------------------------------ activation
    def activate(self) -> contextlib.AbstractContextManager[DeviceMesh]:
        """Make this the mesh remote calls run on, for a ``with`` block."""
        return activate(self)

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
        bound = s.bound_streams.get(name)  # (every op asks: no lock when it exists)
        if bound is not None:
            return bound
        with s.lock:
            sid = s.streams.get(name)
            if sid is None:
                sid = 0 if name == "main" else s.ids.new_stream()
                s.streams[name] = sid
                whole = Slice(offset=0, sizes=[s.world_size], strides=[1])
                s.send_commands([(whole, CreateStream(id=sid, name=name, default=name == "main"))])
            bound = s.bound_streams[name] = Stream(name, s, sid)
        return bound

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

    def rank(self, dim: str | Sequence[str]) -> Any:
        """Each worker's coordinate along ``dim`` (several: the row-major index over them,
        as in Monarch): a 0-dim int64 mesh tensor (`palatine.Tensor`), on the active
        mesh when one is active inside this one (else on this mesh). Where torch is not
        installed, a `RemoteValue` holding an int."""
        dims = (dim,) if isinstance(dim, str) else tuple(dim)
        for d in dims:
            self._dim(d)
        active = get_active_mesh()
        on = active if active is not None and set(active.ranks) <= set(self.ranks) else self
        if import_torch() is None:
            with on.activate():
                return remote("palatine.tensor.worker.functions.coordinate")(self.handle(), dims)
        propagation = importlib.import_module("palatine.tensor.client.propagation")
        with on.activate():
            return propagation.rank_tensor(self.handle(), dims)

    def process_group(self, dims: str | Sequence[str] | None = None) -> Any:
        """A remote value that is a torch ProcessGroup over ``dims`` (all dims: the mesh)."""
        return process_group(self, dims if dims is None or isinstance(dims, str) else tuple(dims))

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

    def exit(self, error: BaseException | None = None) -> None:
        """End the mesh, as Monarch's ``DeviceMesh.exit()`` does: `shutdown` (drain,
        detach, stop the worlds and a local mesh's processes); ``error``: what ended the
        program, if anything did. Idempotent. A sub-mesh (`slice`, `split`, `rename`,
        `flatten`) shares its session: its ``exit()`` ends the whole session, every mesh
        made from it included; later calls on any of them raise."""
        self.shutdown(error=error)
