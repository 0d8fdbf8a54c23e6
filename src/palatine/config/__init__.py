"""Runtime configuration: one frozen struct, defaults <- ``PALATINE_*`` env <- explicit args.

`get()` returns the current `Config` (cached; hot paths read attributes of it).
`override(**keys)` scopes changes for tests. A key's variable is ``PALATINE_`` plus the
upper-cased key without its ``_s``/``_bytes`` suffix (``message_delivery_timeout_s`` ->
``PALATINE_MESSAGE_DELIVERY_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from palatine.errors import ConfigError

__all__ = [
    "Config",
    "get",
    "override",
    "reload",
    "env_var",
    "Setting",
    "describe",
    "format_seconds",
    "format_size",
    "parse_seconds",
    "value_too_large",
    "parse_size",
]


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """Every runtime and system tunable."""

    # channels
    message_delivery_timeout_s: float = 30.0
    message_ack_interval_s: float = 0.5
    message_ack_every_n: int = 1000
    max_frame_bytes: int = 10 * 1024**3
    # the largest value an actor's endpoint returns or a fetch brings back; a larger one
    # fails that call, naming its size and this limit (the proc and its mesh serve on)
    max_value_bytes: int = 1024**3
    # a fetched value at least this big goes from the worker to the client directly, not
    # through the controller (which orders the fetch as ever)
    direct_value_bytes: int = 1024**2
    connect_timeout_s: float = 5.0
    auth_timeout_s: float = 5.0
    reconnect_backoff_initial_s: float = 0.05
    reconnect_backoff_max_s: float = 1.0
    inbound_queue_frames: int = 1024
    # request/reply
    rpc_timeout_s: float = 30.0
    call_timeout_s: float = 3600.0
    stop_actor_timeout_s: float = 10.0
    # addresses, loop, logging
    host_ip: str | None = None
    event_loop: str = "uvloop"
    log_level: str = "INFO"
    # system layer
    supervision_update_timeout_s: float = 20.0
    supervision_update_interval_s: float = 2.0
    world_eviction_timeout_s: float = 10.0
    join_timeout_s: float = 30.0
    liveness_probe_timeout_s: float = 1.0
    exit_report_grace_s: float = 0.5
    # None: 5 x supervision_update_interval_s
    system_loss_timeout_s: float | None = None
    # None: min(10, supervision_update_interval_s)
    heartbeat_ack_timeout_s: float | None = None
    proc_stop_timeout_s: float = 5.0
    # None: min(1, supervision_update_timeout_s / 4)
    health_tick_interval_s: float | None = None
    stop_fallback_margin_s: float = 3.0
    # how many recent stimuli the system keeps for `palatine snapshot --stimuli` (and a
    # controller for its `Introspect` reply)
    stimulus_log_size: int = 1000
    # how many times `local_mesh` starts its system again, at the same address, when it
    # dies (its procs rejoin it); 0: a lost system fails the job at once
    system_restarts: int = 3
    # how long `local_mesh` waits for its running system to answer a liveness probe (a
    # token handshake) before it kills it and starts it again, as a dead one; None: a
    # quarter of system_loss_timeout_s, from 0.5 to 3 s, well inside the procs' bound
    system_probe_timeout_s: float | None = None
    child_term_grace_s: float = 5.0
    stack_dump_timeout_s: float = 10.0
    spawn_procs_timeout_s: float = 60.0
    # hosts fork `python -m palatine worker` procs from a pre-imported server (palatine.hosting.forkserver)
    fork_server: bool = True
    # modules (comma separated) a host's fork server imports once the host's spawns have
    # settled, so that a proc spawned later (a respawned rank) starts with them loaded;
    # None: nothing, but `local_mesh` hosts warm TENSOR_WARM (palatine.tensor.client.local)
    fork_server_warm: str | None = None
    cast_fanout: int = 8
    # tensor worker procs run SCHED_BATCH: woken by the controller, they do not preempt it
    # before it has written to every worker (palatine.tensor.worker.actor)
    worker_sched_batch: bool = True
    # a worker proc's GIL switch interval: its loop thread (stall reports, heartbeats, the
    # next command) gets the GIL within this while a stream runs Python; 0: Python's 5 ms
    worker_switch_interval_us: int = 1000
    # a plain thread's blocking call_one may use its own connection (palatine.fastpath.lane), and
    # workers and clients talk to a local controller on direct sessions (palatine.fastpath.direct_tx)
    lanes: bool = True
    # a loop that just read a lane request, and a thread awaiting a lane reply, poll this
    # long before sleeping (palatine.channel.spin); 0: off
    idle_spin_us: int = 100
    log_dir: str | None = None
    # tensor workers: how long Exit drains; the bound of every collective's setup and op;
    # the backend (None: NCCL when every rank has a GPU of its own, else gloo); modules a
    # worker imports before it joins (comma separated, e.g. "torch")
    worker_exit_timeout_s: float = 30.0
    collective_timeout_s: float = 600.0
    # how long the controller holds an op's error that is a collective losing its
    # connection to a peer, for the supervision to name the lost peer first (a
    # DeviceException for the fault, whatever error the collective library raised)
    peer_loss_grace_s: float = 30.0
    collective_backend: str | None = None
    preload: str | None = None
    # the controller: its worker world Live, its worker actors spawned, one stall report,
    # silence from the client before it is lost; the worker actor type (tests swap it)
    controller_world_ready_timeout_s: float = 300.0
    controller_spawn_timeout_s: float = 120.0
    stall_report_timeout_s: float = 5.0
    client_liveness_timeout_s: float = 30.0
    controller_worker_actor_type: str | None = None
    # the client records where each call was issued, for its errors
    client_tracebacks: bool = True
    # issued tensor ops and remote calls not yet completed at which the client's next
    # call waits for the workers (backpressure; it resumes at three quarters)
    client_in_flight_limit: int = 20_000
    # the py-spy executable for stack dumps from outside (None: py-spy on PATH)
    pyspy: str | None = None
    # log directories of jobs started here (palatine.output.logs) kept after they end, newest first
    keep_logs: int = 10
    # text a console writer queues before it drops output with a count (palatine.output.console)
    console_buffer_bytes: int = 4 * 1024 * 1024
    # workers' output at the client (palatine.hosting.output): streamed, and identical
    # lines from many ranks within this window shown once
    stream_output: bool = True
    output_window_s: float = 0.5
    # one-sided buffers (palatine.rdma): "auto" moves bytes by shared memory between
    # procs of one host and by the owner proc's socket server between hosts; "socket"
    # always goes through the server. The bound of one transfer.
    rdma_backend: str = "auto"
    rdma_timeout_s: float = 60.0


_SIZE_RE = re.compile(r"^\s*(\d+)\s*(KiB|MiB|GiB|B)?\s*$")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def format_seconds(value: float) -> str:
    """A duration as people write it, in every message and variable: ``20``, ``0.5``, ``1.25``."""
    return f"{value:g}"


def format_size(nbytes: int) -> str:
    """``2.0 GiB``, ``64.0 MiB``, ``512 B``: a byte count for a person."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def value_too_large(what: str, nbytes: int) -> str | None:
    """Why a value of ``nbytes`` may not be sent as ``what`` (None: it may): over
    `Config.max_value_bytes`."""
    limit = get().max_value_bytes
    if nbytes <= limit:
        return None
    return (
        f"{what} is {format_size(nbytes)}, over the limit of {format_size(limit)} "
        f"for one value ({env_var('max_value_bytes')})"
    )


