"""`setup_torch_elastic_env`: make a proc mesh's procs ranks of one torch process group."""

from __future__ import annotations

from palatine.job.procmesh import ProcMesh
from palatine.mesh.actor_mesh import ActorMesh
from palatine.spmd.actor import SPMDActor

__all__ = ["setup_torch_elastic_env"]


def setup_torch_elastic_env(
    proc_mesh: ProcMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    restart_count: int = 0,
) -> ActorMesh:
    """Set torchrun's variables on every proc of ``proc_mesh`` (``MASTER_ADDR`` and
    ``MASTER_PORT``: rank 0's machine and a port free there, unless given; ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``,
    ``TORCHELASTIC_RESTART_COUNT``...: `palatine.spmd.env.elastic_env`), so that actors
    spawned there afterwards call ``dist.init_process_group()`` from ``env://``.

    Returns the `SPMDActor` mesh it spawned to do so (``_spmd_env``), to run programs on."""
    actors = proc_mesh.spawn("_spmd_env", SPMDActor)
    first = actors.slice(**dict.fromkeys(proc_mesh.sizes, 0))
    addr, port = first.get_host_port.call_one(master_addr).get()
    if master_port is not None:
        port = master_port
    actors.setup_env.call(addr, port, restart_count).get()
    return actors
