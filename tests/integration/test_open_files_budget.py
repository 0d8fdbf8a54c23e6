"""The open-files estimate follows what a job's processes really hold: a 1x4 mesh runs
under ``ulimit -n 64`` (its busiest process holds about 55), a mesh that cannot run
there is still refused at once, and no process of a running mesh holds more than the
estimate said."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

from palatine.hosting.limits import mesh_open_files

pytestmark = pytest.mark.timeout(120)

RUN_1X4 = """
    import os, torch
    from palatine import fetch, inspect, local_mesh, remote

    def ones_times(rank):
        return torch.ones(2) * rank

    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    with local_mesh(hosts=1, procs_per_host=4) as mesh:
        r = mesh.rank("proc")
        total = remote(ones_times)(r).reduce("proc", op="sum")
        print("TOTAL", inspect(total).tolist(), flush=True)
        fds = [fetch(remote(open_fds)(), shard=s).result(timeout=60) for s in range(4)]
        print("WORKER_FDS", max(fds), flush=True)
"""


def limited_to(n: int):  # type: ignore[no-untyped-def]
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return pre


def test_a_1x4_local_mesh_runs_under_ulimit_64() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RUN_1X4)],
        capture_output=True,
        text=True,
        timeout=100,
        preexec_fn=limited_to(64),
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["TOTAL"] == "[6.0, 6.0]", done.stdout
    assert int(lines["WORKER_FDS"]) <= mesh_open_files(1, 4) <= 64


def test_a_mesh_too_big_for_the_limit_is_still_refused_at_once_naming_the_need() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from palatine import local_mesh\nlocal_mesh(hosts=2, procs_per_host=8)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limited_to(64),
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "palatine.errors.TooManyOpenFiles: too many open files: the limit is 64 (ulimit -n) "
        f"and a mesh of 16 procs needs about {mesh_open_files(2, 8)}; raise it "
        f"(ulimit -n {mesh_open_files(2, 8)}) or start fewer procs"
    )
    assert mesh_open_files(2, 8) > 64
