"""`SPMDActor`: one rank of a torchrun-style program, an actor on every proc of a mesh.

It sets the rank's torch elastic variables (`palatine.spmd.env`) and runs the program
(`palatine.spmd.script`) on a thread of its own, ``spmd-main``: the proc's event loop
stays free while the program trains, so the proc answers stops, ``palatine stacks`` and
``palatine top`` throughout, and a launcher hears of the end as a `RankExited` message.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import socket
import sys
import threading
import time
from typing import Any

import msgspec

from palatine.core.actor import Actor, current_rank, endpoint
from palatine.core.ports import Port
from palatine.hosting.child_env import Handoff
from palatine.spmd.env import elastic_env, free_port, interface_to, master_host
from palatine.spmd.script import ScriptFailed, program_stack, run_program

__all__ = ["RankExited", "SPMDActor"]

#: The thread a rank's program runs on.
THREAD_NAME = "spmd-main"


class RankExited(msgspec.Struct, frozen=True):
    """A rank's program ended (`SPMDActor.start` sends it to the launcher's port):
    ``status`` is 0, its exit code, or the exception it ended with."""

    rank: int
    local_rank: int
    attempt: int
    status: int | ScriptFailed
    pid: int
    host: str
    ended_at: float  # time.time()


class SPMDActor(Actor):
    """Sets torchrun's environment on its proc and runs a program there as ``__main__``.

    Monarch's ``monarch.spmd.SPMDActor`` has the same endpoints ``get_host_port``,
    ``setup_env`` and ``main``; `start` is palatine's: it returns at once and reports the
    end to a port, so a program may run longer than any call's deadline."""

    def __init__(self) -> None:
        point = current_rank()
        extent = getattr(point, "extent", None)
        self._dims: list[tuple[str, int]] = list(extent.items()) if extent is not None else []
        self._rank: int = getattr(point, "rank", 0)
        self._running: threading.Thread | None = None
        self._store: Any = None  # the group's TCPStore server (`serve_store`), if here

    @endpoint
    def get_host_port(self, host: str | None = None) -> tuple[str, int]:
        """(address, port) for ``MASTER_ADDR``/``MASTER_PORT``: this proc's machine as the
        other ranks reach it (or ``host``), and a port free there now."""
        addr = host or master_host()
        return addr, free_port(addr)

    @endpoint
    def serve_store(
        self,
        world_size: int,
        host: str | None = None,
        port: int = 0,
        extra: dict[str, str] | None = None,
    ) -> tuple[str, int]:
        """Host the group's rendezvous store here, as torchrun's agent does: a TCPStore
        server on ``host`` (this proc's machine as the others reach it) and ``port`` (0:
        one the OS picks); (address, port) for ``MASTER_ADDR``/``MASTER_PORT``. With
        ``TORCHELASTIC_USE_AGENT_STORE=True`` every rank's ``init_process_group`` is then
        its client, so no rank waits for rank 0's program to have made it. ``extra`` is
        set first: the program's environment, which torch reads when it is imported
        here (``OMP_NUM_THREADS``: set later, torch's OpenMP threads would spin beside
        the program's)."""
        os.environ.update(extra or {})
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        addr = host or master_host()
        self._store = TCPStore(
            addr, port, world_size, is_master=True, wait_for_workers=False, use_libuv=True
        )
        return addr, int(self._store.port)

    @endpoint
    def system_addr(self) -> str:
        """The address of the system this proc belongs to (for ``palatine stacks``/``top``)."""
        return Handoff.from_env().bootstrap_addr or ""

    @endpoint
    def setup_env(
        self,
        master_addr: str,
        master_port: int,
        restart_count: int = 0,
        max_restarts: int = 0,
        extra: dict[str, str] | None = None,
    ) -> dict[str, str]:
        """Set this rank's torch elastic variables (and ``extra``) in its proc; returns them."""
        return self._apply_env(master_addr, master_port, restart_count, max_restarts, extra)

    def _apply_env(
        self,
        master_addr: str,
        master_port: int,
        restart_count: int,
        max_restarts: int = 0,
        extra: dict[str, str] | None = None,
    ) -> dict[str, str]:
        env = elastic_env(
            self._dims, self._rank, master_addr, master_port, restart_count, max_restarts
        )
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = interface_to(master_addr)
            if ifname is not None:
                env["GLOO_SOCKET_IFNAME"] = ifname
        env.update(extra or {})
        os.environ.update(env)
        threads = env.get("OMP_NUM_THREADS", "")
        torch = sys.modules.get("torch")  # imported already (a warm fork server's proc)
        if torch is not None and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))  # (read at its import otherwise)
        return env

    @endpoint
    def start(
        self,
        master_addr: str,
        master_port: int,
        program: list[str],
        report: Port[RankExited],
        restart_count: int = 0,
        max_restarts: int = 0,
        extra: dict[str, str] | None = None,
    ) -> int:
        """Set the environment and start ``program`` on the ``spmd-main`` thread; returns
        this proc's pid at once. When the program ends, `RankExited` goes to ``report``."""
        if self._running is not None:
            raise RuntimeError(f"rank {self._rank} already runs a program (pid {os.getpid()})")
        env = self._apply_env(master_addr, master_port, restart_count, max_restarts, extra)
        local_rank = int(env["LOCAL_RANK"])
        # The report is sent from the proc's loop, as this actor (a thread has no mailbox).
        loop, cx = asyncio.get_running_loop(), contextvars.copy_context()

        def body() -> None:
            status = run_program(program)
            exited = RankExited(
                rank=self._rank,
                local_rank=local_rank,
                attempt=restart_count,
                status=status,
                pid=os.getpid(),
                host=socket.gethostname(),
                ended_at=time.time(),
            )
            loop.call_soon_threadsafe(report.send, exited, context=cx)

        self._running = threading.Thread(target=body, name=THREAD_NAME, daemon=True)
        self._running.start()
        return os.getpid()

    @endpoint
    def stack(self) -> str:
        """Where this rank's program is now (its thread's Python stack, from the program's
        first frame); "" when none runs. The proc's loop answers while the program is
        stuck in a collective or a sleep: it runs on its own thread."""
        if self._running is None:
            return ""
        return program_stack(self._running, (__file__,))

    @endpoint
    async def main(
        self, master_addr: str, master_port: int, program: list[str], restart_count: int = 0
    ) -> int | ScriptFailed:
        """Set the environment and run ``program`` (``["train.py", *args]``,
        ``["-m", "module", *args]`` or ``["module:function", *args]``); its exit status
        (0, its exit code, or `ScriptFailed`). The call's deadline is the endpoint call
        timeout (``PALATINE_CALL_TIMEOUT``); `start` has none."""
        self._apply_env(master_addr, master_port, restart_count)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def body() -> None:
            status = run_program(program)
            loop.call_soon_threadsafe(_settle, done, status)

        threading.Thread(target=body, name=THREAD_NAME, daemon=True).start()
        result: int | ScriptFailed = await done
        return result


def _settle(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
