"""What every long-running role shares: logging, config, the loop, signals, ready line.

A role runs its loop in the main thread (uvloop when configured), prints one JSON ready
line on stdout once it can serve, logs to stderr, exits 0 on SIGTERM/SIGINT after a
clean stop, 1 when a root actor fails unhandled, and 2 for a configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from palatine import config
from palatine.core import runtime
from palatine.core.supervision_hook import set_unhandled_fault_hook
from palatine.errors import ConfigError
from palatine.hosting.child_env import Handoff
from palatine.hosting.limits import raise_open_files_limit
from palatine.output.console import LineFormatter

if TYPE_CHECKING:
    from palatine.channel.addr import ChannelAddr

__all__ = [
    "run_role",
    "ready_line",
    "add_seconds_flag",
    "add_system_addr_flag",
    "channel_addr_arg",
    "setup_logging",
    "ask_system",
]

log = logging.getLogger("palatine")


def setup_logging() -> None:
    """Log to stderr in `LOG_FORMAT`, the header on every line (what launchers sort by)."""
    try:
        name = config.get().log_level.upper()
    except ConfigError:  # reported by the role's own config check
        name = "INFO"
    level = logging.getLevelName(name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter())
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO, handlers=[handler])
    if not isinstance(level, int):
        logging.getLogger("palatine").warning(
            "PALATINE_LOG_LEVEL=%s is not a level (DEBUG, INFO, WARNING, ERROR); using INFO", name
        )


def ask_system(
    command: str,
    system_addr: ChannelAddr,
    work: Callable[[], Awaitable[Any]],
    timeout_s: float | None = None,
) -> Any:
    """Run ``work()`` (a client command's talk with the system) on a fresh palatine loop
    and return its result; a timeout (``timeout_s``: the bound to name) or an error is
    printed as ``palatine COMMAND: ...`` and raises `SystemExit` with status 1."""
    loop = runtime.new_event_loop()
    try:
        return loop.run_until_complete(work())
    except TimeoutError:
        within = f" within {timeout_s:g} s" if timeout_s is not None else ""
        print(
            f"palatine {command}: no answer from system at {system_addr}{within}",
            file=sys.stderr,
        )
    except Exception as e:  # noqa: BLE001 - a CLI reports and exits
        print(f"palatine {command}: {e}", file=sys.stderr)
    finally:
        loop.close()
    raise SystemExit(1)


def ready_line(role: str, addr: Any, **extra: str | None) -> None:
    """The one JSON line a role prints on stdout once it can serve (``extra`` keys that
    are not None follow the four fixed ones: the system's ``metrics_addr``)."""
    line = {"event": "ready", "role": role, "addr": str(addr), "pid": os.getpid()}
    line.update({k: v for k, v in extra.items() if v is not None})
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def channel_addr_arg(text: str) -> ChannelAddr:
    """argparse ``type=`` of an address flag: the text parsed once, where it enters; bad
    text is argparse's usage error (exit 2): ``argument --system-addr: invalid address
    'foo': ...``."""
    from palatine.channel.addr import ChannelAddr

    try:
        return ChannelAddr.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid address {text!r}: {e}") from None


def add_system_addr_flag(p: argparse.ArgumentParser) -> None:
    """``--system-addr`` of a client command (stop, snapshot, stacks, top): a `ChannelAddr`."""
    p.add_argument(
        "--system-addr",
        required=True,
        type=channel_addr_arg,
        metavar="ADDR",
        help="address of the system (tcp:HOST:PORT, unix:PATH, ...)",
    )


def add_seconds_flag(p: Any, flag: str, default: float | None, help_text: str) -> None:
    p.add_argument(flag, type=float, default=default, help=help_text)


def _watch_lifeline(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Stop as on SIGTERM when the launcher's lifeline pipe reaches EOF (launcher gone)."""
    text = os.environ.pop(Handoff.variable("lifeline_fd"), None)
    if not text:
        return
    try:
        fd = int(text)
        os.set_blocking(fd, False)
    except (ValueError, OSError):
        return

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            os.close(fd)
            log.warning("launcher gone (lifeline closed); stopping")
            stop.set()

    loop.add_reader(fd, readable)


def run_role(main: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """Run ``main(stop_event)`` on a fresh loop in this thread; map failures to exit codes."""
    setup_logging()
    raise_open_files_limit()  # a soft limit below the hard one only fails jobs later
    try:
        config.reload()
    except ConfigError as e:
        print(f"palatine: {e}", file=sys.stderr)
        return 2
    loop = runtime.new_event_loop()
    asyncio.set_event_loop(loop)
    exit_code: list[int] = []

    def fault(event: Any) -> None:
        log.error("unhandled failure of %s: %s", event.actor_id, event.message)
        exit_code.append(1)
        stop.set()

    set_unhandled_fault_hook(fault)
    stop = asyncio.Event()

    async def body() -> int:
        runtime.adopt_current_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        _watch_lifeline(loop, stop)
        return await main(stop)

    try:
        code = loop.run_until_complete(body())
    except ConfigError as e:
        print(f"palatine: {e}", file=sys.stderr)
        code = 2
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
    return exit_code[0] if exit_code else code
