"""What failures look like: remote errors with both tracebacks, and a killed worker.

Run: python examples/errors.py
"""

import os
import signal
import time
from typing import SupportsFloat, SupportsInt

from palatine import DeviceException, RemoteException, fetch, inspect, local_mesh, remote


def risky(rank: SupportsInt) -> float:
    # mesh.rank is a 0-dim tensor on the worker: as a tensor, 1 / 0 would be inf
    return 1 / (int(rank) - 1)  # rank 1 divides by zero


def plus(x: SupportsFloat, y: float) -> float:
    return float(x) + y


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def main() -> None:
    with local_mesh(hosts=1, procs_per_host=4) as mesh:
        r = mesh.rank("proc")
        bad = remote(risky)(r)
        dependent = remote(plus)(bad, 1.0)
        fine = remote(plus)(r, 1.0)
        try:
            fetch(dependent, shard=0).result()
        except RemoteException as e:
            print("RemoteException (worker traceback + where the call was issued):\n", e)
        print("independent values still fetch:", inspect(fine, shard=2))

    with local_mesh(hosts=1, procs_per_host=4) as mesh:
        pid = inspect(remote(os.getpid)(), shard=3)
        pending = fetch(remote(nap)(30.0))
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            pending.result()
        except DeviceException as e:
            print(f"after {time.monotonic() - t0:.3f} s: DeviceException({e.kind}): {e}")


if __name__ == "__main__":
    main()
