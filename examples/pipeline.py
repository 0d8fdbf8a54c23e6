"""A two-stage pipeline trained with plain torch: each stage on its own half of a 2 x 2 mesh.

The hosts are data-parallel replicas (``dp``), the procs of a host the pipeline stages
(``pp``). Stage 0 (``pp=0``) holds the first layer, stage 1 (``pp=1``) the second. The
activations go forward with ``to_mesh``; ``loss.backward()`` brings their gradient back
to stage 0, as ``to_mesh`` is part of the graph. Each stage then averages its gradients
over ``dp`` and takes an SGD step. See docs/tensors.md.

Run: python examples/pipeline.py
"""

import torch
from torch import nn

import palatine


def main() -> None:
    with palatine.local_mesh(hosts=2, procs_per_host=2) as root:
        mesh = root.rename(host="dp", proc="pp")
        stage0, stage1 = mesh(pp=0), mesh(pp=1)
        with mesh.activate():
            palatine.random.set_manual_seed_remote(0)  # the same initial weights everywhere
        with stage0.activate():
            first = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        with stage1.activate():
            second = nn.Linear(16, 1)
        layers = [(stage0, first), (stage1, second)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for _, m in layers]
        with stage0.activate():
            # each dp replica draws its own data: the same teacher, different inputs
            x = torch.randn(32, 8) + mesh.rank("dp")
            teacher = torch.arange(8.0) / 8
            y = (x @ teacher).unsqueeze(1).to_mesh(stage1)  # the targets, where the loss is
        losses = []
        for step in range(60):
            for opt in opts:
                opt.zero_grad()
            h = first(x)  # stage 0
            out = second(h.to_mesh(stage1))  # stage 1
            loss = ((out - y) ** 2).mean()
            loss.backward()  # stage 1's backward, then stage 0's
            for _, m in layers:
                palatine.reduce_([p.grad for p in m.parameters()], "dp", "avg")
            for opt in opts:
                opt.step()
            if step in (0, 59):
                losses.append(palatine.inspect(loss.reduce("dp", "avg")).item())
        print(f"loss fell: {losses[1] < losses[0] / 4}")
        w = [palatine.inspect(first[0].weight, dp=d).tolist() for d in range(2)]
        print(f"replicas identical: {w[0] == w[1]}")


if __name__ == "__main__":
    main()
