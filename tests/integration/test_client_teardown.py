"""Leaving a mesh fast when it cannot go on: Ctrl-C during a pending fetch tears
everything down within two seconds (a second Ctrl-C is no slower); a mesh whose system
was killed and is not restarted hears of it within a second and is left within two; no
role process is left."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(60)


INTERRUPTED = """
import time
from palatine import fetch, local_mesh, remote

def slow():
    import time
    time.sleep(60)
    return 1

with local_mesh(1, 2) as mesh:
    print("roles", *[rp.popen.pid for rp in mesh._local.procs], flush=True)
    fetch(remote(slow)()).result()
"""


@pytest.mark.parametrize("interrupts", [1, 2])
def test_ctrl_c_during_a_pending_fetch_tears_the_mesh_down_within_two_seconds(
    interrupts: int,
) -> None:
    script = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert script.stdout is not None
        line = script.stdout.readline().split()
        assert line[0] == "roles", line
        roles = [int(p) for p in line[1:]]
        time.sleep(0.5)  # the fetch is pending
        t0 = time.monotonic()
        for _ in range(interrupts):
            script.send_signal(signal.SIGINT)
            time.sleep(0.05)
        code = script.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if script.poll() is None:
            script.kill()
            script.wait(10)
    assert code == -signal.SIGINT or code == 1, code
    assert took < 2.0, took
    deadline = time.monotonic() + 5  # roles that lost their launcher follow it at once
    while any(psutil.pid_exists(p) for p in roles) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in roles if psutil.pid_exists(p)] == []


SYSTEM_KILLED = """
import os, signal, time
from palatine import DeviceException, fetch, local_mesh, remote

def slow():
    import time
    time.sleep(60)
    return 1

with local_mesh(1, 2, supervision_update_timeout_s=3, system_restarts=0) as mesh:
    print("roles", *[rp.popen.pid for rp in mesh._local.procs], flush=True)
    pending = fetch(remote(slow)())
    time.sleep(0.3)
    t0 = time.monotonic()
    os.kill(mesh._local.system.pid, signal.SIGKILL)
    try:
        pending.result(timeout=60)
    except DeviceException as e:
        print("lost", e.kind, flush=True)
        print("seen", round(time.monotonic() - t0, 3), flush=True)
    left_at = time.monotonic()
print("teardown", round(time.monotonic() - left_at, 2), flush=True)
"""


def test_a_killed_system_that_is_not_restarted_is_reported_within_a_second_and_left_within_two() -> (
    None
):
    done = subprocess.run(
        [sys.executable, "-c", SYSTEM_KILLED], capture_output=True, text=True, timeout=50
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines.get("lost") == "system_lost", done.stdout + done.stderr[-3000:]
    assert float(lines["seen"]) < 1.0, lines
    assert float(lines["teardown"]) < 2.0, lines
    roles = [int(p) for p in lines["roles"].split()]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in roles) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in roles if psutil.pid_exists(p)] == []
