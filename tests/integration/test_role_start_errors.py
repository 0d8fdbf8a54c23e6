"""A role that does not come up says what happened and when (`RoleProcess.wait_ready`).

A role that ended before its ready line is reported as ended (its exit code or signal,
and how long after its start), at once, not as a wait that ran out; a role still running
without a ready line when the wait runs out is reported with the time since its start,
and killed. Real ``palatine`` role processes.
"""

from __future__ import annotations

import re
import secrets
import signal
import socket
import time

import pytest

from palatine.tensor.client.procs import RoleProcess

pytestmark = pytest.mark.timeout(60)

ENV = {"PALATINE_CLUSTER_TOKEN": "0" * 64}


def _started_after(text: str) -> float:
    m = re.search(r" (\d+\.\d\d) s after its start, before its ready line", text)
    assert m is not None, text
    return float(m.group(1))


def test_a_role_killed_at_once_is_reported_as_killed_with_its_signal_and_when() -> None:
    rp = RoleProcess(
        ["system", "--system-addr", f"unix:@palatine-test-{secrets.token_hex(4)}"],
        ENV,
        wait=False,
    )
    try:
        rp.signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            rp.wait_ready(20.0)
        waited = time.monotonic() - t0
    finally:
        rp.kill()
    text = str(info.value)
    assert f"(pid {rp.pid}) killed by signal 9 (SIGKILL) " in text, text
    assert "ready line within" not in text and "(exit " not in text, text
    assert _started_after(text) < 5.0
    assert waited < 5.0  # seen as it happened, not when the 20 s ran out


def test_a_role_that_exits_with_an_error_is_reported_with_its_code_and_when() -> None:
    rp = RoleProcess(["system", "--system-addr", "bogus"], ENV, wait=False)
    with pytest.raises(RuntimeError) as info:
        rp.wait_ready(20.0)
    text = str(info.value)
    assert "palatine system --system-addr bogus" in text
    assert f"(pid {rp.pid}) exited with code 2 " in text, text
    assert _started_after(text) < 5.0
    assert "no channel type specified" in text  # its own words, from its stderr


def test_a_role_that_runs_on_without_a_ready_line_is_reported_as_a_timeout_and_killed() -> None:
    # A host whose system accepts its connection and never answers: it never joins.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        name = f"palatine-test-{secrets.token_hex(4)}"
        silent.bind("\0" + name)
        silent.listen(16)
        args = [
            "host",
            "--system-addr",
            f"unix:@{name}",
            "--host-world",
            "hostw",
            "--host-rank",
            "0",
        ]
        rp = RoleProcess(args, ENV, wait=False)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            rp.wait_ready(1.5)
        waited = time.monotonic() - t0
    text = str(info.value)
    m = re.search(
        r"\(pid \d+\) printed no ready line in the (\d+\.\d\d) s since its start; "
        r"killed it \(SIGKILL\)",
        text,
    )
    assert m is not None, text
    assert 1.5 <= float(m.group(1)) < 10.0
    assert waited >= 1.5
    assert rp.popen.poll() == -signal.SIGKILL
