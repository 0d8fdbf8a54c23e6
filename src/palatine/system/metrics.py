"""Prometheus metrics of a running system, for dashboards and alerts.

``palatine system --metrics-addr HOST:PORT`` serves ``GET /metrics`` in Prometheus' text
format (`prometheus_client`), to requests that carry the job's scrape token
(``Authorization: Bearer <token>``; Prometheus: ``authorization: {credentials_file: ...}``):

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
  from its client, and the stalls it found (``world`` is the controller's world);
* ``palatine_proc_cpu_percent{world, proc, host}``, ``palatine_proc_rss_bytes{...}`` and,
  where NVML is present, ``palatine_proc_gpu_util_percent{...}`` and
  ``palatine_proc_gpu_mem_bytes{...}``: what each live proc uses of its machine, as its
  last heartbeat said (`palatine.hosting.resources`);
* ``palatine_user_<name>{world, rank, host}``: what workers and actors published with
  ``palatine.metrics`` (`palatine.hosting.user_metrics`), one series per rank (sum them
  by ``world`` for the world's total); counters end in ``_total``, histograms have
  ``_bucket``, ``_sum`` and ``_count``.

Safe to scrape:

* The scrape token is read-only and never the cluster token (which lets its holder join
  and command the cluster): ``PALATINE_METRICS_TOKEN`` when a launcher sets it, else a
  fresh one per system. It is written with mode 0600 to ``PALATINE_METRICS_TOKEN_FILE``,
  else ``metrics-token`` in the job's log dir (``PALATINE_LOG_DIR``, beside a Slurm job's
  cluster token), else a private temp dir; the ready line says where
  (``metrics_token_file``). A request bearing the cluster token gets 403 (and a log line),
  one with no or another token 401.
* Each connection is served on its own thread, and a connection that sends nothing for
  `REQUEST_TIMEOUT_S` is dropped, so an idle or slow client cannot stall other scrapes.
* Under the ``tls`` transport the endpoint is HTTPS with the process's own certificate
  (``PALATINE_TLS_CERT``/``_KEY``); a client certificate is asked for but not required,
  since the token authenticates the scraper and Prometheus rarely holds the cluster's.

A scrape asks the system actor for a snapshot through the system proc's own mailbox
(bounded by `SCRAPE_TIMEOUT_S`), so the registry is read only on its loop. The server's
threads are `MetricsServer`'s, which stops them; anything but ``GET /metrics`` gets 404 or
405, and the server serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from palatine.channel import tls
from palatine.channel.token import generate_token, resolve_token
from palatine.core.proc import Proc
from palatine.hosting import user_metrics
from palatine.ids import SYSTEM_ACTOR
from palatine.protocol.system import Snapshot, SystemSnapshot
from palatine.system.registry import SystemRegistry

__all__ = [
    "REQUEST_TIMEOUT_S",
    "SCRAPE_TIMEOUT_S",
    "SCRAPE_TOKEN_ENV",
    "SCRAPE_TOKEN_FILE_ENV",
    "USER_PREFIX",
    "MetricsServer",
    "SystemCollector",
    "scrape_token_path",
]

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S: Final = 10.0
"""A connection that sends nothing (or reads nothing) this long is dropped."""

SCRAPE_TOKEN_ENV: Final = "PALATINE_METRICS_TOKEN"
"""The scrape token itself, when a launcher chooses it (else the system makes one)."""

SCRAPE_TOKEN_FILE_ENV: Final = "PALATINE_METRICS_TOKEN_FILE"
"""Where the system writes the scrape token (default: see `scrape_token_path`)."""

USER_PREFIX: Final = "palatine_user_"
"""What the name of every family of user metrics starts with."""


def scrape_token_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where the scrape token goes: ``PALATINE_METRICS_TOKEN_FILE``, else
    ``metrics-token`` in ``PALATINE_LOG_DIR``; None when neither is set."""
    environ = os.environ if environ is None else environ
    if environ.get(SCRAPE_TOKEN_FILE_ENV):
        return Path(environ[SCRAPE_TOKEN_FILE_ENV])
    if environ.get("PALATINE_LOG_DIR"):
        return Path(environ["PALATINE_LOG_DIR"]) / "metrics-token"
    return None


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` atomically, mode 0600 whatever the umask."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


_RESOURCES: Final = {
    "cpu_percent": "CPU each live proc used (percent of one core), as its heartbeat said.",
    "rss_bytes": "Resident memory of each live proc, as its heartbeat said.",
    "gpu_util_percent": "Utilisation of each live proc's GPU (where NVML is present).",
    "gpu_mem_bytes": "GPU memory each live proc holds (where NVML is present).",
}
"""The resources a heartbeat carries (`palatine.hosting.resources`), each a gauge."""


def _rank_of(proc: str) -> str:
    """``"3"`` of the snapshot's key ``"worker[3]"``."""
    return proc.rpartition("[")[2].rstrip("]")


class _UserFamilies:
    """The ``palatine_user_*`` families of one scrape, one per name (the first kind seen
    under a name wins; another proc's other kind under it is left out and logged)."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}
        self._kinds: dict[str, str] = {}

    def add(self, world: str, proc: str, host: str, counters: Mapping[str, float]) -> None:
        labels = [world, _rank_of(proc), host]
        for m in user_metrics.parse(counters):
            kind = self._kinds.setdefault(m.name, m.kind)
            if kind != m.kind:
                log.debug("user metric %s of %s is a %s, not a %s", m.name, proc, m.kind, kind)
                continue
            family = self.families.get(m.name)
            if family is None:
                family = self.families[m.name] = self._family(m.name, m.kind)
            if isinstance(family, HistogramMetricFamily):
                family.add_metric(labels, m.buckets, m.sum)
            elif isinstance(family, (CounterMetricFamily, GaugeMetricFamily)):
                family.add_metric(labels, m.value)

    @staticmethod
    def _family(name: str, kind: str) -> Metric:
        full, doc, labels = USER_PREFIX + name, "user metric", ["world", "rank", "host"]
        if kind == "counter":
            return CounterMetricFamily(full, doc, labels=labels)
        if kind == "gauge":
            return GaugeMetricFamily(full, doc, labels=labels)
        return HistogramMetricFamily(full, doc, labels=labels)


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
        resources = {
            key: GaugeMetricFamily(f"palatine_proc_{key}", doc, labels=per_proc)
            for key, doc in _RESOURCES.items()
        }
        user = _UserFamilies()
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
                for key, value in entry.resources.items():
                    if key in resources:
                        resources[key].add_metric([name, proc, entry.host], value)
                user.add(name, proc, entry.host, c)
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
        yield from resources.values()
        yield from user.families.values()


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # (the socket's: an idle connection is dropped)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("metrics: " + format, *args)


class _ThreadedServer(ThreadingMixIn, WSGIServer):
    """One thread per connection (daemon threads: `close` does not wait for a stuck
    client, whose socket times out anyway)."""

    daemon_threads = True
    block_on_close = False
    ssl_context: ssl.SSLContext | None = None

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        if self.ssl_context is not None:
            sock.settimeout(REQUEST_TIMEOUT_S)  # (the handshake runs on the handler's thread)
            sock = self.ssl_context.wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False
            )
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away: a debug line, not a traceback on stderr."""
        log.debug("metrics: connection from %s ended", client_address, exc_info=True)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except (OSError, ssl.SSLError) as e:
                log.debug("metrics: TLS handshake with %s failed: %s", client_address, e)
                return
        super().finish_request(request, client_address)


def _https_context() -> ssl.SSLContext:
    """The process's TLS certificate for HTTPS; a client certificate optional."""
    ctx = tls.server_context()
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


class MetricsServer:
    """The HTTP(S) server of one system's metrics, on threads of its own; `close` stops
    it. ``https``: serve TLS (default: when the system's transport is ``tls``)."""

    def __init__(
        self,
        host: str,
        port: int,
        proc: Proc,
        registry: SystemRegistry,
        *,
        https: bool | None = None,
    ) -> None:
        self._loop = proc.loop
        self._client = proc.attach("metrics")
        collectors = CollectorRegistry(auto_describe=False)
        collectors.register(SystemCollector(self._scrape, lambda: dict(registry.detections)))
        self._app = make_wsgi_app(collectors)
        self._cluster_token = resolve_token()
        given = os.environ.get(SCRAPE_TOKEN_ENV, "").strip()
        self.token = given or generate_token()
        if hmac.compare_digest(self.token.encode(), self._cluster_token):
            raise ValueError(f"{SCRAPE_TOKEN_ENV} must not be the cluster token")
        self._scratch: str | None = None
        path = scrape_token_path()
        if path is None:
            self._scratch = tempfile.mkdtemp(prefix="palatine-metrics-")
            path = Path(self._scratch) / "metrics-token"
        _write_private(path, self.token)
        self.token_file = path
        if https is None:
            https = proc.addr is not None and proc.addr.transport == "tls"
        self.scheme = "https" if https else "http"
        self._server = make_server(
            host, port, self._guarded, server_class=_ThreadedServer, handler_class=_QuietHandler
        )
        assert isinstance(self._server, _ThreadedServer)
        if https:
            try:
                self._server.ssl_context = _https_context()
            except BaseException:
                self._server.server_close()
                raise
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
        if hmac.compare_digest(given, self._cluster_token):
            log.warning(
                "metrics: a scrape from %s bore the cluster token; refused (use the scrape "
                "token in %s)",
                environ.get("REMOTE_ADDR", "?"),
                self.token_file,
            )
            return answer(
                "403 Forbidden",
                "palatine metrics: the cluster token is not a scrape token; use the "
                "job's metrics-token file",
            )
        if not hmac.compare_digest(given, self.token.encode()):
            return answer(
                "401 Unauthorized",
                "palatine metrics: authentication failed (scrape token mismatch?)",
            )
        try:
            return iter(self._app(environ, start_response))
        except Exception as e:  # noqa: BLE001 - one failed scrape is a 503, the server serves on
            return answer("503 Service Unavailable", f"palatine metrics: {e}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
        if self._scratch is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.token_file)
                os.rmdir(self._scratch)
