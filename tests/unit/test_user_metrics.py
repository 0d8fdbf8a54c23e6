"""``palatine.metrics`` (`palatine.hosting.user_metrics`): what a process publishes is
flattened for its heartbeat's counters and read back by the system as it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from palatine.hosting import user_metrics as metrics


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    metrics._reset()
    yield
    metrics._reset()


def test_a_name_gives_the_same_metric_and_another_kind_is_refused() -> None:
    metrics.counter("steps").inc()
    metrics.counter("steps").inc(2)
    assert metrics.counter("steps").value == 3
    with pytest.raises(ValueError, match="is a counter, not a gauge"):
        metrics.gauge("steps")
    with pytest.raises(ValueError, match="is a counter, not a histogram"):
        metrics.histogram("steps")


def test_bad_names_and_a_falling_counter_are_refused() -> None:
    for name in ("1x", "a.b", "a-b", ""):
        with pytest.raises(ValueError, match="metric name"):
            metrics.counter(name)
    with pytest.raises(ValueError, match="would go down"):
        metrics.counter("n").inc(-1)


def test_what_is_reported_is_read_back_by_kind() -> None:
    metrics.counter("steps").inc(5)
    g = metrics.gauge("loss")
    g.set(2.0)
    g.dec(0.5)
    h = metrics.histogram("t", buckets=(1.0, 0.1))
    for v in (0.05, 0.5, 0.5, 7.0):
        h.observe(v)
    flat = metrics.report()
    assert all(k.startswith(metrics.PREFIX) for k in flat)
    got = {m.name: m for m in metrics.parse({**flat, "messages_delivered": 9.0})}
    assert set(got) == {"steps", "loss", "t"}
    assert (got["steps"].kind, got["steps"].value) == ("counter", 5)
    assert (got["loss"].kind, got["loss"].value) == ("gauge", 1.5)
    t = got["t"]
    assert t.kind == "histogram"
    assert t.buckets == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]  # cumulative
    assert (t.sum, t.count) == (8.05, 4)
