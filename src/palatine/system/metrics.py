"""Prometheus metrics of a running system, for dashboards and alerts.

``palatine system --metrics-addr HOST:PORT`` serves ``GET /metrics`` in Prometheus' text
format (`prometheus_client`), to requests that carry the cluster token
(``Authorization: Bearer <token>``; Prometheus: ``authorization: {credentials: ...}``):

* ``palatine_worlds{status}``: worlds by status;
* ``palatine_procs{world, health}``: procs by world and health;
* ``palatine_proc_heartbeat_age_seconds{world, proc, host}`` and
  ``palatine_proc_loop_lag_seconds{...}``: per live proc;
* ``palatine_failures_detected_total{kind}``: failures the system detected, by kind
  (``signal``, ``exit``, ``Expired``, ``actor``);
* ``palatine_proc_messages_delivered_total{world, proc, host}`` and
  ``palatine_proc_bytes_delivered_total{...}``: messages (and their payload bytes)
  delivered to each proc's actors, as its last heartbeat reported them;
* ``palatine_controller_invocations_total{world}`` and
  ``palatine_controller_stalls_total{world}``: what each tensor controller has accepted
  from its client, and the stalls it found (``world`` is the controller's world).

A scrape asks the system actor for a snapshot through the system proc's own mailbox
(bounded by `SCRAPE_TIMEOUT_S`), so the registry is read only on its loop. The HTTP
server is a thread `MetricsServer` owns and stops; a request without the token gets 401,
anything but ``GET /metrics`` 404 or 405, and the server serves on.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from palatine.channel.token import resolve_token
from palatine.core.proc import Proc
from palatine.ids import SYSTEM_ACTOR
from palatine.protocol.system import Snapshot, SystemSnapshot
from palatine.system.registry import SystemRegistry

__all__ = ["MetricsServer", "SystemCollector", "SCRAPE_TIMEOUT_S"]

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0


class SystemCollector(Collector):
    """The metric families of one scrape, from a snapshot and the detection counts."""

    def __init__(
        self, snapshot: Callable[[], SystemSnapshot], detections: Callable[[], dict[str, int]]
    ) -> None:
        self._snapshot = snapshot
        self._detections = detections

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        worlds = GaugeMetricFamily("palatine_worlds", "Worlds by status.", labels=["status"])
        procs = GaugeMetricFamily(
            "palatine_procs", "Procs by world and health.", labels=["world", "health"]
        )
        per_proc = ["world", "proc", "host"]
        age = GaugeMetricFamily(
            "palatine_proc_heartbeat_age_seconds",
            "Seconds since each live proc's last heartbeat.",
            labels=per_proc,
        )
        lag = GaugeMetricFamily(
            "palatine_proc_loop_lag_seconds",
            "Event-loop lag each live proc last reported.",
            labels=per_proc,
        )
        delivered, delivered_bytes = (
            CounterMetricFamily(
                f"palatine_proc_{what}_delivered",
                f"{doc} delivered to each proc's actors (as of its last heartbeat).",
                labels=per_proc,
            )
            for what, doc in (("messages", "Messages"), ("bytes", "Payload bytes"))
        )
        invocations = CounterMetricFamily(
            "palatine_controller_invocations",
            "Invocations each tensor controller accepted from its client.",
            labels=["world"],
        )
        stalls = CounterMetricFamily(
            "palatine_controller_stalls",
            "Stalls each tensor controller found (ranks alive but not progressing).",
            labels=["world"],
        )
        by_status: dict[str, int] = {}
        for name, world in snap.worlds.items():
            by_status[world.status] = by_status.get(world.status, 0) + 1
            by_health: dict[str, int] = {}
            for proc, entry in world.procs.items():
                by_health[entry.health] = by_health.get(entry.health, 0) + 1
                if entry.last_heartbeat_age_s is not None:
                    age.add_metric([name, proc, entry.host], entry.last_heartbeat_age_s)
                if entry.loop_lag_s is not None:
                    lag.add_metric([name, proc, entry.host], entry.loop_lag_s)
                c = entry.counters
                if "messages_delivered" in c:
                    delivered.add_metric([name, proc, entry.host], c["messages_delivered"])
                    delivered_bytes.add_metric([name, proc, entry.host], c["bytes_delivered"])
                if "controller_invocations" in c:
                    invocations.add_metric([name], c["controller_invocations"])
                    stalls.add_metric([name], c.get("controller_stalls", 0.0))
            for health, n in sorted(by_health.items()):
                procs.add_metric([name, health], n)
        for status, n in sorted(by_status.items()):
            worlds.add_metric([status], n)
        detected = CounterMetricFamily(
            "palatine_failures_detected", "Failures the system detected, by kind.", labels=["kind"]
        )
        for kind, n in sorted(self._detections().items()):
            detected.add_metric([kind], n)
        yield from (worlds, procs, age, lag, detected, delivered, delivered_bytes)
        yield from (invocations, stalls)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("metrics: " + format, *args)


class MetricsServer:
    """The HTTP thread serving one system's metrics; `close` stops it."""

    def __init__(self, host: str, port: int, proc: Proc, registry: SystemRegistry) -> None:
        self._loop = proc.loop
        self._client = proc.attach("metrics")
        collectors = CollectorRegistry(auto_describe=False)
        collectors.register(SystemCollector(self._scrape, lambda: dict(registry.detections)))
        self._app = make_wsgi_app(collectors)
        self._token = resolve_token()
        self._server: WSGIServer = make_server(
            host, port, self._guarded, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="palatine-metrics", daemon=True
        )
        self._thread.start()

    @property
    def addr(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def _scrape(self) -> SystemSnapshot:
        """A snapshot, asked of the system actor on its loop (from the HTTP thread)."""

        async def ask() -> SystemSnapshot:
            reply = await self._client.mailbox.ask(SYSTEM_ACTOR, Snapshot(), SCRAPE_TIMEOUT_S)
            assert isinstance(reply, SystemSnapshot)
            return reply

        return asyncio.run_coroutine_threadsafe(ask(), self._loop).result(SCRAPE_TIMEOUT_S + 1)

    def _guarded(self, environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        def answer(status: str, text: str) -> Iterator[bytes]:
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            yield (text + "\n").encode()

        if environ.get("PATH_INFO") != "/metrics":
            return answer("404 Not Found", "palatine metrics: only /metrics is served")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return answer("405 Method Not Allowed", "palatine metrics: GET /metrics only")
        given = environ.get("HTTP_AUTHORIZATION", "").removeprefix("Bearer ").strip().encode()
        if not hmac.compare_digest(given, self._token):
            return answer(
                "401 Unauthorized",
                "palatine metrics: authentication failed (cluster token mismatch?)",
            )
        try:
            return iter(self._app(environ, start_response))
        except Exception as e:  # noqa: BLE001 - one failed scrape is a 503, the server serves on
            return answer("503 Service Unavailable", f"palatine metrics: {e}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
