"""The dashboard of one job: its page, its JSON and a proc's stacks and log, over HTTP.

`Dashboard` joins the job's system as a detached client (as ``palatine top`` does), reads
a snapshot every ``interval_s`` into a `JobView` (so failures and metrics are kept while
no page is open), and serves on loopback by default, behind a random token:

* ``/`` the page (`palatine.system.dashboard.page`);
* ``/api/state`` the worlds, procs, failures and metrics (a fresh snapshot when the last
  is older than a tenth of a second, so a killed worker shows at the page's next poll);
* ``/api/stacks?proc=W[r]`` the proc's Python stacks, dumped by its host from outside as
  ``palatine stacks`` does, so a proc whose loop is stuck still answers;
* ``/api/log?proc=W[r]`` the last lines of its log file (``<log_dir>/<execution>/...``,
  `palatine.hosting.child_env.log_path_for`), when the job's log dir is known.

Everything runs on the caller's palatine loop; `Dashboard.url` is the link to print.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from pathlib import Path
from typing import Any

from palatine.hosting.child_env import log_path_for
from palatine.ids import ActorId, ProcId
from palatine.protocol.agent import StackDump, StackTrace
from palatine.protocol.system import Stimuli, StimulusLog, SystemSnapshot
from palatine.system.dashboard.http import HttpServer, Reply
from palatine.system.dashboard.page import PAGE
from palatine.system.dashboard.view import JobView
from palatine.system.service import SystemClient

__all__ = ["Dashboard", "ask_stacks", "tail"]

log = logging.getLogger(__name__)

_SNAPSHOT_S = 5.0  # a snapshot lost with a system that is restarted is asked again then
_STACKS_S = 15.0
_FRESH_S = 0.1
_TAIL_BYTES = 64 * 1024
_STIMULI_KEPT = 200  # the newest stimuli read per snapshot, for failures in between


async def ask_stacks(
    client: SystemClient, proc: str, host_proc: str | None, native: bool, timeout_s: float
) -> StackTrace:
    """The stacks of ``proc``, dumped by its host (``host_proc``) when it has one, so a
    stuck loop does not stop the answer; an error goes in the reply, never raised."""
    pid = ProcId.parse(proc)
    asked = ProcId.parse(host_proc) if host_proc else pid
    msg = StackDump(target=pid, native=native, timeout_s=timeout_s)
    try:
        reply = await client.mailbox.ask(ActorId(asked, "proc", 0), msg, timeout_s + 2)
    except Exception as e:  # noqa: BLE001 - the proc's error is its answer
        return StackTrace(proc_id=pid, error=f"{proc} (via {asked}): {e}")
    assert isinstance(reply, StackTrace)
    return reply


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path`` (of its last 64 KiB at most)."""
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - _TAIL_BYTES))
        data = f.read()
    text = data.decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


class Dashboard:
    """A job's dashboard, on a system ``client`` already attached (see the module)."""

    def __init__(
        self,
        client: SystemClient,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_dir: str | None = None,
        job: dict[str, str] | None = None,
        interval_s: float = 0.5,
        token: str | None = None,
    ) -> None:
        self.client = client
        self.log_dir = log_dir
        self.interval_s = interval_s
        self.token = secrets.token_hex(24) if token is None else token
        self.view = JobView(job)
        self.http = HttpServer(self._handle, self.token, host, port)
        self._read_at = 0.0
        self._reading: asyncio.Future[SystemSnapshot] | None = None
        self._poller: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = self.http.host if ":" not in self.http.host else f"[{self.http.host}]"
        return f"http://{host}:{self.http.port}/?token={self.token}"

    async def start(self) -> None:
        """Read a first snapshot, then serve and keep reading."""
        await self.refresh()
        await self.http.start()
        self._poller = asyncio.create_task(self._poll(), name="dashboard-poll")

    async def close(self) -> None:
        for task in (self._poller, self._reading):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.http.close()

    async def refresh(self) -> SystemSnapshot:
        """A new snapshot into the view; callers at the same time share one read."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
            # (its error is every waiter's; with none left, as at close, it is only read)
            self._reading.add_done_callback(lambda f: f.cancelled() or f.exception())
        reading = self._reading
        try:
            return await asyncio.shield(reading)
        finally:
            if self._reading is reading and reading.done():
                self._reading = None

    async def _read(self) -> SystemSnapshot:
        try:
            snap: SystemSnapshot | BaseException
            stimuli: Any
            async with asyncio.timeout(_SNAPSHOT_S):
                snap, stimuli = await asyncio.gather(
                    self.client.snapshot(),
                    self.client.ask(Stimuli(limit=_STIMULI_KEPT), _SNAPSHOT_S),
                    return_exceptions=True,
                )
        finally:
            self._reading = None
        if isinstance(snap, BaseException):
            raise snap
        self._read_at = time.monotonic()
        if isinstance(stimuli, StimulusLog):
            self.view.observe_stimuli(stimuli)
        else:  # an older system: failures come from the snapshots alone
            log.debug("dashboard: no stimulus log: %s", stimuli)
        self.view.observe(snap)
        return snap

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - the page says the system is silent
                what = str(e) or type(e).__name__
                log.warning("dashboard: no snapshot from %s: %s", self.client.system_addr, what)

    async def _handle(self, path: str, query: dict[str, str]) -> Reply:
        match path:
            case "/" | "/index.html":
                return Reply(200, "text/html; charset=utf-8", PAGE.encode())
            case "/api/state":
                silent = ""
                if time.monotonic() - self._read_at > _FRESH_S:
                    try:
                        await self.refresh()
                    except Exception as e:  # noqa: BLE001 - the page shows the last state, and why
                        silent = f"no snapshot from the system at {self.client.system_addr}: "
                        silent += str(e) or type(e).__name__
                return Reply.json({**self.view.state(), "system_error": silent})
            case "/api/stacks":
                return await self._stacks(query.get("proc", ""), query.get("native") == "1")
            case "/api/log":
                return await self._log(query.get("proc", ""), int(query.get("lines", "200")))
            case _:
                return Reply.text(f"no page {path}", 404)

    def _entry(self, proc: str) -> Any:
        snap = self.view.snapshot
        world = proc.rpartition("[")[0]
        if snap is None or world not in snap.worlds or proc not in snap.worlds[world].procs:
            return None
        return snap.worlds[world].procs[proc]

    async def _stacks(self, proc: str, native: bool) -> Reply:
        entry = self._entry(proc)
        if entry is None:
            return Reply.json({"proc": proc, "error": f"no proc {proc} in this job"}, 404)
        if entry.health != "Alive":
            return Reply.json({"proc": proc, "error": f"{proc} is not alive ({entry.health})"})
        t = await ask_stacks(self.client, proc, entry.host_proc, native, _STACKS_S)
        return Reply.json({"proc": proc, "method": t.method, "text": t.text, "error": t.error})

    async def _log(self, proc: str, lines: int) -> Reply:
        entry = self._entry(proc)
        snap = self.view.snapshot
        if entry is None or snap is None:
            return Reply.json({"proc": proc, "error": f"no proc {proc} in this job"}, 404)
        if self.log_dir is None:
            return Reply.json({"proc": proc, "error": "this job's log dir is not known here"})
        path = log_path_for(self.log_dir, snap.execution_id, entry.host_proc or "", proc)
        try:
            text = await asyncio.to_thread(tail, path, max(1, min(lines, 2000)))
        except OSError as e:
            return Reply.json({"proc": proc, "path": str(path), "error": str(e)})
        return Reply.json({"proc": proc, "path": str(path), "text": text})
