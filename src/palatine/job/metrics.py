"""Where a job's system serves its Prometheus metrics, for the job's launcher to say.

A job started with ``metrics_addr="HOST:PORT"`` (`SlurmJob`, `LocalJob`, ``palatine
launch --metrics-addr``) has its system serve ``/metrics`` there
(`palatine.system.metrics`), over HTTPS when the job's transport is ``tls``, to the
read-only scrape token the system wrote (0600) in the job's log dir. The system's ready
line says the bound address (port 0: the one it got) and the token's file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from palatine.tensor.client.local import LocalCluster

__all__ = ["MetricsEndpoint", "metrics_endpoint"]


class MetricsEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A job's metrics: ``url`` (``http[s]://HOST:PORT/metrics``) and the file of the
    scrape token a scraper sends (``Authorization: Bearer``)."""

    url: str
    token_file: str

    def describe(self) -> str:
        """One line for a person: where to scrape, with which token."""
        return f"metrics at {self.url} (scrape token in {self.token_file})"


def metrics_endpoint(cluster: LocalCluster | None) -> MetricsEndpoint | None:
    """The endpoint ``cluster``'s system named in its ready line (the system started
    again after a loss names its own); None when it serves no metrics, or before it runs."""
    if cluster is None:
        return None
    system = cluster.system or (cluster.procs[0] if cluster.procs else None)
    ready = None if system is None else system.ready
    if not ready or not ready.get("metrics_addr"):
        return None
    scheme = "https" if str(cluster.system_addr).startswith("tls:") else "http"
    return MetricsEndpoint(
        url=f"{scheme}://{ready['metrics_addr']}/metrics",
        token_file=str(ready.get("metrics_token_file", "")),
    )
