"""Nothing a job makes outlives it: the unix socket files of its processes are gone when
it ends, however it ends (a clean exit of an actor-mesh client, a SIGKILLed worker, a
killed host, Ctrl-C), and a job's start removes those that earlier jobs' dead processes
left. Each script runs with a temp dir of its own, so its socket files can be counted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A temp dir for one script (short: socket paths are limited)."""
    base = Path(tempfile.mkdtemp(prefix="pls", dir="/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def socket_files(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("palatine-*/*.sock"))


def start(tmp: Path, body: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("XDG_RUNTIME_DIR", None)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def run(tmp: Path, body: str) -> dict[str, str]:
    script = start(tmp, body)
    out, err = script.communicate(timeout=100)
    assert script.returncode == 0, out[-2000:] + err[-4000:]
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def test_a_clean_exit_of_an_actor_mesh_client_leaves_no_socket_file(tmp: Path) -> None:
    lines = run(
        tmp,
        """
        import glob, os
        from palatine import Actor, endpoint, this_host

        class Echo(Actor):
            @endpoint
            def pid(self) -> int:
                return os.getpid()

        procs = this_host().spawn_procs(per_host={"procs": 2})
        pids = procs.spawn("echo", Echo).pid.call().get(timeout=60)
        print("FILES", len(glob.glob(os.environ["TMPDIR"] + "/palatine-*/*.sock")), flush=True)
        """,
    )
    assert int(lines["FILES"]) >= 3  # the script's own, and one per proc
    assert socket_files(tmp) == []


def test_a_sigkilled_workers_socket_file_is_removed_by_its_host_at_once(tmp: Path) -> None:
    lines = run(
        tmp,
        """
        import glob, os, signal, time
        from palatine import fetch, local_mesh, remote

        def files_of(pid):
            return glob.glob(f"{os.environ['TMPDIR']}/palatine-*/{pid}-*.sock")

        with local_mesh(1, 2) as mesh:
            victim, other = [fetch(remote(os.getpid)(), shard=r).result(timeout=60) for r in (1, 0)]
            assert files_of(victim) and files_of(other)
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            while files_of(victim) and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            print("GONE_AFTER", round(time.monotonic() - t0, 2), flush=True)
            print("OTHER_LEFT", len(files_of(other)), flush=True)
        """,
    )
    assert float(lines["GONE_AFTER"]) < 2.0, lines
    assert lines["OTHER_LEFT"] == "1"
    assert socket_files(tmp) == []


def test_a_killed_host_leaves_no_socket_file_once_its_job_ends(tmp: Path) -> None:
    lines = run(
        tmp,
        """
        import os, signal, time
        from palatine import DeviceException, fetch, local_mesh, remote

        with local_mesh(1, 2) as mesh:
            fetch(remote(os.getpid)(), shard=0).result(timeout=60)
            host = next(rp for rp in mesh._local.procs if " host " in " ".join(rp.popen.args))
            os.kill(host.popen.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # (a call may still be served as it dies)
                try:
                    fetch(remote(os.getpid)(), shard=0).result(timeout=60)
                except DeviceException as e:
                    print("LOST", e.kind, flush=True)
                    break
                time.sleep(0.05)
        """,
    )
    assert "LOST" in lines
    assert socket_files(tmp) == []


def test_a_script_stopped_by_ctrl_c_leaves_no_socket_file(tmp: Path) -> None:
    running = tmp / "running"
    script = start(
        tmp,
        f"""
        from palatine import fetch, local_mesh, remote

        def slow():
            import pathlib, time
            pathlib.Path({str(running)!r}).touch()
            time.sleep(60)

        with local_mesh(1, 2) as mesh:
            fetch(remote(slow)()).result()
        """,
    )
    try:
        deadline = time.monotonic() + 60
        while not running.exists() and time.monotonic() < deadline:  # the fetch is pending
            time.sleep(0.02)
        assert running.exists(), script.stderr.read() if script.poll() is not None else ""
        assert len(socket_files(tmp)) >= 4  # the script's, a host's, a controller's, workers'
        script.send_signal(signal.SIGINT)
        script.communicate(timeout=30)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait(10)
    deadline = time.monotonic() + 10  # roles that lost their launcher follow it at once
    while socket_files(tmp) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert socket_files(tmp) == []


def test_a_jobs_start_removes_the_socket_files_dead_processes_left(tmp: Path) -> None:
    lines = run(
        tmp,
        """
        import glob, os, signal, subprocess, sys
        from palatine import fetch, local_mesh, remote
        from palatine.channel.addr import unix_socket_dir

        left = subprocess.run(
            [sys.executable, "-c",
             "import os, socket\\n"
             f"s = socket.socket(socket.AF_UNIX); s.bind(f'{unix_socket_dir()}/{{os.getpid()}}-00ff.sock')\\n"
             "os.kill(os.getpid(), 9)"],
            check=False,
        )
        print("LEFT", len(glob.glob(f"{unix_socket_dir()}/*-00ff.sock")), flush=True)
        with local_mesh(1, 1) as mesh:
            print("AT_START", len(glob.glob(f"{unix_socket_dir()}/*-00ff.sock")), flush=True)
        """,
    )
    assert (lines["LEFT"], lines["AT_START"]) == ("1", "0")
    assert socket_files(tmp) == []
