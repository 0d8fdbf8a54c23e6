"""``palatine serve``: run system, host and controller roles on JSON-lines requests
.

A launcher writes one request per line on ``READ_FD``; the server answers on ``WRITE_FD``:

* ``{"Run": {"System"|"Host"|"Controller": {...}}}`` starts that role **in this process**
  (imports and device initialisation stay warm across runs); when it ends the server
  writes ``{"Finished": {"error": null}}`` or ``{"Finished": {"error": "<message>"}}``,
  after the role released its resources (so the next Run may reuse the address);
* ``{"Exit": []}`` or EOF stops a running role (its Finished is written) and ends the
  server with status 0;
* **(ours)** anything malformed — bad JSON, an unknown variant or field, a wrong type, an
  unparsable address or id — is answered ``{"Finished": {"error": "invalid request: …"}}``
  and the server keeps serving; a request while a Run is active is answered
  ``invalid request: a Run is already in progress``.

`parse_request` is the pure request decoder; `serve` is the asyncio shell. Roles print
their ready line through the ``on_ready`` callback (the CLI passes its ready-line printer).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from palatine.channel.addr import ChannelAddr
from palatine.cli.serve_pipes import MAX_LINE_BYTES, TOO_LONG, Lines, OnReady, Responses
from palatine.core.supervision_hook import set_unhandled_fault_hook
from palatine.errors import ConfigError, JoinError
from palatine.ids import WorldId, is_host_world
from palatine.tensor.controller.bootstrap import BootstrapError, ControllerCommand, validate_command

__all__ = [
    "ControllerCommand",
    "ExitRequest",
    "HostCommand",
    "InvalidRequest",
    "MAX_LINE_BYTES",
    "RunRequest",
    "SystemCommand",
    "check_cli_args",
    "check_role",
    "finished_line",
    "parse_request",
    "run_host",
    "run_role",
    "run_system",
    "serve",
]

log = logging.getLogger(__name__)

_ROLE_STOP_BOUND_S = 20.0
_RESPONSES_CLOSE_S = 1.0  # at the end: how long responses may take to be read


class SystemCommand(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``Run.System``: serve the system actor."""

    system_addr: str
    # None: the configuration decides (``PALATINE_*``, else 20 and 10), as for the CLI.
    supervision_update_timeout_in_sec: float | None = None
    world_eviction_timeout_in_sec: float | None = None


