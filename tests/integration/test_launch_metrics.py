"""``palatine launch --metrics-addr``: the launcher says where the job's metrics are and
which file holds the scrape token, and a scrape with that token is served while the
program runs."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

WAIT = """
import os, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_launch_says_where_its_metrics_are_and_serves_them_to_the_scrape_token(
    tmp_path: Path,
) -> None:
    go, err = tmp_path / "go", tmp_path / "err.txt"
    argv = [sys.executable, "-m", "palatine", "launch", "--scheduler", "local", "--hosts", "1",
            "--procs-per-host", "1", "--metrics-addr", "127.0.0.1:0", "--",
            sys.executable, "-c", WAIT, str(go)]  # fmt: skip
    with open(err, "wb") as fe:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fe)
        try:
            deadline = time.monotonic() + 90
            found = None
            while found is None and time.monotonic() < deadline and proc.poll() is None:
                found = re.search(
                    r"metrics at (http://\S+/metrics) \(scrape token in (\S+)\)", err.read_text()
                )
                time.sleep(0.05)
            assert found is not None, err.read_text()
            url, token_file = found.group(1), Path(found.group(2))
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
            token = token_file.read_text().strip()
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200 and b"palatine_procs" in r.read()
            go.touch()
            assert proc.wait(60) == 0, err.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
