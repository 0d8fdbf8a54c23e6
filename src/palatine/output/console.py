"""Output on its way to a person's console: how palatine's own log lines look, how they
are told apart from a program's output, and how lines are written without ever blocking.

Every process of a job writes to a console it does not control: a role's stderr is a
pipe its launcher reads, a host echoes its workers' output to its own stderr, a launcher
passes lines on to the user's terminal. A writer that blocks on a full pipe stalls the
event loop behind it, and with it the whole job (a host blocked in ``write(2)`` stops
reading its workers' pipes, and the workers then block in ``print``). So:

* `LineFormatter` writes a log record's header (time, level, logger) on **every** line of
  the record, a traceback included, so that each line can be classified on its own;
* `classify` says whether a line is palatine's own chatter (a log record below
  WARNING, or a proc's JSON ready line), which belongs in log files, or something a
  person should see (a program's output, a warning, an error), also behind the
  ``[proc] `` prefixes a host adds when it echoes its children;
* `ConsoleWriter` writes text to a stream from a thread of its own: the caller only
  queues, a bounded amount. When the stream does not keep up, whole chunks of output
  are dropped (warnings and errors last), counted, and the count is written once the
  stream catches up, with where the complete output is kept (the log files, which are
  always written in full).
"""

from __future__ import annotations

import collections
import logging
import re
import shutil
import sys
import threading
import time
from typing import TextIO

from palatine import config
from palatine.errors import ConfigError

__all__ = [
    "INTERNAL",
    "LOG_FORMAT",
    "NOTABLE",
    "OUTPUT",
    "ConsoleWriter",
    "LineFormatter",
    "chatter_shown",
    "classify",
    "record_level",
]

#: The format of every role's log lines; `LineFormatter` repeats its header per line.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: A line of a log record in `LOG_FORMAT`, possibly behind ``[proc] `` echo prefixes.
_PREFIXES = rb"(?:\[\S*(?: [\d,-]+)?\] )*"  # [worker[3]] (a host's echo), [worker 0-3] (a sink's)
_RECORD_RE = re.compile(
    _PREFIXES + rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
)
_READY_RE = re.compile(_PREFIXES + rb'\{"event": "ready"')
_QUIET_LEVELS = (b"DEBUG", b"INFO")

#: What a `ConsoleWriter` queues at most before it drops output (bytes of text).
DEFAULT_LIMIT_BYTES = 4 * 1024 * 1024


class LineFormatter(logging.Formatter):
    """`LOG_FORMAT` with the record's header repeated on each of its lines.

    A multi-line record (a traceback, a stderr tail) then reads, line by line, as what it
    is: its level decides where every line goes, not just the first one's.
    """

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if "\n" not in text:
            return text
        head = f"{record.asctime} {record.levelname} {record.name}: "
        first, *rest = text.split("\n")
        return "\n".join([first, *(head + line for line in rest)])


#: What a line of output is, for a console: see `classify`.
INTERNAL, OUTPUT, NOTABLE = 0, 1, 2

_NOTE_RE = re.compile(_PREFIXES + rb"\[palatine\] ")


def chatter_shown() -> bool:
    """Whether palatine's own chatter (INFO records, ready lines) reaches consoles: only
    with ``PALATINE_LOG_LEVEL=DEBUG``. It is always in the log files; a console shows a
    program's output, warnings and errors."""
    try:
        return config.get().log_level.upper() == "DEBUG"
    except ConfigError:
        return False


def classify(line: bytes) -> int:
    """`INTERNAL` (a log record below WARNING, a ready line), `NOTABLE` (a warning or an
    error, a note from palatine about the output itself) or `OUTPUT` (anything else).

    A host's ``[worker[3]] `` echo prefixes are looked through.
    """
    m = _RECORD_RE.match(line)
    if m is not None:
        return INTERNAL if m.group(1) in _QUIET_LEVELS else NOTABLE
    if _READY_RE.match(line) is not None:
        return INTERNAL
    return NOTABLE if _NOTE_RE.match(line) is not None else OUTPUT


