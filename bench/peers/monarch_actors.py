"""Actor benchmarks for Monarch (``pip install torchmonarch``), whose API palatine mirrors.

Run with the peers' interpreter (see bench/requirements-peers.txt)::

    bench/.peers-venv/bin/python bench/peers/monarch_actors.py [--only METRIC] [--reps N]

Program shape (the same for every implementation, see BENCHMARKS.md):

* ``1_1_actor_calls_sync``: a 1-proc mesh; the caller does ``call_one(i).get()`` one at a time.
* ``1_1_actor_calls_async``: same actor; 1,000 ``call_one`` futures issued, then all gathered.
* ``cast_gather_4``: a 4-proc mesh; ``mesh.ping.call(i).get()`` one at a time (ms per op).
* ``spawn_4_to_first_call_s``: ``spawn_procs`` (4 procs) + ``spawn`` + the first ``call().get()``
  on the whole mesh returning; the caller's runtime is already up (no cold interpreter).
* ``detect_sigkill_s``: a 4-proc mesh, a pending call to rank 1, rank 1's process SIGKILLed;
  time until that call raises in the caller (capped at 30 s).

Every endpoint is a plain ``def`` taking and returning a small int.
"""

from __future__ import annotations

import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import monarch.actor  # noqa: E402
from _actor_shape import run  # noqa: E402
from monarch.actor import Actor, endpoint, this_host  # noqa: E402

IMPL = "torchmonarch"
VERSION = metadata.version("torchmonarch")


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def main() -> None:
    fault_times: list[float] = []
    # Unhandled supervision faults would otherwise exit this process (Monarch's default hook);
    # the detect benchmark provokes one on purpose, so it is recorded and dropped here.

    def _record_fault(failure: Any) -> None:
        fault_times.append(time.monotonic())

    monarch.actor.unhandled_fault_hook = _record_fault  # type: ignore[assignment]
    run(__doc__.splitlines()[0], IMPL, VERSION, Echo, this_host, fault_times)


if __name__ == "__main__":
    main()
