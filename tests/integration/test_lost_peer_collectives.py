"""A rank lost in the middle of a collective: every survivor's error is the lost rank's
`DeviceException`, in milliseconds, whatever gloo raised first; nothing hangs in
palatine's own reduce; `recover()` and the next reduce work at once.

Each test runs a script as a user would, on a real local mesh, and kills a worker with
SIGKILL from outside while the other ranks wait for it inside a collective."""

from __future__ import annotations

import pytest
from user_scripts import MESH_HELPERS, run_script

pytestmark = pytest.mark.timeout(240)

PRELUDE = (
    MESH_HELPERS
    + """
    import torch.distributed as dist

    def ones(rank):
        import torch
        return torch.ones(3) * float(rank)

    def busy(rank, who):
        # the rank ``who`` stays busy on its stream: the others wait for it in what follows
        if int(rank) == who:
            time.sleep(60)
        return 0

    def all_reduce_sum(t, group):
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    def outcome(fut, t_kill):
        try:
            fut.result(timeout=60)
            return "ok"
        except DeviceException as e:
            return f"DeviceException:{e.rank}:{time.monotonic() - t_kill:.2f}"
        except Exception as e:
            return f"{type(e).__name__}:{str(e).splitlines()[0][:120]}"
"""
)


def _check_rounds(lines: dict[str, str], rounds: int, bound_s: float = 2.0) -> None:
    for i in range(rounds):
        victim = int(lines[f"VICTIM{i}"])
        seen = lines[f"SEEN{i}"].split()
        assert len(seen) == 3, seen
        for s in seen:
            kind, rank, took = s.split(":")
            assert kind == "DeviceException" and int(rank) == victim, (i, seen)
            assert float(took) < bound_s, (i, seen)
        assert lines[f"RECOVERED{i}"] == f"[{victim}]", lines
        assert lines[f"SUM{i}"] == "[6.0, 6.0, 6.0]", lines


REDUCE = 'v.reduce("proc", op="sum")'
USERS = "remote(all_reduce_sum)(v, mesh.process_group())"


@pytest.mark.parametrize(
    ("collective", "rounds"), [(REDUCE, 5), (USERS, 3)], ids=["palatines-reduce", "users-own"]
)
def test_a_rank_killed_while_the_others_wait_for_it_in_a_collective_fails_them_all_alike(
    collective: str, rounds: int
) -> None:
    lines, _ = run_script(
        PRELUDE
        + f"""
    with local_mesh(1, 4) as mesh:
        with mesh.activate():
            v = remote(ones)(mesh.rank("proc"))
            for i in range({rounds}):
                victim = 1 + i % 3
                pids = pids_of(mesh)
                warm = fetch({collective}, shard=0).result(timeout=60)
                assert warm.tolist() == [6.0] * 3, warm
                remote(busy)(mesh.rank("proc"), victim)
                total = {collective}
                others = [r for r in range(4) if r != victim]
                futs = [fetch(total, shard=r) for r in others]
                time.sleep(0.5)  # the others wait for the victim in the collective by now
                os.kill(pids[victim], signal.SIGKILL)
                t_kill = time.monotonic()
                print(f"VICTIM{{i}}", victim)
                print(f"SEEN{{i}}", " ".join(outcome(f, t_kill) for f in futs))
                print(f"RECOVERED{{i}}", mesh.recover().ranks)
                v.restore(ones, mesh.rank("proc"))
                s = fetch(v.reduce("proc", op="sum"), shard=victim).result(timeout=30)
                print(f"SUM{{i}}", s.tolist())
    """
    )
    _check_rounds(lines, rounds)
