"""The system's Prometheus metrics (``--metrics-addr``), scraped with prometheus_client's
own parser: procs by world and health, a killed worker counted and shown; a wrong token
is refused and the server serves on."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from palatine import fetch, local_mesh, remote

pytestmark = pytest.mark.timeout(120)


def scrape(addr: str, token: str) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://{addr}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_show_procs_by_health_and_count_a_killed_worker() -> None:
    with local_mesh(1, 2, metrics_addr="127.0.0.1:0") as mesh:
        cluster = mesh._local
        assert cluster is not None and cluster.procs[0].ready is not None
        addr = cluster.procs[0].ready["metrics_addr"]
        token = cluster.env["PALATINE_CLUSTER_TOKEN"]
        status, text = scrape(addr, "0" * 64)
        assert status == 401 and "authentication failed" in text
        status, text = scrape(addr, token)
        assert status == 200, text
        got = samples(text)
        assert got[("palatine_procs", (("health", "Alive"), ("world", "worker")))] == 2
        assert got[("palatine_worlds", (("status", "Live"),))] >= 2  # worker, controller, ...
        ages = [v for (name, _), v in got.items() if name == "palatine_proc_heartbeat_age_seconds"]
        assert ages and all(0 <= a < 30 for a in ages)
        # the controller's invocations and the workers' delivered messages, as reported
        # with their heartbeats
        with mesh.activate():
            for i in range(50):
                y = remote(abs)(-i)
            assert fetch(y, shard={"host": 0, "proc": 0}).result() == 49
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            got = samples(scrape(addr, token)[1])
            calls = got.get(("palatine_controller_invocations_total", (("world", "controller"),)))
            if calls is not None and calls >= 51:
                break
            time.sleep(0.2)
        assert calls is not None and calls >= 51, got
        assert got[("palatine_controller_stalls_total", (("world", "controller"),))] == 0
        delivered = [
            v
            for (name, labels), v in got.items()
            if name == "palatine_proc_messages_delivered_total" and ("world", "worker") in labels
        ]
        assert len(delivered) == 2 and all(v > 0 for v in delivered), got
        with mesh.activate():
            pid = fetch(remote(os.getpid)(), shard={"host": 0, "proc": 1}).result()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = samples(scrape(addr, token)[1])
            if got.get(("palatine_failures_detected_total", (("kind", "signal"),))) == 1:
                break
            time.sleep(0.1)
        assert got[("palatine_failures_detected_total", (("kind", "signal"),))] == 1, got
        assert got[("palatine_procs", (("health", "Exited"), ("world", "worker")))] == 1
        status, _ = scrape(addr, token)  # still serving
        assert status == 200
