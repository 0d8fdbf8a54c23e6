"""Resources in heartbeats from procs on other machines: on the namespace test bed, the
system (here) sees each node's procs' CPU and memory, as `palatine top` shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import cloudpickle
import pytest

from palatine import Actor, endpoint
from palatine.testing.bedroles import roles_on_bed

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Busy(Actor):
    @endpoint
    def burn(self, seconds: float) -> int:
        """Keep a core busy for ``seconds``; its pid."""
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += 1
        return os.getpid()


def snapshot(addr: str, token: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "palatine", "snapshot", "--system-addr", addr, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PALATINE_CLUSTER_TOKEN": token},
        check=True,
    )
    return dict(json.loads(out.stdout))


def test_the_system_sees_cpu_and_memory_of_procs_on_every_node(bed: Any) -> None:
    from palatine.job.jobhosts import JobHosts

    with roles_on_bed(bed, interval_s=0.5) as roles:
        hosts = JobHosts(roles.system_addr, roles.token, "hostworker", 2, sys.executable)
        try:
            busy = hosts.spawn_procs({"procs": 1}).spawn("busy", Busy)
            pids = list(busy.burn.call(0.0).get().values())
            burning = busy.burn.call(6.0)  # a core busy on each node meanwhile
            deadline = time.monotonic() + 5.5
            while True:
                snap = snapshot(roles.system_addr, roles.token)
                seen = {
                    p["pid"]: (p["host_proc"], p.get("resources") or {})
                    for w in snap["worlds"].values()
                    for p in w["procs"].values()
                    if p.get("pid") in pids
                }
                if len(seen) == 2 and all(
                    r.get("rss_bytes", 0) > 0 and r.get("cpu_percent", 0) > 20
                    for _, r in seen.values()
                ):
                    break
                assert time.monotonic() < deadline, seen
                time.sleep(0.2)
            # one proc on each node's host
            assert len({host for host, _ in seen.values()}) == 2, seen
            assert sorted(burning.get().values()) == sorted(pids)
        finally:
            hosts.close()
