"""Big values: fetched ones go from the worker to the client directly, from the worker's own
memory: the controller holds no copy, the worker makes no snapshot, and the stream
waits until the value is received, so what it runs next cannot change what was sent.
Small values keep the controller's path. And a proc sending big actor results keeps
its heartbeats flowing. Each run is a user's script in a fresh interpreter on a real
mesh."""

from __future__ import annotations

import pytest
from user_scripts import run_script

pytestmark = pytest.mark.timeout(150)


SCRIPT = """
    import torch
    from palatine import fetch, local_mesh, remote
    from palatine.tensor.client.results import Results

    direct = []  # the values that came from the worker itself
    received = Results.on_fetched_value
    Results.on_fetched_value = lambda self, msg: (direct.append(msg.seq), received(self, msg))[1]

    def make(n):
        import torch
        return torch.arange(n, dtype=torch.float32)

    def bump(t):
        t.add_(1)

    def blob(n):
        return bytes(range(256)) * (n // 256)

    def as_list(t):
        return [t, {"twice": t * 2}]

    N = 1 << 22  # 16 MiB: over the 1 MiB from which values go directly
    want = torch.arange(N, dtype=torch.float32)  # here: under activate it would be a mesh tensor

    with local_mesh(1, 2) as mesh:
        with mesh.activate():
            t = remote(make)(N)
            first = fetch(t, shard=1)
            remote(bump, mutates=("t",))(t)  # on the same stream, after the fetch
            second = fetch(t, shard=1)
            print("FIRST", bool(torch.equal(first.result(60), want)))
            print("SECOND", bool(torch.equal(second.result(60), want + 1)))
            nested = fetch(remote(as_list)(t), shard=0).result(60)
            print("NESTED", bool(torch.equal(nested[1]["twice"], (want + 1) * 2)))
            data = fetch(remote(blob)(N), shard=1).result(60)  # a big bytes: out of band too
            print("BYTES", type(data).__name__, data == bytes(range(256)) * (N // 256))
            small = fetch(remote(make)(16), shard=0).result(60)
            print("SMALL", small.tolist()[-1])
            results = mesh.session.results
            print("LEFT", len(results.arrived), len(results.awaited), len(results.pending))
            print("DIRECT", len(direct))
"""


def test_a_big_fetch_is_received_as_it_was_when_fetched_and_small_ones_still_arrive() -> None:
    out, _ = run_script(SCRIPT)
    assert out["FIRST"] == "True"  # the in-place bump ran only once it was received
    assert out["SECOND"] == "True"
    assert out["NESTED"] == "True"
    assert out["SMALL"] == "15.0"
    assert out["LEFT"] == "0 0 0"
    assert out["BYTES"] == "bytes True"
    assert out["DIRECT"] == "4"  # the four big ones; the small one came through the controller


def test_a_big_fetch_through_the_controller_when_direct_values_are_turned_off() -> None:
    out, _ = run_script(SCRIPT, env={"PALATINE_DIRECT_VALUE": str(1 << 40)})
    assert out["DIRECT"] == "0"
    assert out["BYTES"] == "bytes True"
    assert out["FIRST"] == "True"
    assert out["SECOND"] == "True"
    assert out["NESTED"] == "True"


def test_heartbeats_keep_flowing_while_an_actor_returns_big_results() -> None:
    # Heartbeats every 0.2 s, a proc declared dead after 1 s of silence: three 256 MiB
    # results (a few seconds of pickling, sending and receiving) must not silence it.
    out, _ = run_script(
        """
        import time
        import torch  # here, not on the event loop when the first tensor arrives
        from palatine import Actor, endpoint, this_host

        class Big(Actor):
            @endpoint
            def make(self, n):
                import torch
                return torch.ones(n, dtype=torch.uint8)

        procs = this_host().spawn_procs(per_host={"procs": 1})
        actor = procs.spawn("big", Big)
        actor.make.call_one(10).get(timeout=60)
        sizes = [actor.make.call_one(256 << 20).get(timeout=60).numel() for _ in range(3)]
        print("BIG", sizes == [256 << 20] * 3)
        print("AFTER", actor.make.call_one(5).get(timeout=30).numel())
        procs.stop().get(timeout=30)
        """,
        env={
            "PALATINE_SUPERVISION_UPDATE_INTERVAL": "0.2",
            "PALATINE_SUPERVISION_UPDATE_TIMEOUT": "1",
        },
    )
    assert out["BIG"] == "True"
    assert out["AFTER"] == "5"
