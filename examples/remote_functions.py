"""Remote functions: run Python functions on every worker, chain worker-side values.

Run: python examples/remote_functions.py
"""

import os

from palatine import inspect, local_mesh, remote


def square(x: int) -> int:
    return x * x


@remote(returns=2)
def split(x: int) -> tuple[int, int]:
    return x // 2, x % 2


def main() -> None:
    with local_mesh(hosts=1, procs_per_host=4) as mesh:
        pids = remote(os.getpid)()  # a value on every worker, returned at once
        r = mesh.rank("proc")  # each worker's index along "proc": a 0-dim int64 tensor
        sq = remote(square)(r)  # worker-side values as arguments: no data moves
        half, odd = split(sq)  # several results
        for p in range(4):
            print(
                f"rank {p}: pid {inspect(pids, shard=p)}, r^2={inspect(sq, shard=p)}, "
                f"half={inspect(half, shard=p)}, odd={inspect(odd, shard=p)}"
            )
        # A sub-mesh: run only on the first two workers.
        with mesh.slice(proc=slice(0, 2)).activate():
            print("on a slice:", inspect(remote(square)(10)))


if __name__ == "__main__":
    main()
