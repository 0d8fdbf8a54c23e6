"""A worker's progress bar (``\\r`` lines, as tqdm writes them) reaches the user while it
runs, as one updating line for the ranks that show the same state, at most ten states a
second per rank; the finished line is an ordinary line, and the log file keeps only it.

The user's script runs in its own interpreter with its stderr in a file, which the test
reads while the workers wait for it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = """
    import sys
    from palatine import fetch, local_mesh, remote

    def bar(go):
        import os, sys, time
        sys.stdout.write("\\rstep 1/200")
        sys.stdout.flush()
        deadline = time.monotonic() + 90
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        for i in range(2, 201):
            sys.stdout.write(f"\\rstep {i}/200")
            sys.stdout.flush()
            time.sleep(0.003)
        sys.stdout.write("\\n")
        sys.stdout.flush()
        return 0

    with local_mesh(1, 2, log_dir=sys.argv[2]) as mesh:  # (kept: the test reads it)
        with mesh.activate():
            r = remote(bar)(sys.argv[1])
            fetch(r, shard=0).result(120)
            fetch(r, shard=1).result(120)
"""


def wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The file's text once it holds ``text`` (an `AssertionError` when the script ends
    or the time is up first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = path.read_bytes().decode(errors="replace")  # ("\r" kept)
        if text in got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never shown; stderr:\n{path.read_text()[-3000:]}")


def test_a_progress_bar_is_shown_as_it_runs_as_one_line_for_the_ranks(tmp_path: Path) -> None:
    script, go, err = tmp_path / "job.py", tmp_path / "go", tmp_path / "err.txt"
    script.write_text(textwrap.dedent(SCRIPT))
    with open(err, "wb") as fe:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(go), str(tmp_path / "logs")],
            stdout=subprocess.DEVNULL,
            stderr=fe,
            start_new_session=True,
        )
        try:
            # the first state, while the workers wait: both ranks on one line
            wait_for(err, "\r[worker 0-1] step 1/200", proc, 120)
            go.touch()
            assert proc.wait(120) == 0, err.read_bytes()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    text = err.read_bytes().decode(errors="replace")
    # the finished bar is an ordinary line, below the redrawn one
    assert re.search(r"^\[worker 0-1\] step 200/200$", text, re.MULTILINE), text[-2000:]
    shown = re.findall(r"\[worker [\d,-]+\] step (\d+)/200", text)
    assert 2 <= len(set(shown)) < 60, shown  # at most 10 a second per rank, not all 199
    logs = [p for p in (tmp_path / "logs").rglob("*") if p.is_file() and "worker" in p.name]
    worker_logs = [p.read_bytes() for p in logs if b"step 200/200" in p.read_bytes()]
    assert len(worker_logs) == 2, logs
    assert all(b"step 57/200" not in log and b"\r" not in log for log in worker_logs)