def parse_seconds(text: str, *, name: str = "value") -> float:
    """Parse a positive duration in seconds (``inf`` allowed)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected seconds > 0, got {text!r}") from None
    if not value > 0 or math.isnan(value):
        raise ConfigError(f"{name}: expected seconds > 0, got {text!r}")
    return value


def _parse_interval(text: str, *, name: str = "value") -> float:
    """A period (heartbeats, ticks): seconds > 0, and finite (something must happen)."""
    value = parse_seconds(text, name=name)
    if math.isinf(value):
        raise ConfigError(f"{name}: expected a finite number of seconds > 0, got {text!r}")
    return value


def parse_size(text: str, *, name: str = "value") -> int:
    """Parse a byte count: an integer with an optional ``KiB``/``MiB``/``GiB`` suffix."""
    m = _SIZE_RE.match(str(text))
    if not m or int(m.group(1)) <= 0:
        raise ConfigError(f"{name}: expected a size in bytes (e.g. 1048576 or 1MiB), got {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def _parse_int(text: str, *, name: str, unit: str = "an integer", zero_ok: bool = False) -> int:
    """An integer > 0 (``zero_ok``: >= 0); ``unit`` names what it counts in the message."""
    bound = ">= 0" if zero_ok else "> 0"
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {unit} {bound}, got {text!r}") from None
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name}: expected {unit} {bound}, got {text!r}")
    return value


def _parse_count(text: str, *, name: str) -> int:
    """A number of times something may happen: 0 is never."""
    return _parse_int(text, name=name, zero_ok=True)


def _parse_micros(text: str, *, name: str) -> int:
    return _parse_int(text, name=name, unit="microseconds", zero_ok=True)


def _parse_loop(text: str, *, name: str) -> str:
    if text not in ("uvloop", "asyncio"):
        raise ConfigError(f"{name}: expected 'uvloop' or 'asyncio', got {text!r}")
    return text


def _parse_str(text: str, *, name: str) -> str:
    return text


def _parse_bool(text: str, *, name: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no or on/off, got {text!r}")


def env_var(key: str) -> str:
    """The ``PALATINE_*`` variable of a config key."""
    for suffix in ("_s", "_bytes"):
        if key.endswith(suffix) and key != "max_frame_bytes":
            key = key[: -len(suffix)]
            break
    return "PALATINE_" + key.upper()


# Integer keys where 0 is a meaning of its own ("never"), not a mistake.
_COUNTS = frozenset({"system_restarts"})


def _parser_for(key: str, default: Any) -> Callable[..., Any]:
    if key.endswith("_bytes"):
        return parse_size
    if key.endswith("interval_s"):
        return _parse_interval
    if key.endswith("_s"):
        return parse_seconds
    if key.endswith("_us"):
        return _parse_micros
    if key == "event_loop":
        return _parse_loop
    if key in _COUNTS:
        return _parse_count
    if isinstance(default, bool):
        return _parse_bool
    if isinstance(default, int) and not isinstance(default, bool):
        return _parse_int
    return _parse_str


_FIELDS: dict[str, Any] = {
    name: default
    for name, default in zip(Config.__struct_fields__, Config.__struct_defaults__, strict=True)
}


def from_env(environ: Mapping[str, str] | None = None, **explicit: Any) -> Config:
    """Build a Config: defaults, then ``PALATINE_*`` variables, then explicit keys."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for key, default in _FIELDS.items():
        var = env_var(key)
        text = environ.get(var)
        if text is not None and text != "":
            values[key] = _parser_for(key, default)(text, name=var)
    for key, value in explicit.items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown config key {key!r}")
        if isinstance(value, str) and not isinstance(_FIELDS[key], str | None):
            value = _parser_for(key, _FIELDS[key])(value, name=key)
        values[key] = value
    return Config(**values)


