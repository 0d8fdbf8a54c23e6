"""Mesh tensors: plain torch on every rank of a 2 x 2 mesh, a reduction, a pipeline hand-off.

Under ``with mesh.activate():`` torch calls make and use tensors that live on every rank
of the mesh; the program only holds their shapes. ``palatine.inspect`` brings one rank's
value back. See docs/tensors.md.

Run: python examples/mesh_tensors.py
"""

import torch

import palatine


def main() -> None:
    with palatine.local_mesh(hosts=2, procs_per_host=2) as root:
        # hosts are data-parallel replicas (dp), the procs of a host pipeline stages (pp)
        mesh = root.rename(host="dp", proc="pp")
        with mesh.activate():
            rank = mesh.rank(("dp", "pp"))  # 0..3: a 0-dim tensor on every rank
            x = torch.arange(4.0) + 10 * rank  # each rank computes its own x
            print("x at dp=1, pp=0:", palatine.inspect(x, dp=1, pp=0).tolist())

            # Sum over dp: the two ranks that share a pp coordinate add their x.
            total = x.reduce("dp", "sum")
            for pp in range(2):
                got = palatine.inspect(total, dp=0, pp=pp).tolist()
                print(f"sum over dp at pp={pp}:", got)
                assert got == [float(2 * i + 20 * pp + 20) for i in range(4)], got

        # A two-stage pipeline: stage 0 computes, stage 1 continues from its output.
        stage0, stage1 = mesh(pp=0), mesh(pp=1)
        with stage0.activate():
            act = (x.slice_mesh(pp=0) - 11).relu()  # x as the ranks of stage 0 hold it
        moved = act.to_mesh(stage1)  # dp=d of stage 0 sends to dp=d of stage 1
        with stage1.activate():
            out = moved * 2
        for dp in range(2):
            got = palatine.inspect(out, dp=dp).tolist()
            print(f"stage 1 output at dp={dp}:", got)
            assert got == [2.0 * max(0, 20 * dp + i - 11) for i in range(4)], got


if __name__ == "__main__":
    main()
