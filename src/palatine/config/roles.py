"""Each role's options, declared once: `SystemOptions`, `HostOptions`, `ControllerOptions`,
and `LocalOptions` (what `local_mesh` itself takes).

A field is declared with its Python name (seconds end in ``_s``), its type and default,
one line of help and its bound (``Annotated[..., opt(...)]``), and, where the command
line and the ``palatine serve`` protocol know another name, that name
(``msgspec.field(name="operation_timeout_in_sec")``: the flag
``--operation-timeout-in-sec`` and the request field ``operation_timeout_in_sec``).
Everything else is derived from the declaration:

* `add_arguments` — the argparse flags of a role's subcommand (flag, type, default, help);
* `from_args` — a parsed command line back into the struct (the child's side of the
  handoff); `to_argv` — the struct as the flags a parent starts its child with;
* `sort_kwargs` and `build` — the keyword arguments of `local_mesh`, `LocalJob` and
  `SlurmJob`: a key goes to every role that declares it, by its Python name or by its
  command-line name (the alias: ``operation_timeout_in_sec`` for ``operation_timeout_s``);
  an unknown key, or both spellings of one option, is a `TypeError`;
* `check` — the bounds, naming a field as the caller spells it.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec

__all__ = [
    "ControllerOptions",
    "HostOptions",
    "LocalOptions",
    "OptionField",
    "SystemOptions",
    "add_arguments",
    "build",
    "check",
    "flag",
    "from_args",
    "help_text",
    "opt",
    "option_fields",
    "renamed",
    "sort_kwargs",
    "to_argv",
]

S = TypeVar("S", bound=msgspec.Struct)


def opt(help_text: str, *, bound: str | None = None, metavar: str | None = None) -> msgspec.Meta:
    """A field's help line and bound: ``"finite"`` (seconds, finite and > 0), ``"positive"``
    (seconds > 0, ``inf`` allowed), ``"count"`` (an integer in [1, 2**63)) or ``"restarts"``
    (an integer >= 0)."""
    extra: dict[str, str] = {}
    if bound is not None:
        extra["bound"] = bound
    if metavar is not None:
        extra["metavar"] = metavar
    return msgspec.Meta(description=help_text, extra=extra)


class SystemOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options of ``palatine system`` (None: the configuration's value)."""

    supervision_update_timeout_s: Annotated[
        float | None,
        opt("silence after which a proc is Expired", bound="finite"),
    ] = msgspec.field(default=None, name="supervision_update_timeout_in_sec")
    world_eviction_timeout_s: Annotated[
        float | None,
        opt("how long a world may stay unhealthy before eviction", bound="finite"),
    ] = msgspec.field(default=None, name="world_eviction_timeout_in_sec")
    metrics_addr: Annotated[
        str | None,
        opt(
            "serve Prometheus metrics on GET http://HOST:PORT/metrics (port 0: any free "
            "port; HTTPS under tls), to requests with the read-only scrape token (its "
            "file: metrics-token in the log dir) as a bearer token, never the cluster token",
            metavar="HOST:PORT",
        ),
    ] = None


class HostOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options of ``palatine host`` (None: the configuration's value)."""

    supervision_update_interval_s: Annotated[
        float | None, opt("heartbeat interval", bound="finite")
    ] = msgspec.field(default=None, name="supervision_update_interval_in_sec")


class ControllerOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options of ``palatine controller`` (the defaults of Monarch's controller)."""

    supervision_query_interval_s: Annotated[
        float, opt("how often the system is polled for failed workers", bound="positive")
    ] = msgspec.field(default=2.0, name="supervision_query_interval_in_sec")
    supervision_update_interval_s: Annotated[
        float, opt("heartbeat interval of the controller proc", bound="positive")
    ] = msgspec.field(default=2.0, name="supervision_update_interval_in_sec")
    worker_progress_check_interval_s: Annotated[
        float, opt("how often worker progress is checked (inf: never)", bound="positive")
    ] = msgspec.field(default=10.0, name="worker_progress_check_interval_in_sec")
    operation_timeout_s: Annotated[
        float, opt("stall allowed before workers are reported stuck", bound="positive")
    ] = msgspec.field(default=120.0, name="operation_timeout_in_sec")
    operations_per_worker_progress_request: Annotated[
        int, opt("ops issued between progress probes", bound="count")
    ] = 100
    fail_on_worker_timeout: Annotated[bool, opt("also fail the mesh when workers are stuck")] = (
        False
    )


class LocalOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `local_mesh` and `LocalJob` take besides the roles' options."""

    device: Annotated[str, opt("where the workers run: auto, cpu or cuda")] = "auto"
    transport: Annotated[str, opt("how the roles reach each other: unix or tcp")] = "unix"
    log_dir: Annotated[str | None, opt("where the logs go (kept); None: a fresh directory")] = None
    startup_timeout_s: Annotated[
        float, opt("bound of starting the roles and attaching", bound="positive")
    ] = msgspec.field(default=60.0, name="startup_timeout_in_sec")
    system_restarts: Annotated[
        int | None,
        opt("times a lost system is started again", bound="restarts"),
    ] = None
    dashboard: Annotated[
        bool, opt("serve the job's web dashboard on loopback and print its link")
    ] = False
    dashboard_addr: Annotated[
        str | None, opt("serve the job's web dashboard at HOST:PORT (docs/dashboard.md)")
    ] = None


# --------------------------------------------------------------------------- the fields


class OptionField:
    """One declared field: its names, scalar type, default, help and bound."""

    __slots__ = ("bound", "default", "help", "metavar", "name", "optional", "scalar", "wire")

    def __init__(self, info: msgspec.structs.FieldInfo) -> None:
        self.name = info.name
        self.wire = info.encode_name
        self.default: Any = info.default
        typ: Any = info.type
        meta: msgspec.Meta | None = None
        if typing.get_origin(typ) is Annotated:
            typ, *extras = typing.get_args(typ)
            meta = next((m for m in extras if isinstance(m, msgspec.Meta)), None)
        args = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
        self.optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        self.scalar: Any = rest[0] if len(rest) == 1 else None
        self.help = (meta.description or "") if meta is not None else ""
        extra = (meta.extra or {}) if meta is not None else {}
        self.bound: str | None = extra.get("bound")
        self.metavar: str | None = extra.get("metavar")

    @property
    def alias(self) -> str | None:
        """The other spelling a Python caller may use (the command line's), if any."""
        return self.wire if self.wire != self.name else None


_CACHE: dict[type[Any], tuple[OptionField, ...]] = {}


def option_fields(cls: type[msgspec.Struct]) -> tuple[OptionField, ...]:
    """The declared fields of ``cls`` (those with a help line: a role command's wiring
    fields, declared without one, are left to it)."""
    out = _CACHE.get(cls)
    if out is None:
        out = tuple(f for f in map(OptionField, msgspec.structs.fields(cls)) if f.help)
        _CACHE[cls] = out
    return out


def flag(wire: str) -> str:
    """The command-line flag of a field's wire name: ``--operation-timeout-in-sec``."""
    return "--" + wire.replace("_", "-")


# --------------------------------------------------------------------------- argparse


def _default_text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def help_text(f: OptionField) -> str:
    """``f``'s help with its default: the declared one, or for a None default (the
    configuration's value applies) `palatine.config.Config`'s, and the variable that
    overrides it."""
    if f.default is not None:
        return f"{f.help} (default {_default_text(f.default)})"
    from palatine import config

    fallback = getattr(config.Config(), f.name, None)
    if fallback is None:
        return f.help
    return f"{f.help} (default {_default_text(fallback)}, or {config.env_var(f.name)})"


def add_arguments(
    p: argparse.ArgumentParser, cls: type[msgspec.Struct], only: Iterable[str] | None = None
) -> None:
    """The flags of ``cls``'s fields (``only``: of those Python names, for a command that
    takes some of a role's options): ``--<wire name>``, its type and default, its help
    (`help_text`); the parsed value is at ``args.<name>``."""
    chosen = None if only is None else set(only)
    fields = option_fields(cls)
    if chosen is not None:
        unknown = chosen - {f.name for f in fields}
        if unknown:
            raise ValueError(f"{cls.__name__} declares no {', '.join(sorted(unknown))}")
    for f in fields:
        if chosen is not None and f.name not in chosen:
            continue
        if f.scalar is bool:
            p.add_argument(flag(f.wire), dest=f.name, action="store_true", help=f.help)
            continue
        p.add_argument(
            flag(f.wire),
            dest=f.name,
            type=f.scalar,
            default=f.default,
            metavar=f.metavar or f.wire.upper(),
            help=help_text(f),
        )


def from_args(cls: type[S], args: argparse.Namespace) -> S:
    """``cls`` from a parsed command line: every field from ``args.<name>`` (a role
    command's wiring fields too, whose flags its subcommand declares)."""
    return cls(**{name: getattr(args, name) for name in cls.__struct_fields__})


def to_argv(opts: msgspec.Struct) -> list[str]:
    """The flags that `add_arguments` and `from_args` turn back into ``opts``: each
    declared field whose value is not its default."""
    out: list[str] = []
    for f in option_fields(type(opts)):
        value = getattr(opts, f.name)
        if value is None or value == f.default:
            continue
        if f.scalar is bool:
            out.append(flag(f.wire))
        else:
            out += [flag(f.wire), repr(value) if isinstance(value, float) else str(value)]
    return out


# --------------------------------------------------------------------------- bounds


def check(opts: msgspec.Struct, name: Callable[[str], str] = flag) -> None:
    """Check every declared field's bound; a `ValueError` naming the field as ``name(wire
    name)`` spells it (``--operation-timeout-in-sec``, ``Run.Host.…``). None is not
    checked: the configuration's value applies."""
    for f in option_fields(type(opts)):
        value = getattr(opts, f.name)
        if value is None or f.bound is None:
            continue
        if f.bound == "finite" and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name(f.wire)} must be a finite number > 0, got {value:g}")
        if f.bound == "positive" and not value > 0:
            raise ValueError(f"{name(f.wire)} must be > 0, got {value:g}")
        if f.bound == "count" and not 1 <= value < 2**63:
            raise ValueError(f"{name(f.wire)} must be in [1, 2**63), got {value}")
        if f.bound == "restarts" and value < 0:
            raise ValueError(f"{name(f.wire)} must be an integer >= 0, got {value}")


# --------------------------------------------------------------------------- keywords


def sort_kwargs(
    caller: str,
    kwargs: Mapping[str, Any],
    kinds: Sequence[type[msgspec.Struct]],
    also: Iterable[str] = (),
) -> dict[str, Any]:
    """The keyword arguments of ``caller`` by field name (each key by its Python name or
    its alias). An unknown key is a `TypeError` naming it, the closest allowed key and
    every allowed one (``also``: the caller's own parameters, for the suggestion); both
    spellings of one option is a `TypeError` too."""
    names: dict[str, str] = {}
    for cls in kinds:
        for f in option_fields(cls):
            names[f.name] = f.name
            if f.alias is not None:
                names[f.alias] = f.name
    used: dict[str, str] = {}
    for key in kwargs:
        field = names.get(key)
        if field is None:
            raise TypeError(unknown_key_text(caller, key, names, also))
        if field in used:
            raise TypeError(_both_text(caller, used[field], key))
        used[field] = key
    return {field: kwargs[key] for field, key in used.items()}


def renamed(
    caller: str, name: str, value: float | None, alias: str, alias_value: float | None
) -> float | None:
    """A parameter that also takes another spelling (``timeout_s`` and ``timeout``): the
    value given under either name (None: neither); both is a `TypeError`."""
    if alias_value is None:
        return value
    if value is not None:
        raise TypeError(_both_text(caller, name, alias))
    return alias_value


def _both_text(caller: str, one: str, other: str) -> str:
    return f"{caller}() got both {one!r} and {other!r}, two spellings of one option: pass one"


def unknown_key_text(
    caller: str, key: str, names: Mapping[str, str], also: Iterable[str] = ()
) -> str:
    """``f() got an unexpected keyword argument 'x'; did you mean 'y'? Allowed: …``."""
    extra = list(also)
    close = difflib.get_close_matches(key, [*names, *extra], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    primary = sorted({*names.values(), *extra})
    aliases = (
        " (those ending in _s also as _in_sec)" if any(k != v for k, v in names.items()) else ""
    )
    return (
        f"{caller}() got an unexpected keyword argument {key!r}{hint} "
        f"Allowed: {', '.join(primary)}{aliases}"
    )


def build(caller: str, cls: type[S], values: Mapping[str, Any]) -> S:
    """``cls`` from `sort_kwargs`'s values (those it declares): a value of the wrong type
    is a `TypeError`, one out of bounds a `ValueError`, each naming the keyword; None
    for a field that takes no None leaves its default."""
    out: dict[str, Any] = {}
    for f in option_fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if value is None:
            if f.optional:
                out[f.name] = None
            continue
        out[f.name] = _coerce(caller, f, value)
    opts = cls(**out)
    wire_to_name = {f.wire: f.name for f in option_fields(cls)}
    try:
        check(opts, lambda wire: wire_to_name[wire])
    except ValueError as e:
        raise ValueError(f"{caller}(): {e}") from None
    return opts


def _coerce(caller: str, f: OptionField, value: Any) -> Any:
    scalar = f.scalar
    if scalar is bool:
        ok = isinstance(value, bool)
    elif scalar is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif scalar is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif scalar is str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        ok = isinstance(value, str)
    else:  # pragma: no cover - every declared field is a scalar
        ok = True
    if not ok:
        what = getattr(scalar, "__name__", str(scalar))
        raise TypeError(
            f"{caller}() argument {f.name!r} must be {what}, not {type(value).__name__}"
        )
    return value