def record_level(line: bytes) -> int | None:
    """The level (``logging.INFO``, ...) of a line of a log record in `LOG_FORMAT`, also
    behind echo prefixes; None for any other line."""
    m = _RECORD_RE.match(line)
    return _LEVELS[m.group(1)] if m is not None else None


_LEVELS = {
    name.encode(): getattr(logging, name)
    for name in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
}


class ConsoleWriter:
    """Writes text to a console stream from its own thread; `write` never blocks.

    ``stream`` ``None`` means ``sys.stderr`` as it is at the time of writing. At most
    ``limit_bytes`` of text wait to be written; a chunk that does not fit is dropped and
    its lines counted, and once the queue has drained the writer says how many lines it
    dropped and, with ``complete_in``, where all of the output is. The thread is a daemon
    owned by this object: a stream that never drains must not keep the process alive, and
    `close` waits a bounded time for what is queued.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        complete_in: str | None = None,
        name: str = "palatine-console",
    ) -> None:
        self._stream = stream
        self._limit = limit_bytes
        #: Where all of the output is, named in the note about dropped lines.
        self.complete_in = complete_in
        self._name = name
        self._queue: collections.deque[str] = collections.deque()
        self._queued = 0
        self._dropped = 0
        self._dropped_total = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def isatty(self) -> bool:
        """Whether the stream is a terminal (where output may be redrawn in place)."""
        stream = self._stream if self._stream is not None else sys.stderr
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError, OSError):
            return False

    def columns(self) -> int:
        """The terminal's width (80 when it cannot be told)."""
        return shutil.get_terminal_size((80, 24)).columns

    @property
    def dropped_lines(self) -> int:
        """Lines dropped so far because the stream did not keep up."""
        with self._cond:
            return self._dropped_total

    def write_lines(
        self, lines: list[bytes], prefix: str = "", *, drop_internal: bool = False
    ) -> None:
        """Queue output lines (undecodable bytes replaced) behind ``prefix``.

        Warnings and errors (`NOTABLE` lines) are kept when ordinary output is dropped;
        with ``drop_internal``, palatine's own chatter is left out (it is in the logs).
        """
        run: list[str] = []
        run_notable = False
        for line in lines:
            kind = classify(line)
            if kind == INTERNAL and drop_internal:
                continue
            notable = kind == NOTABLE
            if run and notable != run_notable:
                self.write("".join(run), notable=run_notable)
                run = []
            run_notable = notable
            text = line.decode("utf-8", "replace").rstrip("\r")
            run.append(f"{prefix}{text}\n")
        if run:
            self.write("".join(run), notable=run_notable)

    def write(self, text: str, *, notable: bool = False) -> None:
        """Queue ``text`` (whole lines) for the stream; drop and count it when full.

        A ``notable`` text (warnings, errors) may use twice the limit: ordinary output
        is dropped first, and memory stays bounded all the same.
        """
        if not text:
            return
        with self._cond:
            if self._closed:
                return
            if self._queued + len(text) > self._limit * (2 if notable else 1):
                lines = text.count("\n") or 1
                self._dropped += lines
                self._dropped_total += lines
                return
            self._queue.append(text)
            self._queued += len(text)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far is written; whether it was, in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy or self._dropped:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Write what is queued (waiting at most ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, min(timeout_s, 0.5)))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._dropped and not self._closed:
                    self._cond.wait()
                if self._queue:
                    text = "".join(self._queue)
                    self._queue.clear()
                    self._queued = 0
                elif self._dropped:
                    text = self._drop_note(self._dropped)
                    self._dropped = 0
                else:
                    return  # closed and nothing left
                self._busy = True
            try:
                stream = self._stream if self._stream is not None else sys.stderr
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                with self._cond:  # the console is gone: nothing more can be shown
                    self._closed = True
                    self._queue.clear()
                    self._queued = 0
                    self._dropped = 0
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _drop_note(self, lines: int) -> str:
        where = f"; all of it is in {self.complete_in}" if self.complete_in else ""
        return f"[palatine] {lines} lines of output not shown: the console did not keep up{where}\n"
