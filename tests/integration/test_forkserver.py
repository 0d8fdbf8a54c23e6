"""Worker procs forked by a host's fork server (palatine.hosting.forkserver) with real processes.

The worker program is the real ``<python> -m palatine worker``; what it does is steered by
a *probe* module in the test's working directory, imported through ``PALATINE_PRELOAD``
before the worker would join: it prints one JSON line of facts about its process, then
exits with ``PROBE_EXIT`` or sleeps. The same probe run exec'd (no server) gives the
facts a forked worker must match. Every test kills what it started (`reaper`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from palatine.hosting.children import Child, ChildProcs
from palatine.hosting.forkserver import ForkedProcess, ForkServer, fork_server_supported

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not fork_server_supported(), reason="no fork server on this platform"),
]

WORKER = [sys.executable, "-m", "palatine", "worker"]

PROBE = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    facts = {
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
        "cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0],
        "value": os.environ.get("PROBE_VALUE"), "parent_var": os.environ.get("PALATINE_PARENT_PID"),
        "threads": len(os.listdir("/proc/self/task")),
        "stdin": os.path.realpath("/proc/self/fd/0"),
        "torch": "torch" in sys.modules, "client": "palatine.tensor.client" in sys.modules,
    }
    if os.environ.get("PROBE_GRANDCHILD"):
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        facts["grandchild"] = g.pid
    print("FACTS " + json.dumps(facts), flush=True)
    if "PROBE_EXIT" in os.environ:
        os._exit(int(os.environ["PROBE_EXIT"]))
    time.sleep(60)
    """
)


class Reaper:
    """Makes `ChildProcs` (and servers) for a test; kills everything they started."""

    def __init__(self) -> None:
        self.made: list[ChildProcs] = []
        self.servers: list[ForkServer] = []
        self.pids: list[int] = []

    def make(self, **kw: Any) -> ChildProcs:
        procs = ChildProcs(echo=False, **kw)
        self.made.append(procs)
        return procs

    def cleanup(self) -> None:
        for procs in self.made:
            for child in procs.children:
                if child.pid is not None and child.exit is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.pid, signal.SIGKILL)
        for server in self.servers:
            server.kill_now()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    r = Reaper()
    try:
        yield r
    finally:
        r.cleanup()


