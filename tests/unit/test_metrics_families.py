"""What the system's metrics endpoint exports (`SystemCollector`), read from one snapshot
with every kind of proc in it; and the Grafana dashboard shipped in docs/ names only
metrics the system exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from palatine.hosting import user_metrics
from palatine.protocol.system import ProcEntry, SystemSnapshot, WorldSnapshot
from palatine.system.metrics import SystemCollector

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-palatine.json"


def entry(**fields: object) -> ProcEntry:
    base: dict[str, object] = dict(
        labels={}, addr="unix:@x", pid=1, host="node1", health="Alive", exit_code=None,
        exit_signal=None, failed_actors=[], last_heartbeat_age_s=0.5, loop_lag_s=0.01,
    )  # fmt: skip
    return ProcEntry(**{**base, **fields})  # type: ignore[arg-type]


def worker_counters(loss: float) -> dict[str, float]:
    user_metrics._reset()
    try:
        user_metrics.counter("steps").inc(4)
        user_metrics.gauge("loss").set(loss)
        user_metrics.histogram("step_seconds").observe(0.2)
        return {"messages_delivered": 7.0, "bytes_delivered": 70.0, **user_metrics.report()}
    finally:
        user_metrics._reset()


RESOURCES = {"cpu_percent": 50.0, "rss_bytes": 1e9, "gpu_util_percent": 90.0, "gpu_mem_bytes": 2e9}

SNAPSHOT = SystemSnapshot(
    execution_id="x",
    worlds={
        "worker": WorldSnapshot(
            status="Live",
            labels={},
            host_procs=[],
            procs={
                f"worker[{r}]": entry(counters=worker_counters(0.5 + r), resources=RESOURCES)
                for r in range(2)
            },
        ),
        "controller": WorldSnapshot(
            status="Live",
            labels={},
            host_procs=[],
            procs={
                "controller[0]": entry(
                    counters={"controller_invocations": 3.0, "controller_stalls": 0.0}
                )
            },
        ),
    },
)


def scraped() -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SystemCollector(lambda: SNAPSHOT, lambda: {"signal": 1}))
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_resources_and_user_metrics_are_exported_per_proc_and_rank() -> None:
    got = scraped()
    assert sorted(v for _, v in got["palatine_proc_rss_bytes"]) == [1e9, 1e9]
    assert {(lab["world"], lab["rank"], v) for lab, v in got["palatine_user_loss"]} == {
        ("worker", "0", 0.5),
        ("worker", "1", 1.5),
    }
    assert all(v == 4 for _, v in got["palatine_user_steps_total"])
    assert {lab["le"] for lab, _ in got["palatine_user_step_seconds_bucket"]} >= {"0.25", "+Inf"}
    assert "palatine_user_messages_delivered" not in got  # (only the metric.* counters)


def test_every_expression_of_the_grafana_dashboard_names_an_exported_metric() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    assert exprs and any("palatine_user_" in e for e in exprs)
    exported = set(scraped())
    for expr in exprs:
        names = re.findall(r"\bpalatine_[a-z0-9_]+\b", expr)
        assert names, expr
        for name in names:
            assert name in exported, f"{name} (in {expr!r}) is not exported"
