"""Tensor engines on actor proc meshes: mesh tensors and actors in the same procs.

`spawn_tensor_engine(proc_mesh)` starts a controller for the procs of an actor proc mesh
(``palatine controller --adopt-world``: it spawns one tensor worker actor in each proc,
next to the actors already there, and leaves the procs running when it stops) and
attaches this client to it: a `DeviceMesh` over the proc mesh's dimensions. Torch ops
under its ``activate()`` run in the same processes as the actors, and a mesh tensor
passed to an actor endpoint there arrives as that proc's own shard
(`palatine.tensor.worker.local_shard`). `ProcMesh.activate()` spawns one on first use.

The controller is a process of its own, as for any mesh, started here with the system's
address and token; the engine's `DeviceMesh.shutdown()` (or the proc mesh's stop) ends
it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from palatine.channel import token as token_mod
from palatine.errors import SpawnError
from palatine.ids import ActorId
from palatine.tensor.client import actor_calls  # noqa: F401 - installs Endpoint.rref
from palatine.tensor.client.local import connect, want_cuda

if TYPE_CHECKING:
    from palatine.tensor.client.mesh import DeviceMesh

__all__ = ["spawn_tensor_engine"]


def spawn_tensor_engine(
    proc_mesh: Any, *, device: str = "auto", timeout_s: float = 60.0
) -> DeviceMesh:
    """A `DeviceMesh` whose tensor workers run in ``proc_mesh``'s procs (a `ProcMesh`,
    which imports this module: one worker per proc, its ranks in the proc mesh's order,
    its dims the proc mesh's). ``device``: ``auto`` (CUDA where this machine has a GPU),
    ``cpu`` or ``cuda``; on CUDA each worker takes the GPU of its rank on its host."""
    cuda = want_cuda(device)
    client = proc_mesh._client
    if client is None:
        raise SpawnError(f"{proc_mesh} was passed here: spawn its tensor engine where it was made")
    if proc_mesh._ranks is not None:
        raise SpawnError(f"{proc_mesh} is a slice: spawn the engine on the whole proc mesh")
    dims = list(proc_mesh._dims)
    n = 1
    for _, k in dims:
        n *= k
    addr = str(client.system_addr)
    world = proc_mesh.world.name
    token = token_mod.resolve_token(create=False)
    # Names of its own, for its controller's world and its workers: a proc mesh may have
    # an engine again after one ended, and the procs keep a stopped actor's name and a
    # route to the last engine's controller.
    tag = secrets.token_hex(3)
    controller = f"engine{world}_{tag}[0].root"
    env = {
        **os.environ,
        **token_mod.token_env(token),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    argv = [
        sys.executable,
        "-m",
        "palatine",
        "controller",
        "--worker-world",
        world,
        "--system-addr",
        addr,
        "--controller-actor-id",
        controller,
        "--world-size",
        str(n),
        "--num-procs-per-host",
        str(n),
        *([] if cuda else ["--is-cpu-worker"]),
        "--adopt-world",
        "--worker-name",
        f"tensor_worker_{tag}",
    ]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    tail: deque[str] = deque(maxlen=30)
    threading.Thread(
        target=lambda: tail.extend(proc.stderr or ()), name="engine-stderr", daemon=True
    ).start()
    _wait_ready(proc, tail, timeout_s, world)
    try:
        mesh = connect(
            addr,
            world,
            timeout_s=timeout_s,
            _dims=dims,
            _roles=_Controller(proc),
            _controller=ActorId.parse(controller),
        )
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    mesh.session.actors_colocated = True
    # A rank the engine recovers is a new incarnation of the proc mesh's proc: the proc
    # mesh's actors are spawned on it again, and its `respawn` goes through the engine.
    mesh.session.after_recovery = proc_mesh.respawned
    if proc_mesh._engine is None:
        proc_mesh._engine = mesh
    return mesh


class _Controller:
    """The engine's controller process, which the end of its session stops
    (`palatine.tensor.client.shutdown.LocalRoles`): it exits by itself once the session
    detached; a bounded wait, then a kill."""

    owns_worlds = False  # the procs and the system are the proc mesh's

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def stop(self, grace_s: float = 5.0, *, clean: bool = True) -> None:
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _wait_ready(
    proc: subprocess.Popen[str], tail: deque[str], timeout_s: float, world: str
) -> None:
    """Wait (at most ``timeout_s``) for the controller's ready line; its exit or the
    timeout is a `SpawnError` with its last stderr lines."""
    deadline = time.monotonic() + timeout_s
    got: list[str] = []
    reader = threading.Thread(
        target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""),
        name="engine-ready",
        daemon=True,
    )
    reader.start()
    while time.monotonic() < deadline:
        reader.join(0.05)
        if got:
            line = got[0]
            try:
                if json.loads(line).get("event") == "ready":
                    return
            except ValueError:
                pass
            break
        if proc.poll() is not None:
            break
    else:
        proc.kill()
    proc.wait(5)
    said = "\n".join(tail) or "(nothing on stderr)"
    raise SpawnError(
        f"the tensor engine of proc mesh {world} did not start (controller pid {proc.pid}, "
        f"exit {proc.returncode}):\n{said}"
    )
