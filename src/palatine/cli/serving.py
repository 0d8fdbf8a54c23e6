"""``palatine serve``: run system, host and controller roles on JSON-lines requests.

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
import contextlib
import io
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from palatine.channel.addr import ChannelAddr
from palatine.config import roles
from palatine.config.roles import HostOptions, SystemOptions
from palatine.core.supervision_hook import set_unhandled_fault_hook
from palatine.errors import ConfigError, JoinError
from palatine.ids import WorldId, is_host_world
from palatine.tensor.controller.bootstrap import BootstrapError
from palatine.tensor.controller.startup import ControllerCommand, validate_command

__all__ = [
    "ControllerCommand",
    "ExitRequest",
    "HostCommand",
    "InvalidRequest",
    "MAX_LINE_BYTES",
    "RunRequest",
    "SystemCommand",
    "SystemRefused",
    "check_cli_args",
    "check_role",
    "finished_line",
    "parse_request",
    "run_host",
    "run_role",
    "run_system",
    "serve",
    "start_metrics",
    "TOO_LONG",
    "Lines",
    "OnReady",
    "Responses",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the pipes
# Request lines in and response lines out through the loop, so a launcher slow to read
# or write never blocks it; reading ahead is bounded, and no request is read while too
# many responses wait.


MAX_LINE_BYTES = 1 << 20
TOO_LONG = b"<a line over MAX_LINE_BYTES>"  # queued for such a line (told apart by identity)
_READ_AHEAD_LINES = 256  # request lines read ahead of the server at most
_RESPONSES_HIGH = 1 << 20  # response bytes waiting to be read before requests wait too

OnReady = Callable[..., None]
"""``on_ready(role, addr, **extra)``: the role can serve (print the ready line; ``extra``:
the system's ``metrics_addr``)."""


class Lines:
    """Lines read from a non-blocking fd through the loop; ``None`` at EOF.

    A pipe or socket is read when the loop says it is readable; a regular file (or
    ``/dev/null``), which cannot be polled and never blocks, is read a chunk per loop turn.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._buf = bytearray()
        self._skipping = False
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._paused = False
        self._was_blocking = os.get_blocking(fd)
        os.set_blocking(fd, False)
        try:
            self._loop.add_reader(fd, self._readable)
            self._polled = True
        except PermissionError:  # not pollable: a regular file
            self._polled = False
            self._loop.call_soon(self._read_turn)

    def restore(self) -> None:
        """Give the fd back as it was (blocking or not): it may be shared."""
        try:
            os.set_blocking(self.fd, self._was_blocking)
        except OSError:
            pass

    def get(self) -> asyncio.Future[bytes | None]:
        """The next line (``None`` at EOF), as a future; reading resumes once the lines
        read ahead are taken (at most `_READ_AHEAD_LINES` wait)."""
        if self._paused and not self._closed and self.queue.qsize() <= _READ_AHEAD_LINES // 2:
            self._paused = False
            if self._polled:
                self._loop.add_reader(self.fd, self._readable)
            else:
                self._loop.call_soon(self._read_turn)
        return asyncio.ensure_future(self.queue.get())

    def _pause_if_ahead(self) -> None:
        if not self._closed and not self._paused and self.queue.qsize() >= _READ_AHEAD_LINES:
            self._paused = True
            if self._polled:
                self._loop.remove_reader(self.fd)

    def _read_turn(self) -> None:
        if not self._closed and not self._paused:
            self._readable()
            if not self._closed and not self._paused:
                self._loop.call_soon(self._read_turn)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError as e:
            log.warning("reading requests: %s", e)
            data = b""
        if not data:
            self.close()
            if self._buf.strip() and not self._skipping:
                self.queue.put_nowait(bytes(self._buf))
            self._buf.clear()
            self.queue.put_nowait(None)
            return
        if self._skipping:  # the rest of a line over the limit: dropped as it comes
            i = data.find(b"\n")
            if i < 0:
                return
            self._skipping = False
            data = data[i + 1 :]
        self._buf += data
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                break
            line = bytes(self._buf[:i])
            del self._buf[: i + 1]
            self.queue.put_nowait(line if len(line) <= MAX_LINE_BYTES else TOO_LONG)
        if len(self._buf) > MAX_LINE_BYTES and not self._skipping:
            self._buf.clear()
            self._skipping = True
            self.queue.put_nowait(TOO_LONG)
        self._pause_if_ahead()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._polled and not self._paused:
                self._loop.remove_reader(self.fd)


def _same_file(fd: int, other: int) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.fstat(other))
    except OSError:
        return False


class Responses:
    """Response lines written to a non-blocking fd through the loop: a launcher that is
    slow to read never blocks the loop (nor the role it runs). While more than
    `_RESPONSES_HIGH` bytes wait, `backlogged` holds and the server reads no requests."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._polled = False
        self._broken = False
        self.drained = asyncio.Event()
        self.drained.set()
        # Shared with this process's stderr (logging), the fd stays blocking: a full pipe
        # then blocks the loop, as a full stderr would anyway. Shared with stdout, the ready
        # lines go through here too (`ordered_ready`), so lines never interleave.
        self.shares_stdout = _same_file(fd, 1)
        self._was_blocking = os.get_blocking(fd)
        if not _same_file(fd, 2):
            try:
                os.set_blocking(fd, False)
            except OSError as e:
                log.warning("responses: %s", e)

    @property
    def backlogged(self) -> bool:
        return len(self._buf) > _RESPONSES_HIGH

    def write(self, data: bytes) -> None:
        if self._broken:
            log.warning(
                "response not written (the response fd is broken): %s",
                data.decode(errors="replace").strip(),
            )
            return
        self._buf += data
        self._flush()

    def _flush(self) -> None:
        buf = self._buf
        while buf:
            try:
                n = os.write(self.fd, buf)
            except BlockingIOError:
                break
            except OSError as e:
                log.warning("cannot write the responses: %s", e)
                self._broken = True
                buf.clear()
                break
            del buf[:n]
        if buf:
            self.drained.clear()
            if not self._polled:
                self._loop.add_writer(self.fd, self._flush)
                self._polled = True
        else:
            if self._polled:
                self._loop.remove_writer(self.fd)
                self._polled = False
            self.drained.set()

    async def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for what is queued to be written, then stop."""
        if self._buf:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.drained.wait()
            except TimeoutError:
                log.warning(
                    "%d bytes of responses not read within %g s: dropped", len(self._buf), timeout_s
                )
        if self._polled:
            self._loop.remove_writer(self.fd)
            self._polled = False
        try:
            os.set_blocking(self.fd, self._was_blocking)  # (it may be shared)
        except OSError:
            pass

    def ordered_ready(self, on_ready: OnReady) -> OnReady:
        """``on_ready`` for a server whose responses go to its stdout: what it prints is
        queued behind the responses already written, never into the middle of one."""
        if not self.shares_stdout:
            return on_ready

        def ready(role: str, addr: str, **extra: str) -> None:
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                on_ready(role, addr, **extra)
            self.write(text.getvalue().encode())

        return ready


_ROLE_STOP_BOUND_S = 20.0
_RESPONSES_CLOSE_S = 1.0  # at the end: how long responses may take to be read


class SystemCommand(SystemOptions, kw_only=True, forbid_unknown_fields=True):
    """``Run.System`` (and ``palatine system``'s flags): serve the system actor at
    ``system_addr``; the options are `SystemOptions`' (None: the configuration decides,
    ``PALATINE_*``, else 20 and 10 s)."""

    system_addr: str


class HostCommand(HostOptions, kw_only=True, forbid_unknown_fields=True):
    """``Run.Host`` (and ``palatine host``'s flags): a host proc ``host_world[host_rank]``;
    the options are `HostOptions`'."""

    system_addr: str
    host_world: str
    host_rank: int


class RunRequest(msgspec.Struct, frozen=True):
    """A decoded ``Run`` request."""

    role: Literal["System", "Host", "Controller"]
    command: SystemCommand | HostCommand | ControllerCommand
    system_addr: ChannelAddr  # the command's, parsed once here (where it arrives as text)


class ExitRequest(msgspec.Struct, frozen=True):
    """A decoded ``Exit`` request."""


class InvalidRequest(ValueError):
    """A request line that cannot be served; the text follows ``invalid request: ``."""


_ROLES: dict[str, type[Any]] = {
    "System": SystemCommand,
    "Host": HostCommand,
    "Controller": ControllerCommand,
}


def check_role(cmd: SystemCommand | HostCommand, name: Callable[[str], str]) -> ChannelAddr:
    """Semantic checks of a System or Host command (from serve or the CLI): addresses,
    names, the options' bounds (`palatine.config.roles.check`; a field left None is not
    checked: its default applies); the system's address, parsed. ``name(field)`` is how
    the caller spells a field in the error: ``Run.Host.host_rank`` for serve,
    ``--host-rank`` for the CLI."""
    try:
        addr = ChannelAddr.parse(cmd.system_addr)
    except ValueError as e:
        raise InvalidRequest(f"{name('system_addr')} {cmd.system_addr!r}: {e}") from None
    if isinstance(cmd, HostCommand):
        try:
            WorldId.parse(cmd.host_world)
        except ValueError as e:
            raise InvalidRequest(f"{name('host_world')} {cmd.host_world!r}: {e}") from None
        if not is_host_world(cmd.host_world):
            raise InvalidRequest(f"{name('host_world')} {cmd.host_world!r} must start with 'host'")
        if not 0 <= cmd.host_rank < 2**64:
            raise InvalidRequest(f"{name('host_rank')} must be in [0, 2**64), got {cmd.host_rank}")
    try:
        roles.check(cmd, name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return addr


def check_cli_args(cmd: SystemCommand | HostCommand) -> ChannelAddr:
    """`check_role` for a role's command line; raises `ConfigError` (exit 2)."""
    try:
        return check_role(cmd, roles.flag)
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None


def _check(role: str, cmd: Any) -> ChannelAddr:
    """Semantic checks: addresses, names, ranges (the same rules as the CLI)."""
    if role == "Controller":
        try:
            return validate_command(cmd)
        except ConfigError as e:
            raise InvalidRequest(f"Run.Controller: {e}") from None
    return check_role(cmd, lambda field: f"Run.{role}.{field}")


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
    return RunRequest(role, cmd, _check(role, cmd))


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


def start_metrics(text: str, handle: Any) -> Any:
    """A `palatine.system.metrics.MetricsServer` at ``text`` (``HOST:PORT``, port 0: any
    free one) over the system of ``handle``; `OSError` or `ValueError` when it cannot."""
    from palatine.system.metrics import MetricsServer

    host, _, port = text.rpartition(":")
    return MetricsServer(host.strip("[]") or "127.0.0.1", int(port), handle.proc, handle.actor.reg)


class SystemRefused(msgspec.Struct, frozen=True):
    """Why the system role could not start: the text for ``Finished`` and the exit code
    ``palatine system`` reports it with (2 for an option that cannot be served, such as
    ``--metrics-addr``, as for any usage error; 1 when the system itself cannot serve)."""

    text: str
    exit_code: int


async def run_system(
    cmd: SystemCommand, addr: ChannelAddr, stop: asyncio.Event, on_ready: OnReady
) -> SystemRefused | None:
    """Serve the system at ``addr`` (``cmd.system_addr``, parsed) until it is stopped
    (``palatine stop``) or ``stop`` is set; None when it ended that way."""
    from palatine.system.service import System

    try:
        handle = await System.serve(
            addr,
            supervision_update_timeout_s=cmd.supervision_update_timeout_s,
            world_eviction_timeout_s=cmd.world_eviction_timeout_s,
        )
    except Exception as e:  # noqa: BLE001 - the Finished message
        return SystemRefused(f"cannot serve the system at {cmd.system_addr}: {e}", 1)
    metrics = None
    if cmd.metrics_addr is not None:
        try:
            metrics = start_metrics(cmd.metrics_addr, handle)
        except (OSError, ValueError, OverflowError) as e:  # (a port past 65535: OverflowError)
            await handle.close()
            return SystemRefused(f"cannot serve metrics at {cmd.metrics_addr!r}: {e}", 2)
    try:
        if metrics is None:
            on_ready("system", str(handle.addr))
        else:
            on_ready(
                "system",
                str(handle.addr),
                metrics_addr=metrics.addr,
                metrics_token_file=str(metrics.token_file),
            )
        if await _until(handle.wait(), stop):
            await handle.close()
        else:
            await handle.stop()
    finally:
        if metrics is not None:
            await asyncio.to_thread(metrics.close)
    return None


async def run_host(
    cmd: HostCommand, addr: ChannelAddr, stop: asyncio.Event, on_ready: OnReady
) -> str | None:
    """Run host ``host_world[host_rank]`` of the system at ``addr`` (``cmd.system_addr``,
    parsed) until the system stops it or ``stop`` is set."""
    from palatine.hosting.host import HostAgent, join_host

    try:
        handle = await join_host(
            cmd.host_world,
            cmd.host_rank,
            addr,
            cmd.supervision_update_interval_s,
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
    cmd: ControllerCommand, addr: ChannelAddr, stop: asyncio.Event, on_ready: OnReady
) -> str | None:
    from palatine.tensor.controller.bootstrap import run_controller

    try:
        code, why = await run_controller(
            cmd, addr, stop, lambda served: on_ready("controller", served)
        )
    except BootstrapError as e:
        return str(e)
    return (why or f"controller exited with status {code}") if code else None


async def run_role(req: RunRequest, stop: asyncio.Event, on_ready: OnReady) -> str | None:
    """Run one role to its end; the error message for ``Finished``, or None."""
    cmd = req.command  # of the role's type (`_ROLES`): the role is told by it
    try:
        if isinstance(cmd, SystemCommand):
            refused = await run_system(cmd, req.system_addr, stop, on_ready)
            return None if refused is None else refused.text
        if isinstance(cmd, HostCommand):
            return await run_host(cmd, req.system_addr, stop, on_ready)
        return await _run_controller(cmd, req.system_addr, stop, on_ready)
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
