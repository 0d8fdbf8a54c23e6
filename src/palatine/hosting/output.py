"""Workers' output at the client: hosts forward it, the client aggregates and shows it.

What a worker prints goes to its host's pipes (`palatine.hosting.children`). A host
writes every line to the proc's log file and, by default, echoes it on its own console;
that console is the user's only when the host runs in (or under) the client's process.
For hosts anywhere else (a CLI cluster, other nodes), the client watches the output:

* the client's process runs one `OutputSink` actor; `watch_output` asks every host of a
  world (`WatchOutput`) to send that world's lines there instead of echoing them;
* the host's `OutputFanout` batches the lines (`OutputLines`, ``(rank, text)`` in order
  per proc) with at most one batch in flight per sink; what waits is bounded
  (``max_bytes``): past it, lines are dropped and counted, so an endless printer never
  blocks a worker nor grows memory, and the sink says how many it did not get; warnings
  and errors have a second ``max_bytes`` of their own, so they outlive such a flood;
* the sink aggregates identical lines from many ranks (`palatine.output.aggregate`:
  ``[worker 0-3] epoch 1 done``) and writes through a `ConsoleWriter`, which never
  blocks either.

A progress bar's states (``\r`` lines, tqdm) are forwarded as they come, at most
`palatine.output.progress.MAX_PER_S` a second per rank (the newest held back goes when
its turn comes), as lines ending in ``\r``; the sink shows them as one updating line per
group of ranks with the same state, below the ordinary output (`ProgressBoard`).

A sink that is gone (the client ended) stops the forwarding: the host echoes again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
from typing import TYPE_CHECKING, Any

from palatine import config
from palatine.core import runtime
from palatine.core.actor import Actor, handler
from palatine.core.future import on_loop_thread
from palatine.core.mailbox import Mailbox
from palatine.hosting.notebook import flush_each_cell
from palatine.ids import ActorId, ProcId
from palatine.output.aggregate import OutputAggregator
from palatine.output.console import (
    INTERNAL,
    NOTABLE,
    ConsoleWriter,
    chatter_shown,
    classify,
    record_level,
)
from palatine.output.progress import MAX_PER_S, PROGRESS_END, ProgressBoard, RateLimit
from palatine.protocol.agent import OutputLines, OutputTaken, OutputWatched, WatchOutput

if TYPE_CHECKING:
    from palatine.core.proc import Proc
    from palatine.hosting.children import Child
    from palatine.wire.envelope import Envelope

__all__ = [
    "OutputFanout",
    "OutputSink",
    "watch_output",
    "flush_output",
    "SINK_NAME",
    "DEFAULT_WINDOW_S",
]

log = logging.getLogger(__name__)

SINK_NAME = "output"
DEFAULT_WINDOW_S = 0.5
_BATCH_LINES = 2000
_BATCH_BYTES = 256 << 10
_SEND_TIMEOUT_S = 30.0


class _Watcher:
    """One sink of one world's output on this host: bounded pending lines, one batch in
    flight."""

    def __init__(
        self,
        fanout: OutputFanout,
        world: str,
        sink: ActorId,
        max_bytes: int,
        level: int | None = None,
    ) -> None:
        self.fanout = fanout
        self.world = world
        self.sink = sink
        self.max_bytes = max_bytes
        self.level = level  # the lowest level of log records sent (None: the default)
        self.pending: collections.deque[tuple[int, str]] = collections.deque()
        self.bytes = 0
        self.dropped = 0
        self.task: asyncio.Task[None] | None = None
        self.gone = False
        self.limits: dict[int, RateLimit] = {}  # per rank: its progress bar's states
        self._timer: asyncio.TimerHandle | None = None

    def add(self, rank: int, texts: list[str]) -> None:
        limit = self.limits.get(rank)
        if limit is not None:
            limit.drop()  # (a held state must not follow the lines that ended its bar)
        for text in texts:
            self._queue(rank, text)
        self._start()

    def progress(self, rank: int, state: str) -> None:
        """A progress bar's new state: sent now, or held (the newest) until the rank's
        turn (`RateLimit`)."""
        loop = asyncio.get_running_loop()
        limit = self.limits.setdefault(rank, RateLimit())
        now = loop.time()
        if limit.offer(state, now) is not None:
            self._queue(rank, state + PROGRESS_END)
            self._start()
        elif self._timer is None:
            at = limit.next_at()
            assert at is not None
            self._timer = loop.call_at(at, self._release)

    def _release(self) -> None:
        """Send the held states whose turn has come; wait again for the others."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for rank, limit in self.limits.items():
            state = limit.due(now)
            if state is not None:
                self._queue(rank, state + PROGRESS_END)
        self._start()
        later = [t for t in (lim.next_at() for lim in self.limits.values()) if t is not None]
        if later and not self.gone:
            self._timer = loop.call_at(min(later), self._release)

    def _queue(self, rank: int, text: str) -> None:
        # A warning or an error has a second ``max_bytes`` of its own: a flood of
        # ordinary lines is dropped (and counted), the warnings behind it still go.
        limit = self.max_bytes
        if self.bytes + len(text) > limit and classify(text.encode("utf-8", "replace")) == NOTABLE:
            limit *= 2
        if self.bytes + len(text) > limit:
            self.dropped += 1
            return
        self.pending.append((rank, text))
        self.bytes += len(text)

    def _start(self) -> None:
        if self.task is None and (self.pending or self.dropped):
            self.task = asyncio.get_running_loop().create_task(self._pump())

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.stop_timer()

    async def _pump(self) -> None:
        try:
            while self.pending or self.dropped:
                batch: list[tuple[int, str]] = []
                size = 0
                while self.pending and len(batch) < _BATCH_LINES and size < _BATCH_BYTES:
                    item = self.pending.popleft()
                    batch.append(item)
                    size += len(item[1])
                self.bytes -= size
                dropped, self.dropped = self.dropped, 0
                msg = OutputLines(
                    world=self.world, host=self.fanout.host, lines=batch, dropped=dropped
                )
                mailbox = self.fanout.mailbox
                assert mailbox is not None  # (watched only through the bound agent)
                await mailbox.ask(self.sink, msg, _SEND_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the sink is gone: echo again
            log.debug("output of %s to %s stopped: %s", self.world, self.sink, e)
            self.gone = True
            self.fanout.unwatch(self)
        finally:
            self.task = None


class OutputFanout:
    """A host's forwarding of its procs' output to the sinks that watch their worlds.

    `take` is the `palatine.hosting.children.ChildProcs` forward hook: it returns whether
    the lines were taken (then the host does not echo them).
    """

    def __init__(self) -> None:
        self.mailbox: Mailbox | None = None  # the host agent's, once it runs (`bind`)
        self.host = ""
        self._watchers: dict[str, _Watcher | None] = {}  # world -> its sink (None: silent)
        self._ranks: dict[str, int] = {}
        self._quiet = not chatter_shown()

    def bind(self, mailbox: Mailbox, host: str) -> None:
        """Send from ``mailbox`` (the host agent's), as ``host``."""
        self.mailbox = mailbox
        self.host = host

    def watch(
        self, world: str, sink: ActorId | None, max_bytes: int, level: int | None = None
    ) -> None:
        old = self._watchers.get(world)
        if old is not None:
            old.cancel()
        self._watchers[world] = (
            _Watcher(self, world, sink, max(4096, max_bytes), level) if sink is not None else None
        )

    def unwatch(self, watcher: _Watcher) -> None:
        if self._watchers.get(watcher.world) is watcher:
            del self._watchers[watcher.world]
        watcher.stop_timer()  # (its pump is ending: the caller)

    def take(self, child: Child, lines: list[bytes]) -> bool:
        if child.world not in self._watchers:
            return False
        watcher = self._watchers[child.world]
        if watcher is None:
            return True  # silenced: the log files only
        rank = self._ranks.get(child.proc_id)
        if rank is None:
            rank = self._ranks[child.proc_id] = ProcId.parse(child.proc_id).rank
        if len(lines) == 1 and lines[0].endswith(b"\r"):  # (`ChildProcs._progress`)
            watcher.progress(rank, lines[0][:-1].decode("utf-8", "replace"))
            return True
        level = watcher.level
        texts = [
            line.decode("utf-8", "replace").rstrip("\r")
            for line in lines
            if (
                not (self._quiet and classify(line) == INTERNAL)
                if level is None
                else _at_least(line, level, self._quiet)
            )
        ]
        if texts:
            watcher.add(rank, texts)
        return True

    def close(self) -> None:
        for watcher in self._watchers.values():
            if watcher is not None:
                watcher.cancel()
        self._watchers.clear()


def _at_least(line: bytes, level: int, quiet: bool) -> bool:
    """Whether a watcher that asked for records from ``level`` up sends ``line``."""
    rec = record_level(line)
    if rec is not None:
        return rec >= level
    return not (quiet and classify(line) == INTERNAL)


class OutputSink(Actor):
    """The client side: aggregates the lines hosts send and writes them to the console.

    One per client process (named `SINK_NAME`); ``windows`` holds each world's
    aggregation window in seconds (0: no aggregation)."""

    def __init__(self, console: ConsoleWriter | None = None) -> None:
        self.console = console or ConsoleWriter(
            complete_in="the procs' log files", name="palatine-output"
        )
        self.windows: dict[str, float] = {}
        self._aggs: dict[str, OutputAggregator] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.board: ProgressBoard | None = None  # the workers' progress bars, once one came
        self._draw_timer: asyncio.TimerHandle | None = None
        self._drawn_at = -1.0
        flush_each_cell(self)  # in a notebook, each cell's output stays in that cell

    def _agg(self, world: str) -> OutputAggregator:
        agg = self._aggs.get(world)
        window = self.windows.get(world, DEFAULT_WINDOW_S)
        if agg is None or agg.window_s != window:
            if agg is not None:
                self._write(agg.flush())
            agg = self._aggs[world] = OutputAggregator(window)
        return agg

    @handler
    def on_lines(self, msg: OutputLines) -> OutputTaken:
        loop = asyncio.get_running_loop()
        now = loop.time()
        agg = self._agg(msg.world)
        out: list[str] = []
        redraw = False
        for rank, text in msg.lines:
            if text.endswith(PROGRESS_END):
                if self.board is None:
                    self.board = ProgressBoard(self.console.isatty(), self.console.columns())
                self.board.update(msg.world, rank, text[: -len(PROGRESS_END)])
                redraw = True
                continue
            if self.board is not None and self.board.done(msg.world, rank):
                redraw = True
            out += agg.add(msg.world, rank, text, now)
        if msg.dropped:
            out += agg.flush()
            out.append(
                f"[palatine] {msg.dropped} lines of output not shown: {msg.world} on "
                f"{msg.host} printed faster than the client took it; all of it is in the "
                "procs' log files\n"
            )
        self._write(out)
        self._arm(loop)
        if redraw and self._draw_timer is None:
            at = max(now, self._drawn_at + 1.0 / MAX_PER_S)
            self._draw_timer = loop.call_at(at, self._redraw)
        return OutputTaken()

    def _redraw(self) -> None:
        """The progress bars' block, redrawn with their latest states (at most
        `MAX_PER_S` times a second)."""
        self._draw_timer = None
        self._drawn_at = asyncio.get_running_loop().time()
        if self.board is not None:
            self.console.write(self.board.draw())

    def handle_undeliverable(self, returned: Envelope) -> None:
        """An `OutputTaken` to a host that has ended meanwhile: nothing to tell anyone."""
        log.debug("output sink: %s is gone: %s", returned.dest, "; ".join(returned.errors or ()))

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            return
        due = [t for t in (a.next_due() for a in self._aggs.values()) if t is not None]
        if due:
            self._timer = loop.call_at(min(due), self._due)

    def _due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for agg in self._aggs.values():
            self._write(agg.due(now))
        self._arm(loop)

    def _write(self, lines: list[str]) -> None:
        """Queue whole lines; warnings and errors as notable (kept when the console drops
        ordinary output)."""
        if not lines:
            return
        board = self.board
        if board is not None and board.shown:  # (the lines go above the progress bars)
            self.console.write(board.erase(), notable=True)
        run: list[str] = []
        run_notable = False
        for line in lines:
            notable = classify(line.encode("utf-8", "replace")) == NOTABLE
            if run and notable != run_notable:
                self.console.write("".join(run), notable=run_notable)
                run = []
            run_notable = notable
            run.append(line)
        if run:
            self.console.write("".join(run), notable=run_notable)
        if board is not None and board.groups():
            self.console.write(board.draw())

    def flush(self, timeout_s: float = 1.0) -> None:
        """Write everything held now, and wait (bounded) until it is written."""
        self._write_held()
        self.console.flush(timeout_s)

    def _write_held(self) -> None:
        for agg in self._aggs.values():
            self._write(agg.flush())
        if self.board is not None:  # (the bars stay on screen, the next output below)
            self.console.write(self.board.end())

    def flush_cell(self, timeout_s: float) -> None:
        """`flush` from another thread (a notebook cell's end): the held lines are
        written on the loop, then the console is waited for, both within ``timeout_s``."""
        if on_loop_thread():
            self._write_held()
            return

        async def write_held() -> None:
            self._write_held()

        runtime.submit(write_held).get(timeout_s)
        self.console.flush(timeout_s)

    async def on_stop(self, reason: str) -> None:
        if self._draw_timer is not None:
            self._draw_timer.cancel()
            self._draw_timer = None
        self.flush()
        self.console.close(1.0)


def flush_output(proc: Proc, timeout_s: float = 1.0) -> None:
    """Write what ``proc``'s `OutputSink` holds (a process about to end)."""
    inst = proc.instance(proc.proc_id.actor(SINK_NAME))
    if inst is not None and isinstance(inst.actor, OutputSink):
        inst.actor.flush(timeout_s)


async def watch_output(
    proc: Proc,
    mailbox: Mailbox,
    world: str,
    hosts: list[ProcId],
    *,
    stream: bool | None = None,
    window_s: float | None = None,
    level: int | None = None,
) -> list[OutputWatched]:
    """Have ``hosts`` send ``world``'s output to this process's `OutputSink` (spawned on
    ``proc`` on first use), aggregated over ``window_s``; with ``stream`` False, to
    nobody: the procs' log files only, whose directories are named once on stderr.
    ``level``: the lowest level of the procs' log records sent (None: WARNING and up,
    unless palatine's log level is DEBUG). Defaults: `Config.stream_output`,
    `Config.output_window_s`. The hosts' replies."""
    cfg = config.get()
    stream = cfg.stream_output if stream is None else stream
    window_s = cfg.output_window_s if window_s is None else window_s
    sink: ActorId | None = None
    if stream:
        sink = proc.proc_id.actor(SINK_NAME)
        inst = proc.instance(sink)
        if inst is None:
            sink = await proc.spawn(SINK_NAME, OutputSink)
            inst = proc.instance(sink)
        assert inst is not None and isinstance(inst.actor, OutputSink)
        inst.actor.windows[world] = window_s
    msg = WatchOutput(
        world=world, sink=sink, max_bytes=config.get().console_buffer_bytes, level=level
    )
    t = config.get().rpc_timeout_s
    replies: list[Any] = await asyncio.gather(
        *(mailbox.ask(h.actor("proc"), msg, t) for h in hosts), return_exceptions=True
    )
    watched = [r for r in replies if isinstance(r, OutputWatched)]
    for host, r in zip(hosts, replies, strict=True):
        if not isinstance(r, OutputWatched):
            log.warning("the output of %s on %s cannot be watched: %s", world, host, r)
    if not stream and watched:
        dirs = sorted({w.log_dir for w in watched})
        print(
            f"[palatine] the output of {world} is not streamed; it is in the log files "
            f"under {', '.join(dirs)}",
            file=sys.stderr,
            flush=True,
        )
    return watched
