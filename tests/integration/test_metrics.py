"""The system's Prometheus metrics (``--metrics-addr``), scraped with prometheus_client's
own parser: procs by world and health, a killed worker counted and shown; the read-only
scrape token is served, the cluster token refused (403), a wrong token refused (401), and
the server serves on; what workers publish with ``palatine.metrics`` is served per world
and rank; an idle connection does not stall a scrape; under TLS the endpoint is HTTPS."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import stat
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from prometheus_client.parser import text_string_to_metric_families

from palatine import Actor, endpoint, fetch, local_mesh, remote
from palatine.job import LocalJob

pytestmark = pytest.mark.timeout(120)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def scrape(
    addr: str, token: str, scheme: str = "http", context: ssl.SSLContext | None = None
) -> tuple[int, str]:
    req = urllib.request.Request(
        f"{scheme}://{addr}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
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
        ready = cluster.procs[0].ready
        addr = ready["metrics_addr"]
        token_file = Path(ready["metrics_token_file"])
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        cluster_token = cluster.env["PALATINE_CLUSTER_TOKEN"]
        assert token != cluster_token
        status, text = scrape(addr, "0" * 64)
        assert status == 401 and "authentication failed" in text
        status, text = scrape(addr, cluster_token)
        assert status == 403 and "not a scrape token" in text
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


def metrics_of(mesh: Any) -> tuple[str, str]:
    """The mesh system's metrics address and scrape token, as its ready line says."""
    cluster = mesh._local
    assert cluster is not None and cluster.procs[0].ready is not None
    ready = cluster.procs[0].ready
    return ready["metrics_addr"], Path(ready["metrics_token_file"]).read_text().strip()


def by_rank(text: str, name: str, **labels: str) -> dict[str, float]:
    """``name``'s samples of world ``worker`` with ``labels``, by rank (host ignored)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            rest = {k: v for k, v in s.labels.items() if k not in ("rank", "host")}
            if s.name == name and rest == {"world": "worker", **labels}:
                out[s.labels["rank"]] = s.value
    return out


def test_worker_metrics_are_served_per_world_and_rank() -> None:
    with local_mesh(1, 2, metrics_addr="127.0.0.1:0") as mesh:
        addr, token = metrics_of(mesh)

        def publish(step: int) -> None:
            """What a training loop on a worker publishes (run there by ``remote``)."""
            from palatine.hosting import user_metrics as metrics

            metrics.counter("steps").inc()
            metrics.gauge("loss").set(1.0 / (step + 1))
            metrics.histogram("step_seconds", buckets=(0.1, 1.0)).observe(0.5)

        with mesh.activate():
            for step in range(3):
                done = remote(publish)(step)
            fetch(done, shard={"host": 0, "proc": 1}).result(30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = scrape(addr, token)[1]
            if by_rank(text, "palatine_user_steps_total") == {"0": 3, "1": 3}:
                break
            time.sleep(0.2)
        assert by_rank(text, "palatine_user_steps_total") == {"0": 3, "1": 3}, text
        assert by_rank(text, "palatine_user_loss") == {"0": 1 / 3, "1": 1 / 3}
        assert by_rank(text, "palatine_user_step_seconds_count") == {"0": 3, "1": 3}
        assert by_rank(text, "palatine_user_step_seconds_sum") == {"0": 1.5, "1": 1.5}
        assert by_rank(text, "palatine_user_step_seconds_bucket", le="0.1") == {"0": 0, "1": 0}
        assert by_rank(text, "palatine_user_step_seconds_bucket", le="1.0") == {"0": 3, "1": 3}
        assert by_rank(text, "palatine_user_step_seconds_bucket", le="+Inf") == {"0": 3, "1": 3}


def test_an_idle_connection_does_not_stall_a_scrape() -> None:
    with local_mesh(1, 1, metrics_addr="127.0.0.1:0") as mesh:
        addr, token = metrics_of(mesh)
        host, _, port = addr.rpartition(":")
        idle = socket.create_connection((host, int(port)), timeout=5)
        half = socket.create_connection((host, int(port)), timeout=5)
        try:
            half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            start = time.monotonic()
            status, text = scrape(addr, token)
            assert status == 200, text
            assert time.monotonic() - start < 1.0
        finally:
            idle.close()
            half.close()


async def test_under_tls_the_endpoint_is_https(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from palatine.channel.token import generate_token, reset_token_cache, set_token
    from palatine.system.metrics import MetricsServer
    from palatine.system.service import System
    from palatine.testing.certs import make_node_pki

    env = make_node_pki(tmp_path / "pki", ["127.0.0.1"])["127.0.0.1"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PALATINE_METRICS_TOKEN_FILE", str(tmp_path / "metrics-token"))
    set_token(generate_token())
    handle = await System.serve("tls:127.0.0.1:0")
    try:
        server = await asyncio.to_thread(
            MetricsServer, "127.0.0.1", 0, handle.proc, handle.actor.reg
        )
        try:
            assert server.scheme == "https"
            token = (tmp_path / "metrics-token").read_text().strip()
            trusting = ssl.create_default_context(cafile=env["PALATINE_TLS_CA"])
            status, text = await asyncio.to_thread(scrape, server.addr, token, "https", trusting)
            assert status == 200 and "palatine_worlds" in text, text
            with pytest.raises(OSError):  # plain HTTP gets no answer
                await asyncio.to_thread(
                    urllib.request.urlopen, f"http://{server.addr}/metrics", timeout=5
                )
        finally:
            await asyncio.to_thread(server.close)
    finally:
        await handle.close()
        reset_token_cache()


class Stepper(Actor):
    """An actor that counts its steps with ``palatine.metrics``."""

    @endpoint
    def step(self, n: int) -> None:
        from palatine.hosting import user_metrics as metrics

        metrics.counter("actor_steps").inc(n)


def test_actor_metrics_are_served_by_their_proc_mesh_world_and_rank() -> None:
    with LocalJob(hosts=1, procs_per_host=1, metrics_addr="127.0.0.1:0") as job:
        assert job.metrics is not None and job.metrics.url.startswith("http://")
        token = Path(job.metrics.token_file).read_text().strip()
        procs = job.host_mesh().spawn_procs(per_host={"procs": 2})
        steppers = procs.spawn("stepper", Stepper)
        steppers.step.call(5).get(timeout=60)
        addr = job.metrics.url.removeprefix("http://").removesuffix("/metrics")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            got = [
                (s.labels["rank"], s.value)
                for family in text_string_to_metric_families(scrape(addr, token)[1])
                for s in family.samples
                if s.name == "palatine_user_actor_steps_total"
            ]
            if sorted(got) == [("0", 5.0), ("1", 5.0)]:
                break
            time.sleep(0.2)
        assert sorted(got) == [("0", 5.0), ("1", 5.0)]
        procs.stop().get(timeout=30)