class HostCommand(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``Run.Host``: a host proc ``host_world[host_rank]``."""

    system_addr: str
    host_world: str
    host_rank: int
    supervision_update_interval_in_sec: float | None = None  # None: the configuration's (2)


class RunRequest(msgspec.Struct, frozen=True):
    """A decoded ``Run`` request."""

    role: Literal["System", "Host", "Controller"]
    command: SystemCommand | HostCommand | ControllerCommand


class ExitRequest(msgspec.Struct, frozen=True):
    """A decoded ``Exit`` request."""


class InvalidRequest(ValueError):
    """A request line that cannot be served; the text follows ``invalid request: ``."""


_ROLES: dict[str, type[Any]] = {
    "System": SystemCommand,
    "Host": HostCommand,
    "Controller": ControllerCommand,
}


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise InvalidRequest(f"{name} must be a finite number > 0, got {value:g}")


def check_role(role: str, cmd: Any, name: Callable[[str], str]) -> None:
    """Semantic checks of a System or Host command (or the CLI flags of those roles):
    addresses, names, ranges; a field left None is not checked (its default applies).
    ``name(field)`` is how the caller spells a field in the error: ``Run.Host.host_rank``
    for serve, ``--host-rank`` for the CLI."""
    try:
        ChannelAddr.parse(cmd.system_addr)
    except ValueError as e:
        raise InvalidRequest(f"{name('system_addr')} {cmd.system_addr!r}: {e}") from None
    if role == "System":
        _positive(name("supervision_update_timeout_in_sec"), cmd.supervision_update_timeout_in_sec)
        _positive(name("world_eviction_timeout_in_sec"), cmd.world_eviction_timeout_in_sec)
        return
    try:
        WorldId.parse(cmd.host_world)
    except ValueError as e:
        raise InvalidRequest(f"{name('host_world')} {cmd.host_world!r}: {e}") from None
    if not is_host_world(cmd.host_world):
        raise InvalidRequest(f"{name('host_world')} {cmd.host_world!r} must start with 'host'")
    if not 0 <= cmd.host_rank < 2**64:
        raise InvalidRequest(f"{name('host_rank')} must be in [0, 2**64), got {cmd.host_rank}")
    _positive(name("supervision_update_interval_in_sec"), cmd.supervision_update_interval_in_sec)


def check_cli_args(role: str, args: Any) -> None:
    """`check_role` for a role's parsed command line; raises `ConfigError` (exit 2)."""
    try:
        check_role(role, args, lambda field: "--" + field.replace("_", "-"))
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None


def _check(role: str, cmd: Any) -> None:
    """Semantic checks: addresses, names, ranges (the same rules as the CLI)."""
    if role == "Controller":
        try:
            validate_command(cmd)
        except ConfigError as e:
            raise InvalidRequest(f"Run.Controller: {e}") from None
        return
    check_role(role, cmd, lambda field: f"Run.{role}.{field}")


def parse_request(line: bytes | str) -> RunRequest | ExitRequest:
    """Decode one request line; raise `InvalidRequest` saying what and where."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("JSON nested too deeply") from None
    if obj == "Exit":
        return ExitRequest()
    if not isinstance(obj, dict) or len(obj) != 1:
        raise InvalidRequest(
            'expected {"Run": {"System"|"Host"|"Controller": {...}}} or {"Exit": []}'
        )
    ((tag, body),) = obj.items()
    if tag == "Exit":
        if body not in ([], None, {}):
            raise InvalidRequest(f"Exit takes no fields, got {msgspec.json.encode(body).decode()}")
        return ExitRequest()
    if tag != "Run":
        raise InvalidRequest(f"unknown variant {tag!r} (expected Run or Exit)")
    if not isinstance(body, dict) or len(body) != 1:
        raise InvalidRequest('Run expects {"System"|"Host"|"Controller": {...}}')
    ((role, fields),) = body.items()
    typ = _ROLES.get(role)
    if typ is None:
        raise InvalidRequest(f"unknown role {role!r} in Run (expected System, Host or Controller)")
    if not isinstance(fields, dict):
        raise InvalidRequest(f"Run.{role} expects an object of fields")
    try:
        cmd = msgspec.convert(fields, typ)
    except msgspec.ValidationError as e:
        raise InvalidRequest(f"Run.{role}: {e}") from None
    _check(role, cmd)
    return RunRequest(role, cmd)


def finished_line(error: str | None) -> bytes:
    """``{"Finished": {"error": …}}`` plus the newline."""
    return msgspec.json.encode({"Finished": {"error": error}}) + b"\n"


# --------------------------------------------------------------------------- roles


async def _until(done: Awaitable[Any], stop: asyncio.Event) -> bool:
    """Wait for ``done`` or ``stop``; True when ``done`` finished first."""
    waiter = asyncio.ensure_future(done)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if waiter.done():
        return True
    waiter.cancel()
    return False


async def run_system(cmd: SystemCommand, stop: asyncio.Event, on_ready: OnReady) -> str | None:
    """Serve the system until it is stopped (``palatine stop``) or ``stop`` is set."""
    from palatine.system.service import System

    try:
        handle = await System.serve(
            cmd.system_addr,
            supervision_update_timeout_s=cmd.supervision_update_timeout_in_sec,
            world_eviction_timeout_s=cmd.world_eviction_timeout_in_sec,
        )
    except Exception as e:  # noqa: BLE001 - the Finished message
        return f"cannot serve the system at {cmd.system_addr}: {e}"
    on_ready("system", str(handle.addr))
    if await _until(handle.wait(), stop):
        await handle.close()
    else:
        await handle.stop()
    return None


async def run_host(cmd: HostCommand, stop: asyncio.Event, on_ready: OnReady) -> str | None:
    """Run host ``host_world[host_rank]`` until the system stops it or ``stop`` is set."""
    from palatine.hosting.host import HostAgent, join_host

    try:
        handle = await join_host(
            cmd.host_world,
            cmd.host_rank,
            cmd.system_addr,
            cmd.supervision_update_interval_in_sec,
            stop,
        )
    except (JoinError, OSError) as e:
        return f"cannot join system at {cmd.system_addr}: {e}"
    if handle is None:
        return None  # stopped while joining
    on_ready("host", str(handle.addr))
    agent = handle.agent
    assert isinstance(agent, HostAgent)
    if await _until(handle.wait(), stop):
        reason = agent.stop_reason
        await agent.kill_children()
        await handle.shutdown(reason, leave=False)
        return f"lost contact with system at {cmd.system_addr}" if reason == "system lost" else None
    await agent.kill_children()
    await handle.shutdown("stopped by palatine serve")
    return None


async def _run_controller(
    cmd: ControllerCommand, stop: asyncio.Event, on_ready: OnReady
) -> str | None:
    from palatine.tensor.controller.bootstrap import run_controller

    try:
        code, why = await run_controller(cmd, stop, lambda addr: on_ready("controller", addr))
    except BootstrapError as e:
        return str(e)
    return (why or f"controller exited with status {code}") if code else None


async def run_role(req: RunRequest, stop: asyncio.Event, on_ready: OnReady) -> str | None:
    """Run one role to its end; the error message for ``Finished``, or None."""
    try:
        if req.role == "System":
            return await run_system(req.command, stop, on_ready)  # type: ignore[arg-type]
        if req.role == "Host":
            return await run_host(req.command, stop, on_ready)  # type: ignore[arg-type]
        return await _run_controller(req.command, stop, on_ready)  # type: ignore[arg-type]
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("%s role failed", req.role)
        return f"{req.role} failed: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- server


async def serve(read_fd: int, write_fd: int, stop: asyncio.Event, on_ready: OnReady) -> int:
    """Serve requests until ``Exit``, EOF or ``stop``; returns the exit status (0)."""
    lines = Lines(read_fd)
    out = Responses(write_fd)
    on_ready = out.ordered_ready(on_ready)
    running: asyncio.Task[str | None] | None = None
    role_stop = asyncio.Event()
    next_line = lines.get()
    stopper = asyncio.ensure_future(stop.wait())
    drained: asyncio.Future[Any] | None = None

    faults: list[str] = []  # root actors of the current run that failed unhandled

    def on_fault(event: Any) -> None:
        # A role's root actor failed with nobody to supervise it: that run ends with the
        # failure as its error, and the server serves on (a plain role process exits 1).
        log.error("unhandled failure of %s: %s", event.actor_id, event.message)
        if running is not None and not running.done():
            faults.append(f"{event.actor_id} failed: {event.message}")
            role_stop.set()

    hook_before = set_unhandled_fault_hook(on_fault)

    def answer(error: str) -> None:
        """The answer to a request that started nothing (the run's faults stay)."""
        out.write(finished_line(error))

    def finish(error: str | None) -> None:
        """The end of the run: its own error, else the first fault of its root actors."""
        if error is None and faults:
            error = faults[0]
        faults.clear()
        out.write(finished_line(error))

    async def end_run() -> None:
        nonlocal running
        if running is None:
            return
        role_stop.set()
        try:
            async with asyncio.timeout(_ROLE_STOP_BOUND_S):
                error = await asyncio.shield(running)
        except TimeoutError:
            running.cancel()
            error = f"the role did not stop within {_ROLE_STOP_BOUND_S:g} s"
        finish(error)
        running = None

    try:
        while True:
            waits: set[asyncio.Future[Any]] = {stopper}
            if out.backlogged:  # the launcher is not reading: read no more requests for now
                if drained is None or drained.done():
                    drained = asyncio.ensure_future(out.drained.wait())
                waits.add(drained)
            else:
                waits.add(next_line)
            if running is not None:
                waits.add(running)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if running is not None and running.done():
                finish(running.result())
                running = None
                continue
            if stopper.done():
                await end_run()
                return 0
            if out.backlogged or not next_line.done():
                continue
            line = next_line.result()
            next_line = lines.get()
            if line is None:
                await end_run()
                return 0
            if not line.strip():
                continue
            try:
                if line is TOO_LONG:
                    raise InvalidRequest(f"line longer than {MAX_LINE_BYTES} bytes")
                req = parse_request(line)
            except InvalidRequest as e:
                answer(f"invalid request: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - whatever the line does, keep serving
                answer(f"invalid request: {type(e).__name__}: {e}")
                continue
            if isinstance(req, ExitRequest):
                await end_run()
                return 0
            if running is not None:
                answer("invalid request: a Run is already in progress")
                continue
            role_stop = asyncio.Event()
            faults.clear()
            log.info("serve: starting %s", req.role)
            running = asyncio.ensure_future(run_role(req, role_stop, on_ready))
    finally:
        lines.close()
        next_line.cancel()
        stopper.cancel()
        if drained is not None:
            drained.cancel()
        if running is not None and not running.done():
            running.cancel()
        set_unhandled_fault_hook(hook_before)
        await out.close(_RESPONSES_CLOSE_S)
        lines.restore()
