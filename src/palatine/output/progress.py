"""Live progress bars from workers: ``\\r`` lines (tqdm), forwarded and redrawn (sans-IO).

A progress bar rewrites one line: tqdm writes ``\\r`` and the bar's new state, again and
again, and ends the line with ``\\n`` when it is done. Held back until that ``\\n``, a bar
would show nothing for the whole loop, so its states travel as they come:

* `CarriageSplitter` (per output pipe, on the host) takes the pipe's lines and its
  unfinished line, and says which state is new: what follows the last ``\\r`` (a writer
  flushes a whole state at once), else what precedes it (``step 3\\r``). A finished line
  keeps only its last state, so a log file gets one line per bar, not every redraw;
* `RateLimit` (per rank, on the host) lets at most `MAX_PER_S` states a second through,
  and the last state held back is sent once its turn comes: the newest always arrives;
* on the way to the client a state is a line whose text ends in ``\\r`` (`PROGRESS_END`;
  the hosts strip ``\\r`` from every other line);
* `ProgressBoard` (the client) keeps each rank's latest state, groups the ranks whose
  states read the same (``[worker 0-3] 50%|#####     | 5/10``) and renders the groups as
  one updating line each: on a terminal, a block redrawn in place with ANSI cursor
  movement; elsewhere (a pipe, a notebook) one line rewritten with ``\\r``. A rank's
  ordinary line ends its bar (tqdm prints its final state with ``\\n``).
"""

from __future__ import annotations

from typing import Final

from palatine.output.aggregate import rank_ranges

__all__ = [
    "MAX_PER_S",
    "PROGRESS_END",
    "CarriageSplitter",
    "ProgressBoard",
    "RateLimit",
    "last_state",
]

MAX_PER_S: Final = 10.0
"""At most this many progress states a second per rank travel to the client."""

PROGRESS_END: Final = "\r"
"""How a forwarded line that is a progress state ends."""


def last_state(line: bytes) -> bytes:
    """The last non-empty ``\\r``-separated part of ``line`` (b"" when none)."""
    for part in reversed(line.split(b"\r")):
        if part:
            return part
    return b""


class CarriageSplitter:
    """One pipe's ``\\r`` handling: finished lines reduced to their last state, and the
    unfinished line's newest state."""

    def __init__(self) -> None:
        self._shown = b""  # the unfinished line's last state passed on as progress

    @property
    def shown(self) -> bool:
        """Whether the unfinished line's state was passed on (it ends the line at EOF)."""
        return bool(self._shown)

    def lines(self, lines: list[bytes]) -> list[bytes]:
        """Finished lines (without their ``\\n``), each reduced to its last state; a
        line that ends right after a shown state (``step 3\\r\\n``) is that state."""
        out = []
        for line in lines:
            if b"\r" in line:
                line = last_state(line)
            if not line and self._shown:
                line = self._shown
            self._shown = b""
            out.append(line)
        return out

    def partial(self, partial: bytes) -> tuple[bytes | None, bytes]:
        """The new state in the unfinished line ``partial`` (None: none) and what of it to
        keep: the text after its last ``\\r``."""
        if b"\r" not in partial:
            return None, partial
        done, _, tail = partial.rpartition(b"\r")
        state = tail or last_state(done)
        if not state or state == self._shown:
            return None, tail
        self._shown = state
        return state, tail


class RateLimit:
    """At most `MAX_PER_S` states a second for one rank; the newest held one goes when
    its turn comes (`due`)."""

    def __init__(self, per_s: float = MAX_PER_S) -> None:
        self.gap_s = 1.0 / per_s
        self.held: str | None = None
        self._sent_at: float | None = None

    def offer(self, state: str, now: float) -> str | None:
        """``state`` to send now, or None (held until `due`)."""
        if self._sent_at is None or now - self._sent_at >= self.gap_s:
            self._sent_at, self.held = now, None
            return state
        self.held = state
        return None

    def next_at(self) -> float | None:
        """When the held state may go (None: nothing held)."""
        if self.held is None or self._sent_at is None:
            return None
        return self._sent_at + self.gap_s

    def due(self, now: float) -> str | None:
        """The held state, if its turn has come."""
        at = self.next_at()
        if at is None or now < at:
            return None
        state, self.held, self._sent_at = self.held, None, now
        return state

    def drop(self) -> None:
        """Forget the held state (an ordinary line of the rank came after it)."""
        self.held = None


class ProgressBoard:
    """The client's progress bars: each rank's latest state, shown as one updating line
    per group of ranks with the same state. ``tty``: a terminal (ANSI redraws) or not
    (one ``\\r`` line); ``width``: a terminal's columns (lines are cut to fit, so that
    the cursor arithmetic holds)."""

    def __init__(self, tty: bool, width: int = 80) -> None:
        self.tty = tty
        self.width = max(20, width)
        self._states: dict[str, dict[int, str]] = {}  # world -> rank -> state
        self._drawn = 0  # rows of the block on screen (non-tty: 0 or 1)
        self._last_len = 0  # (non-tty: what a shorter redraw must blank out)

    def update(self, world: str, rank: int, state: str) -> None:
        self._states.setdefault(world, {})[rank] = state

    def done(self, world: str, rank: int) -> bool:
        """Rank ``rank`` printed an ordinary line: its bar is over. Whether it had one."""
        states = self._states.get(world)
        if states is None or states.pop(rank, None) is None:
            return False
        if not states:
            del self._states[world]
        return True

    def groups(self) -> list[str]:
        """``[world ranks] state`` per group, by world, then by the group's first rank."""
        out = []
        for world, states in self._states.items():
            by_text: dict[str, list[int]] = {}
            for rank in sorted(states):
                by_text.setdefault(states[rank], []).append(rank)
            out += [f"[{world} {rank_ranges(r)}] {text}" for text, r in by_text.items()]
        return out

    @property
    def shown(self) -> bool:
        """Whether a block is on screen."""
        return self._drawn > 0

    def erase(self) -> str:
        """What takes the block off the screen (a terminal), or ends its line (else), so
        that ordinary lines can be written; "" when nothing is shown."""
        if not self._drawn:
            return ""
        up, self._drawn = self._drawn - 1, 0
        if not self.tty:
            return "\n"
        return ("\r" if up == 0 else f"\x1b[{up}F") + "\x1b[J"

    def draw(self) -> str:
        """What redraws the block with the current states (after `erase`)."""
        lines = self.groups()
        if not lines:
            return self.erase()
        if not self.tty:
            text = " | ".join(lines)
            pad = " " * max(0, self._last_len - len(text)) if self._drawn else ""
            self._drawn, self._last_len = 1, len(text)
            return "\r" + text + pad
        text = self.erase() + "\n".join(_cut(line, self.width - 1) for line in lines)
        self._drawn = len(lines)
        return text

    def end(self) -> str:
        """Leave the block where it is and move past it (the output ends, or a cell)."""
        if not self._drawn:
            return ""
        self._drawn = 0
        return "\n"


def _cut(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"
