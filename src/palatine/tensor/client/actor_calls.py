"""Endpoints called from a tensor engine: ``mesh.<endpoint>.rref(...)`` and `as_endpoint`.

With a tensor engine on an actor proc mesh (`palatine.job.engine`), an endpoint of the
actors there can run as an op of the engine: on each proc's stream, in order with the
tensor ops around it, its mesh tensor arguments that proc's shards, and its results mesh
tensors shaped by the endpoint's ``propagate`` (``@endpoint(propagate=...)``, or
``as_endpoint(mesh.method, propagate=...)``): a shape function, or ``"inspect"`` for an
endpoint called for its effect (``rref`` returns None). Monarch's ``rref``.

The actor layer below cannot import this one: loading this module installs it as
`palatine.mesh.actor_mesh.RREF`, which ``Endpoint.rref`` calls.
"""

from __future__ import annotations

from typing import Any

from palatine.mesh import actor_mesh
from palatine.mesh.actor_mesh import ActorMesh, Endpoint
from palatine.tensor.client.context import get_active_mesh
from palatine.tensor.client.propagation import remote

__all__ = ["as_endpoint"]

_CALL = "palatine.tensor.worker.local_shard.call_endpoint"


class _Bound:
    """An endpoint with the ``propagate`` its ``rref`` calls use."""

    def __init__(self, endpoint: Endpoint[..., Any], propagate: Any) -> None:
        self._endpoint = endpoint
        self._propagate = propagate

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        ep = self._endpoint
        return _rref(ep._target._as_mesh(), ep._name, self._propagate, args, kwargs)


def as_endpoint(endpoint: Endpoint[..., Any], *, propagate: Any = None) -> _Bound:
    """``endpoint`` (``mesh.method``) with ``propagate`` for its ``.rref(...)`` calls (an
    endpoint not declared with one, or another shape for this call)."""
    return _Bound(endpoint, propagate)


def _rref(
    mesh: ActorMesh[Any], name: str, propagate: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    engine = get_active_mesh()
    if engine is None or not engine.session.actors_colocated:
        raise RuntimeError(
            f"{name}.rref(...) needs the tensor engine of its actors' procs active "
            "(with procs.activate())"
        )
    world = engine.session.worker_world
    if str(mesh.gang.world) != world:
        raise ValueError(
            f"{name}.rref(...): the actors run in world {mesh.gang.world}, the active "
            f"tensor engine in {world}"
        )
    if propagate in (None, "mocked", "cached"):
        raise ValueError(
            f"{name}.rref(...) needs the endpoint's result shapes: declare it with "
            "@endpoint(propagate=fn or 'inspect'), or use as_endpoint(mesh.method, "
            "propagate=...)"
        )
    if propagate == "inspect":  # Monarch's meaning here: a call for its effect, no result
        shape: Any = _nothing
    elif isinstance(propagate, str):
        raise ValueError(f"{name}.rref(...): unknown propagate {propagate!r}")
    else:
        shape = _without_name(propagate)
    return remote(_CALL, propagate=shape)(name, *args, __gang__=str(mesh.gang), **kwargs)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _without_name(propagate: Any) -> Any:
    def shape(name: str, *args: Any, __gang__: str, **kwargs: Any) -> Any:
        return propagate(*args, **kwargs)

    return shape


actor_mesh.RREF[0] = _rref
