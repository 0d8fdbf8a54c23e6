"""`get_or_spawn_controller`: one actor per name for the whole `this_host()` job.

A program often needs one coordinator that every actor can find (a parameter server, a
replay buffer, a rendezvous): Monarch's ``get_or_spawn_controller(name, Class, *args)``.
The first request spawns ``Class(*args)`` in a proc of its own; every later request,
from the script or from any actor of any of its meshes (nested ones too), gets the same
actor.

The registry of names is an actor on the system's own proc (`ControllerRegistry`), which
lives in the process that called `this_host()` first: the one authority every proc of
those meshes can reach, whose one-message-at-a-time queue makes "get or spawn" atomic.
"""

from __future__ import annotations

from typing import Any

from palatine.core import runtime
from palatine.core.actor import Actor, endpoint
from palatine.core.future import Future
from palatine.errors import MeshFailure, PalatineError
from palatine.hosting.child_env import Handoff
from palatine.ids import SYSTEM_PROC, ActorId
from palatine.job import hostmesh
from palatine.job.hostmesh import this_host
from palatine.job.procmesh import ProcMesh
from palatine.mesh.actor_mesh import ActorMesh, ActorRef

__all__ = ["ControllerRegistry", "get_or_spawn_controller", "REGISTRY_NAME"]

REGISTRY_NAME = "controllers"
REGISTRY = ActorId(SYSTEM_PROC, REGISTRY_NAME, 0)


class ControllerRegistry(Actor):
    """Name -> the controller actor spawned for it, and its one-proc mesh."""

    def __init__(self) -> None:
        self.spawned: dict[str, tuple[ActorMesh, type[Actor], ProcMesh]] = {}

    @endpoint
    def get_or_spawn(
        self, name: str, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ActorMesh:
        known = self.spawned.get(name)
        if known is not None:
            mesh, known_cls, _procs = known
            if known_cls.__qualname__ != cls.__qualname__:
                raise PalatineError(
                    f"controller {name!r} is a {known_cls.__qualname__}, not a {cls.__qualname__}"
                )
            return mesh
        procs = this_host().spawn_procs(per_host={"procs": 1})
        mesh = procs.spawn(name, cls, *args, **kwargs)
        self.spawned[name] = (mesh, cls, procs)
        return mesh

    def __supervise__(self, failure: MeshFailure) -> bool:
        """A controller failed: forget it (the next request spawns a fresh one); its
        callers see the failure on their calls."""
        for name, (mesh, _cls, _procs) in list(self.spawned.items()):
            if failure.actor_id.startswith(f"{mesh.gang.world}["):
                del self.spawned[name]
        return True


def get_or_spawn_controller(
    name: str, cls: type[Actor], *args: Any, **kwargs: Any
) -> Future[ActorMesh]:
    """The actor named ``name`` for this job: spawned as ``cls(*args, **kwargs)`` in a
    proc of its own on the first request, the same one afterwards (a one-actor
    `ActorMesh`; ``.get()`` or ``await`` it). Works in a script that uses `this_host()`
    and in every actor of its meshes."""
    if not Handoff.from_env().bootstrap_addr:  # not a mesh's proc: the script itself
        runtime.submit(hostmesh.ensure_cluster).get()
    return ActorRef(REGISTRY, ControllerRegistry).get_or_spawn.call_one(name, cls, args, kwargs)
