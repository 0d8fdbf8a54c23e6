"""``palatine top`` against a running local mesh: one frame with ``--once``; the live
view quits on ``q`` typed at its terminal; a wrong token is refused."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time

import pytest

from palatine import local_mesh

pytestmark = pytest.mark.timeout(120)


def top(addr: str, token: str, *extra: str, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "palatine", "top", "--system-addr", addr, *extra],
        env={**os.environ, "PALATINE_CLUSTER_TOKEN": token, "COLUMNS": "200"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_top_shows_each_world_and_its_procs_and_quits_on_q() -> None:
    with local_mesh(1, 2) as mesh:
        cluster = mesh._local
        assert cluster is not None
        addr, token = cluster.system_addr, cluster.env["PALATINE_CLUSTER_TOKEN"]
        once = top(addr, token, "--once", "--world", "worker")
        out, err = once.communicate(timeout=60)
        text = out.decode()
        assert once.returncode == 0, err.decode()
        assert "world worker: Live, 2/2 procs alive" in text, text
        rows = [line for line in text.splitlines() if "worker[" in line]
        assert len(rows) == 2 and all("Alive" in r and "MiB" in r for r in rows), text

        master, slave = pty.openpty()
        live = top(addr, token, "--interval-in-sec", "0.2", stdin=slave)
        os.close(slave)
        try:
            time.sleep(2.0)  # a few frames
            assert live.poll() is None
            os.write(master, b"q")
            assert live.wait(timeout=10) == 0
        finally:
            if live.poll() is None:
                live.kill()
                live.wait(10)
            os.close(master)

        wrong = top(addr, "0" * 64, "--once")
        _, err = wrong.communicate(timeout=30)
        assert wrong.returncode == 1
        assert "authentication failed" in err.decode()


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_top_shows_the_op_each_worker_runs_and_for_how_long() -> None:
    import cloudpickle

    from palatine import remote

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with local_mesh(1, 2) as mesh:
        cluster = mesh._local
        assert cluster is not None
        addr, token = cluster.system_addr, cluster.env["PALATINE_CLUSTER_TOKEN"]
        with mesh.activate():
            pending = remote(nap)(8.0)  # on both ranks; the next heartbeats report it
            deadline = time.monotonic() + 15
            rows: list[str] = []
            while time.monotonic() < deadline:
                once = top(addr, token, "--once", "--world", "worker")
                out, _ = once.communicate(timeout=60)
                rows = [line for line in out.decode().splitlines() if "worker[" in line]
                if len(rows) == 2 and all("nap on main for " in r for r in rows):
                    break
                time.sleep(0.3)
            assert len(rows) == 2 and all("nap on main for " in r for r in rows), rows
            del pending
