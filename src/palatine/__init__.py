"""palatine: a single-controller distributed runtime for Python and PyTorch.

Layers (folders), bottom up; each imports only its own layer and those below it
(``tests/unit/test_layering.py`` checks this list against the code and the docs):

    0. errors, ids, config, output
    1. wire
    2. channel
    3. core
    4. fastpath
    5. mesh
    6. protocol, rdma
    7. hosting
    8. system
    9. tensor
    10. job, spmd
    11. cli, __main__

Public names are loaded lazily, so ``import palatine`` stays cheap for worker procs; the
``TYPE_CHECKING`` block below gives editors and type checkers the real types. Everything
not named in ``__all__`` is internal and may change.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "endpoint",
    "concurrent_endpoint",
    "handler",
    "this_host",
    "this_proc",
    "spawn_tensor_engine",
    "as_endpoint",
    "context",
    "current_rank",
    "current_size",
    "Point",
    "Extent",
    "Future",
    "ActorRef",
    "Endpoint",
    "ActorMesh",
    "ValueMesh",
    "System",
    "local_mesh",
    "connect",
    "remote",
    "fetch",
    "inspect",
    "DeviceMesh",
    "RemoteValue",
    "worker_info",
    "set_unhandled_fault_hook",
    "PalatineError",
    "RemoteException",
    "DeviceException",
    "StuckWorkersException",
    "TooManyOpenFiles",
    "ValueTooLarge",
    "SchedulerError",
    "CallTimeout",
    "HostMesh",
    "ProcMesh",
    "Stream",
    "Port",
    "PortReceiver",
    "Channel",
    "Accumulator",
    "send",
    "MeshFailure",
    "get_or_spawn_controller",
    "resync",
    "LostValue",
    "CoalescingError",
    "RecoveryError",
    "Tensor",
    "no_mesh",
    "get_active_mesh",
    "get_active_stream",
    "fetch_shard",
    "show",
    "call_on_shard_and_fetch",
    "reduce",
    "reduce_",
    "slice_mesh",
    "to_mesh",
    "grad_generator",
    "grad_function",
    "GradientGenerator",
    "gradient_execution_order",
    "OpaqueRef",
    "remote_autograd_function",
    "RemoteAutogradFunction",
    "coalescing",
    "Compiled",
]

if TYPE_CHECKING:
    from palatine.core.actor import (
        Actor,
        concurrent_endpoint,
        context,
        current_rank,
        current_size,
        endpoint,
        handler,
    )
    from palatine.core.future import Future
    from palatine.core.ports import Channel, Port, PortReceiver
    from palatine.core.shape import Extent, Point
    from palatine.core.supervision_hook import set_unhandled_fault_hook
    from palatine.errors import (
        CallTimeout,
        CoalescingError,
        DeviceException,
        LostValue,
        MeshFailure,
        PalatineError,
        RecoveryError,
        RemoteException,
        SchedulerError,
        StuckWorkersException,
        TooManyOpenFiles,
        ValueTooLarge,
    )
    from palatine.job.controllers import get_or_spawn_controller
    from palatine.job.engine import spawn_tensor_engine
    from palatine.job.hostmesh import HostMesh, this_host, this_proc
    from palatine.job.procmesh import ProcMesh
    from palatine.mesh.accumulator import Accumulator
    from palatine.mesh.actor_mesh import ActorMesh, ActorRef, Endpoint, ValueMesh, send
    from palatine.system.service import System
    from palatine.tensor.client.actor_calls import as_endpoint
    from palatine.tensor.client.autograd_function import (
        RemoteAutogradFunction,
        remote_autograd_function,
    )
    from palatine.tensor.client.coalescing import Compiled, coalescing
    from palatine.tensor.client.coalescing import compile as compile
    from palatine.tensor.client.collectives import resync
    from palatine.tensor.client.context import (
        get_active_mesh,
        get_active_stream,
        no_mesh,
    )
    from palatine.tensor.client.gradients import (
        GradientGenerator,
        grad_function,
        grad_generator,
        gradient_execution_order,
    )
    from palatine.tensor.client.local import connect, local_mesh
    from palatine.tensor.client.mesh import DeviceMesh
    from palatine.tensor.client.propagation import remote
    from palatine.tensor.client.remote import (
        call_on_shard_and_fetch,
        fetch,
        fetch_shard,
        inspect,
        show,
    )
    from palatine.tensor.client.session import Stream
    from palatine.tensor.client.tensor import Tensor
    from palatine.tensor.client.trees import reduce, reduce_, slice_mesh, to_mesh
    from palatine.tensor.client.values import RemoteValue
    from palatine.tensor.worker import worker_info
    from palatine.tensor.worker.opaque import OpaqueRef

_WHERE = {
    "Actor": "palatine.core.actor",
    "endpoint": "palatine.core.actor",
    "concurrent_endpoint": "palatine.core.actor",
    "handler": "palatine.core.actor",
    "context": "palatine.core.actor",
    "current_rank": "palatine.core.actor",
    "current_size": "palatine.core.actor",
    "Point": "palatine.core.shape",
    "Extent": "palatine.core.shape",
    "this_host": "palatine.job.hostmesh",
    "this_proc": "palatine.job.hostmesh",
    "spawn_tensor_engine": "palatine.job.engine",
    "as_endpoint": "palatine.tensor.client.actor_calls",
    "Future": "palatine.core.future",
    "ActorRef": "palatine.mesh.actor_mesh",
    "Endpoint": "palatine.mesh.actor_mesh",
    "ActorMesh": "palatine.mesh.actor_mesh",
    "ValueMesh": "palatine.mesh.actor_mesh",
    "System": "palatine.system.service",
    "local_mesh": "palatine.tensor.client",
    "connect": "palatine.tensor.client",
    "remote": "palatine.tensor.client.propagation",
    "fetch": "palatine.tensor.client",
    "inspect": "palatine.tensor.client",
    "DeviceMesh": "palatine.tensor.client",
    "RemoteValue": "palatine.tensor.client",
    "worker_info": "palatine.tensor.worker",
    "set_unhandled_fault_hook": "palatine.core.supervision_hook",
    "PalatineError": "palatine.errors",
    "RemoteException": "palatine.errors",
    "DeviceException": "palatine.errors",
    "StuckWorkersException": "palatine.errors",
    "TooManyOpenFiles": "palatine.errors",
    "ValueTooLarge": "palatine.errors",
    "SchedulerError": "palatine.errors",
    "CallTimeout": "palatine.errors",
    "HostMesh": "palatine.job.hostmesh",
    "ProcMesh": "palatine.job.procmesh",
    "Stream": "palatine.tensor.client",
    "Port": "palatine.core.ports",
    "PortReceiver": "palatine.core.ports",
    "Channel": "palatine.core.ports",
    "Accumulator": "palatine.mesh.accumulator",
    "send": "palatine.mesh.actor_mesh",
    "MeshFailure": "palatine.errors",
    "get_or_spawn_controller": "palatine.job.controllers",
    "resync": "palatine.tensor.client",
    "LostValue": "palatine.errors",
    "CoalescingError": "palatine.errors",
    "RecoveryError": "palatine.errors",
    # mesh tensors: their modules import torch, so they load on first use
    "Tensor": "palatine.tensor.client.tensor",
    "no_mesh": "palatine.tensor.client.context",
    "get_active_mesh": "palatine.tensor.client.context",
    "get_active_stream": "palatine.tensor.client.context",
    "fetch_shard": "palatine.tensor.client.remote",
    "show": "palatine.tensor.client.remote",
    "call_on_shard_and_fetch": "palatine.tensor.client.remote",
    "OpaqueRef": "palatine.tensor.worker.opaque",
    "remote_autograd_function": "palatine.tensor.client.autograd_function",
    "RemoteAutogradFunction": "palatine.tensor.client.autograd_function",
    "grad_generator": "palatine.tensor.client.gradients",
    "grad_function": "palatine.tensor.client.gradients",
    "GradientGenerator": "palatine.tensor.client.gradients",
    "gradient_execution_order": "palatine.tensor.client.gradients",
    "coalescing": "palatine.tensor.client.coalescing",
    "Compiled": "palatine.tensor.client.coalescing",
    # not in __all__: a star import must not shadow the builtin compile
    "compile": "palatine.tensor.client.coalescing",
    "reduce": "palatine.tensor.client.trees",
    "reduce_": "palatine.tensor.client.trees",
    "slice_mesh": "palatine.tensor.client.trees",
    "to_mesh": "palatine.tensor.client.trees",
}


#: Public submodules that live deeper in the tree: ``palatine.random`` is Monarch's
#: ``monarch.random`` (not in ``__all__``: a star import must not shadow the stdlib's);
#: ``palatine.metrics`` publishes a worker's or actor's own metrics.
_SUBMODULES = {
    "random": "palatine.tensor.client.random",
    "metrics": "palatine.hosting.user_metrics",  # counters, gauges, histograms of a job
}


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import palatine.random`` / ``from palatine.metrics import counter``: the import
    system finds these names as the modules `_SUBMODULES` points to (loaded then, not
    before: ``import palatine`` stays cheap)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        pkg, _, short = fullname.partition(".")
        if pkg == "palatine" and short in _SUBMODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return __getattr__(spec.name.partition(".")[2])

    def exec_module(self, module: Any) -> None:
        """Loaded already (`create_module` imported the real module)."""


sys.meta_path.append(_SubmoduleAlias())


def __getattr__(name: str) -> Any:
    sub = _SUBMODULES.get(name)
    if sub is not None:
        module = importlib.import_module(sub)
        sys.modules.setdefault(f"palatine.{name}", module)  # `from palatine.random import`
        globals()[name] = module
        return module
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'palatine' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
