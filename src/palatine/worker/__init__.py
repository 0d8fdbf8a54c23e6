"""The tensor worker (40-worker-client.md §1): the actor that runs in every worker proc.

Layers inside this package, bottom up:

* `messages` — the protocol: commands the client sends (through the controller's
  ``Send``), replies the worker sends to the controller. Imported by the controller and
  the client; imports nothing above the wire layer.
* `values` — pickling with refs as persistent ids, tensors out of band, function
  resolution, user-error formatting. Shared by client and worker; no torch.
* `stream` — one thread per stream executing commands in order over its refs table.
* `collectives` — device mesh views and torch.distributed collectives (torch imported
  lazily, here only).
* `actor` — ``WorkerActor`` (registered as ``palatine.worker.WorkerActor``): routes
  commands to streams, drains the single outbox, answers progress queries, exits.

``worker_info()`` tells a remote function which worker and stream run it.
"""

from __future__ import annotations

from typing import Any

from palatine.worker.actor import WorkerActor

__all__ = ["WorkerActor", "worker_info"]


def worker_info() -> dict[str, Any]:
    """``{world, rank, world_size, local_rank, device, proc_id, stream}`` of the worker
    and stream running the calling remote function (RuntimeError elsewhere)."""
    from palatine.worker.stream import worker_info as info

    return info()
