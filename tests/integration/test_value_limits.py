"""One value has a size limit (``PALATINE_MAX_VALUE``): a bigger actor result or fetched
value fails that call, naming its size and the limit, and the proc serves on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    from palatine import Actor, RemoteException, endpoint, fetch, local_mesh, remote, this_host

    class Big(Actor):
        @endpoint
        def make(self, n):
            return bytearray(n)

    def tensor(n):
        import torch
        return torch.ones(n, dtype=torch.uint8)

    actor = this_host().spawn_procs(per_host={"procs": 1}).spawn("big", Big)
    try:
        actor.make.call_one(3 << 20).get(timeout=30)
    except RemoteException as e:
        print("ACTOR", str(e).splitlines()[0])
    print("ACTOR_AFTER", len(actor.make.call_one(512 << 10).get(timeout=30)))

    with local_mesh(1, 1) as mesh:
        try:
            fetch(remote(tensor)(3 << 20)).result(timeout=60)
        except RemoteException as e:
            print("FETCH", str(e).splitlines()[1])
        print("FETCH_AFTER", fetch(remote(tensor)(1000)).result(timeout=60).numel())
    """
)


def test_a_value_over_the_limit_fails_its_call_by_size_and_the_procs_serve_on() -> None:
    env = {**os.environ, "PALATINE_MAX_VALUE": "1MiB"}
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["ACTOR"] == (
        "ValueTooLarge: the result of make (a bytearray) is 3.0 MiB, over the limit of "
        "1.0 MiB for one value (PALATINE_MAX_VALUE) in mesh0[0].big[0]"
    )
    assert lines["ACTOR_AFTER"] == str(512 << 10)
    assert lines["FETCH"] == (
        "ValueTooLarge: the fetched value is 3.0 MiB, over the limit of 1.0 MiB for one "
        "value (PALATINE_MAX_VALUE)"
    )
    assert lines["FETCH_AFTER"] == "1000"
