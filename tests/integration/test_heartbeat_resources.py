"""Heartbeats carry what each proc uses of its machine (CPU, RSS), so the system's
snapshot, and ``palatine top`` from it, shows them for every proc of a real local mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

import palatine


def snapshot(job: str) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if k != "PALATINE_CLUSTER_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "palatine", "snapshot", "--job", job, "--json"],
                         capture_output=True, text=True, timeout=60, env=env, check=True)  # fmt: skip
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_every_live_procs_heartbeats_carry_its_cpu_and_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory() as runtime:
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
        with palatine.local_mesh(hosts=2, procs_per_host=1, startup_timeout_s=90) as mesh:
            job = mesh.job_id
            assert job is not None
            deadline = time.monotonic() + 30
            while True:  # (CPU needs two readings, a second apart: a few beats)
                snap = snapshot(job)
                procs = {p: e for w in snap["worlds"].values() for p, e in w["procs"].items()}
                if all("cpu_percent" in e["resources"] for e in procs.values()):
                    break
                assert time.monotonic() < deadline, procs
                time.sleep(0.2)
            assert {"worker[0]", "worker[1]", "controller[0]"} <= procs.keys()
            for proc, e in procs.items():
                assert e["resources"]["rss_bytes"] > 10 * 2**20, (proc, e)
                assert 0 <= e["resources"]["cpu_percent"] <= 100 * (os.cpu_count() or 1)
            top = subprocess.run(
                [sys.executable, "-m", "palatine", "top", "--job", job, "--once", "--sort", "rss",
                 "--interval-in-sec", "0.1"],
                capture_output=True, text=True, timeout=60, check=True,
                env={k: v for k, v in os.environ.items() if k != "PALATINE_CLUSTER_TOKEN"},
            )  # fmt: skip
            assert "by rss" in top.stdout and " MiB" in top.stdout
