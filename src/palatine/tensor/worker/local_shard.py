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
from palatine.tensor.worker.values import SeqError

__all__ = ["local_shard", "register", "unregister"]

# Guards `_workers`: world name -> that world's streams in this proc (id -> stream).
_lock = threading.Lock()
_workers: dict[str, dict[int, Any]] = {}


def register(world: str, streams: dict[int, Any]) -> None:
    """The worker actor of ``world`` in this proc runs ``streams`` (its live table)."""
    with _lock:
        _workers[world] = streams


def unregister(world: str) -> None:
    with _lock:
        _workers.pop(world, None)


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
