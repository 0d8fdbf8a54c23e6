"""A mesh tensor passed to an actor in the same proc: that proc's own shard.

With a tensor engine on an actor proc mesh (`palatine.job.engine`), the tensor workers
live in the actors' procs. A mesh tensor in an actor call is pickled by the client as
(world, ref, stream, barrier seq): the barrier is a no-op on the tensor's stream, which
the client waits for before it sends the call, so every op issued before the call has
run. (Unpickling runs on the proc's loop, which also feeds the streams: it cannot wait
there.) The actor gets the stream's value itself, no copy: what the stream holds. The
worker actor of each world registers its streams here (`register`), and forgets them
when it stops.
"""

from __future__ import annotations

import threading
from typing import Any

from palatine.errors import RemoteException
from palatine.ids import GangId
from palatine.tensor.worker.state import current_stream
from palatine.tensor.worker.values import SeqError

__all__ = ["call_endpoint", "local_shard", "register", "unregister"]

# Guards `_workers` and `_procs`: world name -> that world's streams in this proc (id
# -> stream), and the proc its worker actor runs in.
_lock = threading.Lock()
_workers: dict[str, dict[int, Any]] = {}
_procs: dict[str, Any] = {}


def register(world: str, streams: dict[int, Any], proc: Any) -> None:
    """The worker actor of ``world`` in this proc (``proc``) runs ``streams`` (its live
    table)."""
    with _lock:
        _workers[world] = streams
        _procs[world] = proc


def unregister(world: str) -> None:
    with _lock:
        _workers.pop(world, None)
        _procs.pop(world, None)


def call_endpoint(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run endpoint ``name`` of the actor ``kwargs["__gang__"]`` names in this proc,
    on the calling stream's thread (`Endpoint.rref`: in order with the stream's ops; its
    arguments are this proc's shards). A plain ``def`` endpoint only: it runs here, not on
    the actor's loop, so it must not wait for the actor's other calls."""
    gang = kwargs.pop("__gang__")
    stream = current_stream()
    if stream is None:
        raise RuntimeError("call_endpoint runs on a tensor worker's stream")
    world = stream.worker.world
    with _lock:
        proc = _procs.get(world)
    if proc is None:
        raise LookupError(f"no tensor engine of world {world} in this proc")
    actor_id = GangId.parse(gang).actor(stream.worker.rank)
    inst = proc.instance(actor_id)
    if inst is None or inst.actor is None:
        raise LookupError(f"actor {actor_id} is not in this proc ({proc.proc_id})")
    fn = getattr(type(inst.actor), name, None)
    info = getattr(fn, "__palatine_endpoint__", None)
    if info is None:
        raise AttributeError(f"{type(inst.actor).__qualname__} has no endpoint {name!r}")
    if info.is_async:
        raise TypeError(f"rref calls plain def endpoints; {name!r} is async")
    return fn(inst.actor, *args, **kwargs)  # type: ignore[misc]


def local_shard(world: str, ref: int, stream: int, barrier: int) -> Any:
    """The value of ``ref`` on this proc's ``stream`` of ``world`` (which has run the
    ``barrier`` seq)."""
    with _lock:
        streams = _workers.get(world)
    if streams is None:
        raise LookupError(
            f"a mesh tensor of world {world} reached a proc without its tensor engine: "
            "pass mesh tensors to actors of the proc mesh the engine runs on"
        )
    s = streams.get(stream)
    if s is None:
        raise LookupError(f"stream {stream} of world {world} is not in this proc")
    if (s.last_completed_seq or -1) < barrier:  # the client waited for it: never here
        raise RuntimeError(
            f"mesh tensor r{ref}: stream {s.name} of rank {s.worker.rank} has not run "
            f"s{barrier}, which the call waited for"
        )
    v = s.refs.get(ref)
    if v is None:
        raise LookupError(f"ref r{ref} not found on stream {s.name} of rank {s.worker.rank}")
    if type(v) is SeqError:
        e = v.error
        raise RemoteException(e.exc_type, e.message, e.traceback, headline=e.function)
    return v