@pytest.fixture
def probe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's working directory, with the probe module in it."""
    (tmp_path / "fs_probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def probe_env(**extra: str) -> dict[str, str]:
    return {"PALATINE_PRELOAD": "fs_probe", "PALATINE_PARENT_PID": str(os.getpid()), **extra}


async def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():
                await asyncio.sleep(0.005)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


async def facts_of(child: Child, timeout_s: float = 20.0) -> dict[str, Any]:
    found: list[str] = []

    def seen() -> bool:
        found[:] = [line for line in child.tail if line.startswith("FACTS ")]
        return bool(found) or child.done()

    await wait_for(seen, timeout_s, f"{child.proc_id} to print its facts")
    assert found, f"{child.proc_id} ended without its facts: {child.tail}"
    return dict(json.loads(found[0].removeprefix("FACTS ")))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def started_server(reaper: Reaper, **kw: Any) -> ForkServer:
    server = ForkServer(**kw)
    reaper.servers.append(server)
    server.start()
    return server


async def test_a_worker_is_forked_with_the_stdio_env_and_directory_of_an_exec_d_one(
    reaper: Reaper, probe_dir: Path, tmp_path: Path
) -> None:
    server = await started_server(reaper)
    forked_procs = reaper.make(fork_server=server)
    log_path = tmp_path / "logs" / "w_0.log"
    forked = await forked_procs.spawn(
        "w[0]", WORKER, probe_env(PROBE_VALUE="x", PROBE_EXIT="3"), log_path
    )
    assert isinstance(forked._popen, ForkedProcess)
    exec_procs = reaper.make()
    execed = await exec_procs.spawn(
        "w[1]", WORKER, probe_env(PROBE_VALUE="x", PROBE_EXIT="3"), None
    )
    assert not isinstance(execed._popen, ForkedProcess)

    f, e = await facts_of(forked), await facts_of(execed)
    assert f["ppid"] == server.pid and e["ppid"] == os.getpid()
    assert f["pgid"] == f["sid"] == f["pid"] == forked.pid  # own session and group
    assert f["parent_var"] == str(server.pid)  # it dies with the server, not with us
    for key in ("cwd", "path0", "value", "stdin", "torch", "client"):
        assert f[key] == e[key], key
    assert f["cwd"] == str(probe_dir) and f["value"] == "x" and f["stdin"] == os.devnull
    assert f["argv"] == e["argv"] and f["argv"][1:] == ["worker"]
    assert f["threads"] == e["threads"]  # nothing of the server's runs in the worker
    exit_f, exit_e = await forked.wait(10), await execed.wait(10)
    assert (
        (exit_f.exit_code, exit_f.exit_signal)
        == (exit_e.exit_code, exit_e.exit_signal)
        == (3, None)
    )
    assert any(line.startswith("FACTS ") for line in exit_f.stderr_tail)
    assert "FACTS " in log_path.read_text()
    await forked_procs.aclose()
    await exec_procs.aclose()


async def test_other_programs_and_other_interpreter_settings_are_executed(
    reaper: Reaper, probe_dir: Path
) -> None:
    server = await started_server(reaper)
    procs = reaper.make(fork_server=server)
    plain = await procs.spawn("a[0]", [sys.executable, "-c", "print('hi')"], {}, None)
    changed = await procs.spawn("a[1]", WORKER, probe_env(PROBE_EXIT="0", PYTHONFOO="1"), None)
    worker = await procs.spawn("a[2]", WORKER, probe_env(PROBE_EXIT="0"), None)
    assert not isinstance(plain._popen, ForkedProcess)
    assert not isinstance(changed._popen, ForkedProcess)  # PYTHON* is read at start-up
    assert isinstance(worker._popen, ForkedProcess)
    assert (await facts_of(changed))["ppid"] == os.getpid()
    for child in (plain, changed, worker):
        assert (await child.wait(10)).exit_code == 0
    await procs.aclose()


async def test_a_sigkilled_worker_is_reported_at_once_and_its_group_killed(
    reaper: Reaper, probe_dir: Path
) -> None:
    exits: list[tuple[float, Child, int | None, int | None]] = []
    server = await started_server(reaper)
    procs = ChildProcs(
        lambda c, code, sig, tail: exits.append((time.monotonic(), c, code, sig)),
        echo=False,
        fork_server=server,
    )
    reaper.made.append(procs)
    child = await procs.spawn("k[0]", WORKER, probe_env(PROBE_GRANDCHILD="1"), None)
    facts = await facts_of(child)
    reaper.pids.append(facts["grandchild"])
    t0 = time.monotonic()
    os.kill(child.pid or 0, signal.SIGKILL)
    await wait_for(lambda: bool(exits), 5, "the exit report")
    at, _, code, sig = exits[0]
    assert (code, sig) == (None, signal.SIGKILL)
    assert at - t0 < 3.0
    assert child.exit is not None and child.exit.reason == "killed by signal 9 (SIGKILL)"
    await wait_for(lambda: gone(facts["grandchild"]), 5, "the grandchild to die with its group")
    await procs.aclose()


async def test_terminate_signals_through_the_server(reaper: Reaper, probe_dir: Path) -> None:
    server = await started_server(reaper)
    procs = reaper.make(fork_server=server)
    child = await procs.spawn("t[0]", WORKER, probe_env(), None)
    await facts_of(child)
    ended = await procs.terminate(child, grace_s=5.0)
    assert ended is not None and ended.requested
    assert ended.exit_signal == signal.SIGTERM  # the probe sleeps: SIGTERM's default action
    await procs.aclose()


async def test_losing_the_server_ends_its_workers(reaper: Reaper, probe_dir: Path) -> None:
    server = await started_server(reaper)
    procs = reaper.make(fork_server=server)
    child = await procs.spawn("l[0]", WORKER, probe_env(), None)
    facts = await facts_of(child)
    os.kill(server.pid or 0, signal.SIGKILL)
    ended = await child.wait(5)
    assert (ended.exit_code, ended.exit_signal) == (None, None)
    await wait_for(lambda: gone(facts["pid"]), 5, "the worker to die with its server")
    # Later workers are executed.
    again = await procs.spawn("l[1]", WORKER, probe_env(PROBE_EXIT="0"), None)
    assert not isinstance(again._popen, ForkedProcess)
    assert (await again.wait(20)).exit_code == 0
    await procs.aclose()


async def test_a_server_with_a_thread_refuses_to_fork_and_the_host_executes(
    reaper: Reaper, probe_dir: Path
) -> None:
    (probe_dir / "fs_threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    server = await started_server(reaper, preload=["fs_threaded"])
    procs = reaper.make(fork_server=server)
    child = await procs.spawn("r[0]", WORKER, probe_env(PROBE_EXIT="0"), None)
    assert not isinstance(child._popen, ForkedProcess)
    assert (await facts_of(child))["ppid"] == os.getpid()
    assert (await child.wait(20)).exit_code == 0
    await procs.aclose()


async def test_an_owned_server_goes_with_its_children(reaper: Reaper, probe_dir: Path) -> None:
    procs = reaper.make()
    procs.start_fork_server()
    server = procs._fork_server
    assert server is not None and server.pid is not None
    reaper.servers.append(server)
    child = await procs.spawn("o[0]", WORKER, probe_env(), None)
    facts = await facts_of(child)
    assert facts["ppid"] == server.pid
    await procs.aclose(grace_s=2.0)
    assert child.exit is not None and child.exit.requested
    await wait_for(
        lambda: gone(server.pid or 0) and gone(facts["pid"]), 5, "server and worker to end"
    )


async def test_a_server_warms_once_spawns_settle_and_later_workers_start_with_the_modules(
    reaper: Reaper, probe_dir: Path
) -> None:
    (probe_dir / "fs_heavy.py").write_text("HEAVY = True\n")
    probe = PROBE.replace('"torch": "torch" in sys.modules', '"torch": "fs_heavy" in sys.modules')
    (probe_dir / "fs_probe.py").write_text(probe)
    server = await started_server(reaper, warm=["fs_heavy", "no_such_module_here"])
    procs = reaper.make(fork_server=server)
    first = await procs.spawn("h[0]", WORKER, probe_env(PROBE_EXIT="0"), None)
    assert (await facts_of(first))["torch"] is False  # spawned before the warm
    await wait_for(lambda: server.warmed, 20, "the server to warm")
    later = await procs.spawn("h[1]", WORKER, probe_env(PROBE_EXIT="0"), None)
    assert isinstance(later._popen, ForkedProcess)  # a module it cannot import is skipped
    facts = await facts_of(later)
    assert facts["torch"] is True and facts["threads"] == (await facts_of(first))["threads"]
    for child in (first, later):
        assert (await child.wait(10)).exit_code == 0
    await procs.aclose()


async def test_warming_with_torch_leaves_the_server_able_to_fork(
    reaper: Reaper, probe_dir: Path
) -> None:
    server = await started_server(reaper, warm=["torch"])
    procs = reaper.make(fork_server=server)
    first = await procs.spawn("t[0]", WORKER, probe_env(PROBE_EXIT="0"), None)
    await facts_of(first)
    await wait_for(lambda: server.warmed, 30, "the server to import torch")
    later = await procs.spawn("t[1]", WORKER, probe_env(PROBE_EXIT="0"), None)
    assert isinstance(later._popen, ForkedProcess)  # numpy's BLAS pool did not start
    facts = await facts_of(later)
    assert facts["torch"] is True and facts["ppid"] == server.pid
    for child in (first, later):
        assert (await child.wait(10)).exit_code == 0
    await procs.aclose()


async def test_a_spawn_while_the_server_warms_is_exec_d_at_once_not_held_behind_the_import(
    reaper: Reaper, probe_dir: Path
) -> None:
    # A warm import that takes long (torch on a loaded machine): a proc asked for
    # meanwhile (a respawned rank early in a mesh's life) starts cold at once.
    mark = probe_dir / "warming"
    (probe_dir / "fs_slow.py").write_text(
        f"import pathlib, time\npathlib.Path({str(mark)!r}).touch()\ntime.sleep(30)\n"
    )
    server = await started_server(reaper, warm=["fs_slow"])
    procs = reaper.make(fork_server=server)
    first = await procs.spawn("s[0]", WORKER, probe_env(), None)
    await facts_of(first)
    await wait_for(mark.exists, 20, "the server to begin warming")
    t0 = time.monotonic()
    later = await procs.spawn("s[1]", WORKER, probe_env(PROBE_EXIT="0"), None)
    took = time.monotonic() - t0
    assert not isinstance(later._popen, ForkedProcess)  # exec'd: no fork during the import
    assert took < 1.0, took  # not held until the import ends (or a wait for it runs out)
    assert server.warming == ("fs_slow",) and not server.warmed
    facts = await facts_of(later)
    assert facts["ppid"] == os.getpid()
    assert (await later.wait(20)).exit_code == 0
    await procs.aclose()


async def test_a_server_warmed_now_forks_even_the_first_worker_with_the_modules(
    reaper: Reaper, probe_dir: Path
) -> None:
    # A launcher whose every proc imports torch (palatine torchrun) warms before the
    # first spawn: the first workers are forked with the modules already loaded.
    (probe_dir / "fs_first.py").write_text("FIRST = True\n")
    probe = PROBE.replace('"torch": "torch" in sys.modules', '"torch": "fs_first" in sys.modules')
    (probe_dir / "fs_probe.py").write_text(probe)
    server = await started_server(reaper, warm=["fs_first"])
    assert server.warm_now() and server.warming == ("fs_first",)
    assert await server.wait_warmed(20) and server.warming == ()
    assert not server.warm_now()  # once only
    procs = reaper.make(fork_server=server)
    first = await procs.spawn("w[0]", WORKER, probe_env(PROBE_EXIT="0"), None)
    assert isinstance(first._popen, ForkedProcess)
    assert (await facts_of(first))["torch"] is True
    assert (await first.wait(10)).exit_code == 0
    await procs.aclose()
