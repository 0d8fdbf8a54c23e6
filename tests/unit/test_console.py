"""Console output: log lines classified line by line, and a writer that never blocks."""

from __future__ import annotations

import io
import logging
import os
import threading
import time

import pytest

from palatine.output.console import INTERNAL, ConsoleWriter, LineFormatter, classify

pytestmark = pytest.mark.timeout(30)


def record(level: int, msg: str, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            import sys

            info = sys.exc_info()
    return logging.LogRecord("palatine.x", level, __file__, 1, msg, None, info)


def test_every_line_of_a_multi_line_record_carries_its_header() -> None:
    text = LineFormatter().format(record(logging.ERROR, "first\nsecond", exc=True))
    lines = text.split("\n")
    assert len(lines) > 3  # the message's two lines and a traceback
    assert all(" ERROR palatine.x: " in line for line in lines)
    assert lines[-1].endswith("ValueError: boom")


def test_info_records_and_ready_lines_are_internal_the_rest_is_for_people() -> None:
    fmt = LineFormatter()
    info = fmt.format(record(logging.INFO, "proc stopped\ncontinued")).encode()
    warn = fmt.format(record(logging.WARNING, "careful")).encode()
    for line in info.split(b"\n"):
        assert classify(line) == INTERNAL
        assert classify(b"[worker[3]] " + line) == INTERNAL  # a host's echo of its child
    assert classify(warn) != INTERNAL
    assert classify(b"[worker[3]] " + warn) != INTERNAL
    assert classify(b'{"event": "ready", "role": "host", "addr": "unix:@x", "pid": 1}') == INTERNAL
    assert classify(b'[worker[0]] {"event": "ready", "role": "worker"}') == INTERNAL
    for user in (b"epoch 1 loss 0.25", b"[worker[2]] epoch 1", b"INFO looks like a log", b""):
        assert classify(user) != INTERNAL


def test_writer_passes_text_through_in_order() -> None:
    out = io.StringIO()
    w = ConsoleWriter(out)
    for i in range(1000):
        w.write(f"line {i}\n")
    assert w.flush(5.0)
    assert out.getvalue().splitlines() == [f"line {i}" for i in range(1000)]
    assert w.dropped_lines == 0
    w.close()


def test_write_never_blocks_on_a_stream_nobody_reads_and_says_what_it_dropped() -> None:
    r, wfd = os.pipe()
    stream = os.fdopen(wfd, "w", buffering=1)
    w = ConsoleWriter(stream, limit_bytes=64 * 1024, complete_in="the logs in /somewhere")
    line = "x" * 99 + "\n"
    start = time.monotonic()
    for _ in range(20_000):  # 2 MB, far more than the pipe and the queue hold
        w.write(line)
    assert time.monotonic() - start < 2.0
    dropped = w.dropped_lines
    assert dropped > 10_000

    got = bytearray()

    def read_all() -> None:
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    assert w.flush(10.0)
    w.close()
    stream.close()
    reader.join(10)
    lines = got.decode().splitlines()
    notes = [ln for ln in lines if ln.startswith("[palatine] ")]
    counted = 0
    for note in notes:  # one note each time the stream caught up after a drop
        n, sep, rest = note.removeprefix("[palatine] ").partition(" lines of output not shown: ")
        assert sep and rest == "the console did not keep up; all of it is in the logs in /somewhere"
        counted += int(n)
    assert lines[-1] in notes
    assert counted == dropped
    assert len(lines) - len(notes) + dropped == 20_000  # every line is either shown or counted
    os.close(r)


def test_a_closed_console_is_given_up_without_raising() -> None:
    out = io.StringIO()
    w = ConsoleWriter(out)
    out.close()
    w.write("lost\n")
    assert w.flush(2.0)  # the writer gave the stream up instead of raising or hanging
    w.write("after\n")  # ignored from now on
    assert w.flush(0.1)
    w.close(0.5)