_current: Config | None = None


def system_loss_timeout_s(cfg: Config | None = None, interval_s: float | None = None) -> float:
    """The effective system-loss timeout: the configured one, else 5 × the interval."""
    c = cfg or get()
    if c.system_loss_timeout_s is not None:
        return c.system_loss_timeout_s
    return 5.0 * (interval_s if interval_s is not None else c.supervision_update_interval_s)


class Setting(msgspec.Struct, frozen=True):
    """One key of the configuration as `describe` reports it."""

    key: str
    variable: str
    value: Any
    source: str  # "default", or the variable that set it


def describe(environ: Mapping[str, str] | None = None) -> list[Setting]:
    """Every key with its variable, its effective value and where that value came from.

    Raises `ConfigError` (naming the variable) for a value that cannot be used.
    """
    environ = os.environ if environ is None else environ
    cfg = from_env(environ)
    out = []
    for key in _FIELDS:
        var = env_var(key)
        source = var if environ.get(var) else "default"
        out.append(Setting(key, var, getattr(cfg, key), source))
    return out


def get() -> Config:
    """The current configuration (built from the environment on first use)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def reload() -> Config:
    """Re-read the environment (used by role processes after parsing their flags)."""
    global _current
    _current = from_env()
    return _current


@contextlib.contextmanager
def override(**keys: Any) -> Iterator[Config]:
    """Scoped change of config keys (tests): ``with config.override(rpc_timeout_s=0.5): ...``."""
    global _current
    before = _current
    base = get()
    for key in keys:
        if key not in _FIELDS:
            raise ConfigError(f"unknown config key {key!r}")
    _current = msgspec.structs.replace(base, **keys)
    try:
        yield _current
    finally:
        _current = before
