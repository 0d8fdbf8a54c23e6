"""The tensor worker: the actor that runs in every worker proc.

Layers inside this package, bottom up:

The commands a worker runs and the replies it sends are in `palatine.protocol.worker`.

* `user_errors` — what a worker says about a user error (palatine's frames removed).
* `values` — pickling with refs as persistent ids, tensors out of band, function
  resolution, user-error formatting. Shared by client and worker; no torch.
* `state` — the worker's state shared by its streams, and which stream runs on a thread.
* `collectives` — device mesh views and torch.distributed process groups (torch imported
  lazily, here and in `reduce` only); `reduce` — reductions over them.
* `stream` — one thread per stream executing commands in order over its refs table.
* `actor` — ``WorkerActor`` (registered as ``palatine.tensor.worker.WorkerActor``): routes
  commands to streams, drains the single outbox, answers progress queries, exits.

``worker_info()`` tells a remote function which worker and stream run it.
"""

from __future__ import annotations

from palatine.tensor.worker.actor import WorkerActor
from palatine.tensor.worker.state import worker_info

__all__ = ["WorkerActor", "worker_info"]
