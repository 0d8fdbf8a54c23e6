"""``palatine demo`` recovers from any lost rank, not only from the fault it injects, in
every phase after its mesh is up: a worker killed from outside (``kill -9``, as an
operator or the OOM killer would) during training, a worker killed during the final
evaluation and replica check, and one killed again while the demo recovers from its loss
are recovered from, and the demo ends like a fault-free run. The demo runs as a user runs
it; the worker is found in its process tree and killed with SIGKILL, or, where the moment
must be exact, the demo's own ``--kill-rank`` kills it (``--kill-at``).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(240)


def _workers(root: int) -> list[psutil.Process]:
    """The worker processes under ``root``: forked by a host's fork server, or exec'd."""
    out = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            cmd = p.cmdline()
            parent = " ".join(p.parent().cmdline()) if p.parent() else ""
        except psutil.Error:
            continue
        if cmd[1:4] == ["-m", "palatine", "worker"] or "forkserver_main" in parent:
            out.append(p)
    return out


def _read_until(proc: subprocess.Popen[str], pattern: str, timeout_s: float) -> list[str]:
    """The demo's stdout lines up to the first that matches ``pattern``."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if re.search(pattern, line):
                return lines
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s: {lines}")


def test_the_demo_recovers_from_a_worker_killed_from_outside_during_training() -> None:
    env = {**os.environ}
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "palatine", "demo", "--procs-per-host", "2", "--steps", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        before = _read_until(proc, r"^step \d+/300 ", 150)  # training has begun
        workers = _workers(proc.pid)
        assert len(workers) == 2, [w.cmdline() for w in workers]
        os.kill(workers[1].pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "\n".join(before) + "\n" + out
    assert proc.returncode == 0, text[-3000:] + err[-3000:]
    assert "AssertionError" not in err
    m = re.search(rf"^fault: worker rank (\d) \(worker\[\d\], pid {workers[1].pid}\b", text, re.M)
    assert m is not None, text
    assert "killed by signal 9" in text
    assert re.search(rf"^recovered rank {m[1]} in \d+\.\d\d s \(state from rank \d\)", text, re.M)
    assert re.search(r"^step \d+ done \d+\.\d\d s after the fault$", text, re.M), text
    assert text.splitlines()[-1] == "replicas identical on 2/2 ranks"


def _demo(*extra: str) -> tuple[int, str, str]:
    env = {**os.environ}
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-m", "palatine", "demo", "--procs-per-host", "2", "--steps", "100",
         *extra],
        capture_output=True, text=True, env=env, timeout=150, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def test_the_demo_recovers_from_a_worker_killed_during_its_final_evaluation() -> None:
    rc, out, err = _demo("--kill-rank", "1", "--kill-at", "evaluation")
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = out.splitlines()
    trained = lines.index(next(x for x in lines if x.startswith("step 100/100 ")))
    after = "\n".join(lines[trained:])
    assert re.search(r"^fault: worker rank 1 \(worker\[1\], pid \d+\b", after, re.M), out
    assert "killed by signal 9" in after
    assert re.search(
        r"^recovered rank 1 in \d+\.\d\d s \(state from rank 0\); evaluating again$", after, re.M
    ), out
    assert lines[-1] == "replicas identical on 2/2 ranks"


def test_the_demo_recovers_from_a_worker_killed_again_while_it_recovers() -> None:
    rc, out, err = _demo("--kill-rank", "1", "--at-step", "40", "--kill-at", "recovery")
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    first = re.search(r"^fault: worker rank 1 \(worker\[1\], pid (\d+)\b", out, re.M)
    again = re.search(
        r"^fault during the recovery: worker rank 1 \(worker\[1\], pid (\d+)\b", out, re.M
    )
    assert first is not None and again is not None, out
    assert first[1] != again[1]  # the incarnation the first recovery brought back
    assert first.start() < again.start()
    assert re.search(
        r"^recovered rank 1 in \d+\.\d\d s \(state from rank 0\); going on at step \d+$",
        out[again.start() :],
        re.M,
    ), out
    assert re.search(r"^step \d+ done \d+\.\d\d s after the kill$", out, re.M), out
    assert out.splitlines()[-1] == "replicas identical on 2/2 ranks"
