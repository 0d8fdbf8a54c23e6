"""A script that ends cleanly exits quietly and quickly, with or without ``with``: a
mesh it never shut down is shut down at interpreter exit, as leaving ``with`` does."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(120)

PLAIN = (
    "import time, palatine\n"
    "from palatine import fetch, remote\n"
    "mesh = palatine.local_mesh(hosts=1, procs_per_host=2)\n"
    "with mesh.activate():\n"
    "    print(fetch(remote(len)('abc')).result())\n"
    "print(mesh._local.system_addr, flush=True)\n"
)
WITH = (
    "import time, palatine\n"
    "from palatine import fetch, remote\n"
    "with palatine.local_mesh(hosts=1, procs_per_host=2) as mesh, mesh.activate():\n"
    "    print(fetch(remote(len)('abc')).result())\n"
    "    addr = mesh._local.system_addr\n"
    "print(addr, flush=True)\n"
)


@pytest.mark.parametrize("program", [PLAIN, WITH], ids=["without-with", "with"])
def test_a_script_that_ends_exits_quietly_within_three_seconds(program: str) -> None:
    script = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert script.stdout is not None and script.stderr is not None
    assert script.stdout.readline() == "3\n"
    addr = script.stdout.readline().strip()
    t0 = time.monotonic()
    code = script.wait(timeout=60)
    took = time.monotonic() - t0
    err = script.stderr.read()
    assert code == 0, err
    assert [line for line in err.splitlines() if re.search(r"\b(WARNING|ERROR)\b", line)] == []
    assert took < 3.0, took
    left = [
        p for p in psutil.process_iter(["cmdline"]) if addr in " ".join(p.info["cmdline"] or ())
    ]
    assert left == []
