"""Actor benchmarks for palatine, with the same program shape as bench/peers/*.py.

Run with the project's interpreter::

    .venv/bin/python bench/actor_calls.py [--only METRIC] [--reps N]

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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _actor_shape import run  # noqa: E402

from palatine import Actor, endpoint, this_host  # noqa: E402

IMPL = "palatine"
VERSION = metadata.version("palatine")


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
    run(__doc__.splitlines()[0], IMPL, VERSION, Echo, this_host, fault_times)


if __name__ == "__main__":
    main()
