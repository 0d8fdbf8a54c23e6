"""Fetching values: futures, shards, structures containing worker-side values, tensors.

Run: python examples/fetch.py
"""

import torch

from palatine import fetch, local_mesh, remote


def make(rank: torch.Tensor) -> torch.Tensor:
    """``rank`` is this worker's ``mesh.rank("proc")``: a 0-dim int64 tensor."""
    return torch.arange(4.0) + 10 * rank


def main() -> None:
    with local_mesh(hosts=1, procs_per_host=4) as mesh:
        t = remote(make)(mesh.rank("proc"))
        futures = [fetch(t, shard={"proc": p}) for p in range(4)]  # all in flight at once
        for p, f in enumerate(futures):
            print(p, f.result(timeout=30))
        # Any picklable structure: the worker substitutes its values before sending.
        print(fetch({"tensor": t, "note": "from rank 3"}, shard=3).result())
        total = t.reduce("proc", op="sum")  # a collective across the workers
        print("sum over ranks:", fetch(total).result())


if __name__ == "__main__":
    main()
