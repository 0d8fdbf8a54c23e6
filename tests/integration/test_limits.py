"""A job that needs more open files than ``ulimit -n`` allows fails at once, saying so."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(60)


def limited(n: int):  # type: ignore[no-untyped-def]
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return pre


def run_limited(code: str, n: int) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=45,
        preexec_fn=limited(n),
        check=False,
    )
    return done, time.monotonic() - start


def test_a_2x8_local_mesh_under_ulimit_64_fails_at_once_naming_the_limit() -> None:
    done, took = run_limited(
        """
        from palatine import local_mesh, TooManyOpenFiles
        try:
            local_mesh(hosts=2, procs_per_host=8)
        except TooManyOpenFiles as e:
            print("REFUSED", e)
        """,
        64,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(
        "REFUSED too many open files: the limit is 64 (ulimit -n) and a mesh of 16 procs needs about "
    ), done.stdout
    assert took < 15  # the interpreter and imports; before, 60 s and EMFILE nowhere


def test_the_soft_limit_is_raised_to_the_hard_one_when_that_suffices() -> None:
    done, _ = run_limited(
        """
        import resource
        from palatine.hosting.limits import check_open_files, mesh_open_files
        check_open_files(mesh_open_files(2, 8), "a mesh of 16 procs")
        print("SOFT", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """,
        64,
    )
    assert "too many open files" in done.stderr  # the hard limit is 64 too: still refused
    soft_hard = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import resource\n"
                "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 4096))\n"
                "from palatine.hosting.limits import check_open_files, mesh_open_files\n"
                "check_open_files(mesh_open_files(2, 8), 'a mesh of 16 procs')\n"
                "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert soft_hard.returncode == 0, soft_hard.stderr
    assert int(soft_hard.stdout) == 4096


def test_this_host_refuses_procs_it_cannot_hold_open() -> None:
    done, took = run_limited(
        """
        from palatine import this_host, TooManyOpenFiles
        try:
            this_host().spawn_procs(per_host={"procs": 16})
        except TooManyOpenFiles as e:
            print("REFUSED", e)
        """,
        64,
    )
    assert (
        "REFUSED too many open files: the limit is 64 (ulimit -n) and 16 procs of this_host() needs about"
        in done.stdout
    ), done.stderr[-3000:]
    assert took < 15


def test_a_controller_for_more_workers_than_the_limit_allows_exits_1_at_once() -> None:
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "palatine",
            "controller",
            "--worker-world",
            "w",
            "--system-addr",
            "unix:@nobody-listens-here",
            "--world-size",
            "64",
            "--num-procs-per-host",
            "8",
            "--program",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=limited(64),
        env={**os.environ, "PALATINE_LOG_LEVEL": "WARNING"},
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "palatine controller: error: too many open files: the limit is 64 (ulimit -n) and a "
        "controller of 64 workers needs about 298; raise it (ulimit -n 298) or start fewer procs"
    )
    assert time.monotonic() - start < 15
