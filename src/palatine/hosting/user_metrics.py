"""``palatine.metrics``: counters, gauges and histograms a worker or actor publishes.

Names and calls follow prometheus_client: ``counter("steps").inc()``,
``gauge("loss").set(0.3)``, ``histogram("step_seconds").observe(0.02)``. A name is made
once per process; asking again for the same name returns the same metric (another kind
under that name is a `ValueError`).

The values travel with the proc's heartbeats, in its ``counters`` (`report` flattens
them into ``metric.<kind>.<name>...`` keys), so publishing costs a lock and an add, and
nothing is sent that the heartbeat would not send anyway. The system reads them back with
`parse` and serves each as ``palatine_user_<name>`` with the proc's ``world``, ``rank``
and ``host`` labels (`palatine.system.metrics`); a dead proc's last values stay, as its
other counters do.

Histograms keep cumulative bucket counts, a sum and a count, as Prometheus' do
(`DEFAULT_BUCKETS` unless given). Help text stays in the process: the scrape says
``user metric`` for every user family.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal

import msgspec

__all__ = [
    "DEFAULT_BUCKETS",
    "PREFIX",
    "Counter",
    "Gauge",
    "Histogram",
    "UserMetric",
    "counter",
    "gauge",
    "histogram",
    "parse",
    "report",
]

PREFIX: Final = "metric."
"""How a user metric's key in a heartbeat's ``counters`` starts."""

DEFAULT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""prometheus_client's default histogram bounds (``+Inf`` is always added)."""

_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_lock = threading.Lock()

Kind = Literal["counter", "gauge", "histogram"]


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"metric name {name!r}: letters, digits and '_' only, not starting with a digit"
        )
    return name


class Counter:
    """A running total that only goes up (`inc`)."""

    kind: Final = "counter"

    def __init__(self, name: str, documentation: str = "") -> None:
        self.name, self.documentation = name, documentation
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (not negative: a counter never goes down)."""
        if amount < 0:
            raise ValueError(f"counter {self.name}: inc({amount}) would go down")
        with _lock:
            self._value += amount

    @property
    def value(self) -> float:
        return self._value

    def _report(self, out: dict[str, float]) -> None:
        out[f"{PREFIX}counter.{self.name}"] = self._value


class Gauge:
    """A value that goes up and down (`set`, `inc`, `dec`)."""

    kind: Final = "gauge"

    def __init__(self, name: str, documentation: str = "") -> None:
        self.name, self.documentation = name, documentation
        self._value = 0.0

    def set(self, value: float) -> None:
        with _lock:
            self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with _lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        with _lock:
            self._value -= amount

    @property
    def value(self) -> float:
        return self._value

    def _report(self, out: dict[str, float]) -> None:
        out[f"{PREFIX}gauge.{self.name}"] = self._value


class Histogram:
    """Observations counted into buckets (`observe`), with their sum and count."""

    kind: Final = "histogram"

    def __init__(
        self, name: str, documentation: str = "", buckets: Sequence[float] = DEFAULT_BUCKETS
    ) -> None:
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if len(set(bounds)) != len(bounds):
            raise ValueError(f"histogram {name}: repeated bucket bounds {list(buckets)}")
        self.name, self.documentation = name, documentation
        self.bounds = (*bounds, math.inf)
        self._counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with _lock:
            self._sum += value
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self._counts[i] += 1
                    break

    def _report(self, out: dict[str, float]) -> None:
        key = f"{PREFIX}histogram.{self.name}"
        total = 0
        for bound, n in zip(self.bounds, self._counts, strict=True):
            total += n
            out[f"{key}.le.{_bound_text(bound)}"] = float(total)
        out[f"{key}.sum"] = self._sum
        out[f"{key}.count"] = float(total)


def _bound_text(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


_metrics: dict[str, Counter | Gauge | Histogram] = {}


def _get(name: str, kind: Kind, make: type[Counter] | type[Gauge]) -> Counter | Gauge:
    with _lock:
        have = _metrics.get(_check_name(name))
        if have is None:
            have = _metrics[name] = make(name)
    if isinstance(have, Histogram) or have.kind != kind:
        raise ValueError(f"metric {name!r} is a {have.kind}, not a {kind}")
    return have


def counter(name: str, documentation: str = "") -> Counter:
    """This process's counter ``name`` (made on first use)."""
    got = _get(name, "counter", Counter)
    assert isinstance(got, Counter)
    got.documentation = got.documentation or documentation
    return got


def gauge(name: str, documentation: str = "") -> Gauge:
    """This process's gauge ``name`` (made on first use)."""
    got = _get(name, "gauge", Gauge)
    assert isinstance(got, Gauge)
    got.documentation = got.documentation or documentation
    return got


def histogram(
    name: str, documentation: str = "", buckets: Sequence[float] = DEFAULT_BUCKETS
) -> Histogram:
    """This process's histogram ``name`` (made on first use, with ``buckets``; later
    calls get it with the buckets it was made with)."""
    with _lock:
        have = _metrics.get(_check_name(name))
        if have is None:
            have = _metrics[name] = Histogram(name, documentation, buckets)
    if not isinstance(have, Histogram):
        raise ValueError(f"metric {name!r} is a {have.kind}, not a histogram")
    return have


def report() -> dict[str, float]:
    """Every metric of this process, flattened for a heartbeat's ``counters``."""
    out: dict[str, float] = {}
    with _lock:
        for metric in _metrics.values():
            metric._report(out)
    return out


def _reset() -> None:
    """Forget every metric (tests)."""
    with _lock:
        _metrics.clear()


class UserMetric(msgspec.Struct, kw_only=True):
    """One proc's metric, read back from its ``counters`` (`parse`): a counter's or
    gauge's ``value``, or a histogram's cumulative ``buckets`` (bound text, count), sum
    and count."""

    name: str
    kind: Kind
    value: float = 0.0
    buckets: list[tuple[str, float]] = []
    sum: float = 0.0
    count: float = 0.0


def parse(counters: Mapping[str, float]) -> Iterable[UserMetric]:
    """The user metrics among a proc's ``counters`` (keys `report` wrote), by name."""
    hists: dict[str, UserMetric] = {}
    for key, value in counters.items():
        if not key.startswith(PREFIX):
            continue
        kind, _, rest = key[len(PREFIX) :].partition(".")
        if kind in ("counter", "gauge"):
            yield UserMetric(
                name=rest, kind="counter" if kind == "counter" else "gauge", value=value
            )
        elif kind == "histogram":
            name, _, part = rest.partition(".")
            h = hists.setdefault(name, UserMetric(name=name, kind="histogram"))
            if part.startswith("le."):
                h.buckets.append((part[3:], value))
            elif part == "sum":
                h.sum = value
            elif part == "count":
                h.count = value
    yield from hists.values()
