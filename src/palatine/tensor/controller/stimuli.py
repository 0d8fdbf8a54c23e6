"""The controller's stimulus ids and its bounded log of recent stimuli, sans-IO.

Like the system's registry, the controller names each stimulus of its cores that decides
something (a timer, a message, a task's outcome) ``<kind>-<n>`` (``check-12``,
``proc-failed-3``; ``n`` counts the stimuli given an id, one counter per controller):
every instruction it produces carries that id (``stimulus_id``), and it enters a bounded
log of recent stimuli that `Introspect` returns. An id is made only when the first
instruction needs it, so a stimulus that decides nothing (most accepted Nodes) costs
nothing here.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple, assert_never

from palatine.config import format_seconds
from palatine.protocol.controller import (
    Fail,
    Instruction,
    LogLine,
    QueryWorldState,
    RequestStacks,
    Schedule,
    SendProbe,
    Warn,
)
from palatine.protocol.system import StimulusEntry, instruction_lines, summary_text

__all__ = ["NODE", "Stimuli", "describe"]

NODE = "node"
"""The kind of a stimulus whose entry named none: an accepted Node, the hot path, which
begins nothing (the kind returns to it after every stimulus)."""


class _Entry(NamedTuple):
    stimulus_id: str
    at: float  # the cores' clock (the event loop's)
    subject: str
    instructions: list[Instruction]


def describe(ins: Instruction) -> str:
    """One instruction in a line of the stimulus log."""
    match ins:
        case Schedule():
            return f"Schedule {type(ins.timer).__name__} in {format_seconds(ins.delay_s)} s"
        case SendProbe():
            return f"SendProbe s{ins.seq} to ranks {', '.join(map(str, ins.ranks))}"
        case Fail():
            return f"Fail {ins.failure.kind}: {summary_text(ins.failure.message)}"
        case Warn():
            return f"Warn: {summary_text(ins.message)}"
        case LogLine():
            return f"LogLine {ins.level}: {summary_text(ins.message)}"
        case QueryWorldState():
            return "QueryWorldState"
        case RequestStacks():
            ranks = ", ".join(map(str, ins.ranks))
            return f"RequestStacks report {ins.report_id} s{ins.expected_seq} of ranks {ranks}"
        case _:
            assert_never(ins)


class Stimuli:
    """Stimulus ids and the log of recent stimuli, shared by a controller's cores.

    A core's entry `begin` s a stimulus (the hot `on_node` does not: its kind is `NODE`),
    makes each instruction with ``stimulus_id=stimuli.sid`` and ends with `done`, which
    logs the stimulus if it produced instructions and closes it.
    """

    __slots__ = ("_kind", "_log", "_open", "handled")

    def __init__(self, size: int = 1000) -> None:
        self.handled = 0  # ids made so far
        self._kind = NODE
        self._open: str | None = None
        self._log: collections.deque[_Entry] = collections.deque(maxlen=max(1, size))

    @property
    def size(self) -> int:
        """How many stimuli the log keeps."""
        return self._log.maxlen or 0

    def begin(self, kind: str) -> None:
        """A stimulus of ``kind`` begins (its id is made on first use)."""
        self._kind = kind
        self._open = None

    @property
    def sid(self) -> str:
        """The id of the stimulus being handled, made on first use."""
        sid = self._open
        if sid is None:
            self.handled += 1
            sid = self._open = f"{self._kind}-{self.handled}"
        return sid

    def done(self, subject: Any, out: list[Instruction], now: float | None) -> list[Instruction]:
        """The stimulus ends: it enters the log if it produced instructions (``subject``,
        made text then, is what it concerns: a proc, a world, a report...; ``now`` None:
        at the time of the newest entry). Returns ``out``."""
        sid = self._open
        if sid is not None and out:
            log = self._log
            at = now if now is not None else log[-1].at if log else 0.0
            log.append(_Entry(sid, at, "" if subject is None else str(subject), out))
        self._open = None
        self._kind = NODE
        return out

    def entries(self, now: float, wall: float) -> list[StimulusEntry]:
        """The log, oldest first, as `Introspect` returns it (``now`` on the cores'
        clock is ``wall`` on the wall clock)."""
        return [
            StimulusEntry(
                stimulus_id=e.stimulus_id,
                time=wall - (now - e.at),
                kind=e.stimulus_id.rpartition("-")[0],
                subject=e.subject,
                instructions=instruction_lines(e.instructions, describe),
            )
            for e in self._log
        ]
