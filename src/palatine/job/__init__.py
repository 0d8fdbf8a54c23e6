"""Jobs: where the hosts of a mesh come from.

`hostmesh` is the calling machine (`this_host()`), with an embedded system and proc
meshes of real OS processes (`procmesh`: what a proc mesh does, wherever its procs run;
`jobhosts`: a job's hosts as a host mesh; `controllers`: one actor per name for a
job); `local` (`LocalJob`) and `slurm` (`SlurmJob`) give a
`DeviceMesh` of worker procs on this machine or on nodes a Slurm cluster allocates, with
one lifecycle: ``apply``, ``state``, ``mesh``, ``cancel`` (or ``with``). The job classes
load on first use, so `this_host()` does not import the tensor engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palatine.job.local import LocalJob
    from palatine.job.slurm import SlurmJob

__all__ = ["LocalJob", "SlurmJob"]

_WHERE = {"LocalJob": "palatine.job.local", "SlurmJob": "palatine.job.slurm"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'palatine.job' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
