"""A host's child processes with real OS processes.

Every child is a ``python -c`` program. The ``reaper`` fixture SIGKILLs the process group
of every child a test started (and any extra pid it tracked) and reaps them, whatever
the test's outcome. Waits poll a condition against a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from palatine import config
from palatine.hosting.child_env import (
    arm_parent_death_signal,
    child_env,
    describe_exit,
    log_path_for,
    stack_path_for,
)
from palatine.hosting.children import Child, ChildProcs
from palatine.hosting.stacks import StackDumpError, dump_external, find_pyspy
from palatine.output.logs import default_log_dir

pytestmark = pytest.mark.timeout(30)

PY = sys.executable


def py(code: str) -> list[str]:
    """argv running ``code`` (dedented) in a fresh interpreter."""
    return [PY, "-c", textwrap.dedent(code)]


async def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``cond`` until it holds; fail the test when ``timeout_s`` passes first."""
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():
                await asyncio.sleep(0.005)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what or cond}")


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie awaiting an absent reaper counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_printed(child: Child, prefix: str, timeout_s: float = 10.0) -> str:
    """The first tail line of ``child`` starting with ``prefix``, once it appears."""
    found: list[str] = []

    def seen() -> bool:
        found[:] = [line for line in child.tail if line.startswith(prefix)]
        return bool(found) or child.done()

    await wait_until(seen, timeout_s, f"{child.proc_id} to print {prefix!r}")
    assert found, f"{child.proc_id} ended without printing {prefix!r}: {child.tail}"
    return found[0]


class Reaper:
    """Makes `ChildProcs` for a test and kills everything they started afterwards."""

    def __init__(self) -> None:
        self.made: list[ChildProcs] = []
        self.pids: list[int] = []

    def make(self, on_exit: Any = None, **kw: Any) -> ChildProcs:
        procs = ChildProcs(on_exit, **kw)
        self.made.append(procs)
        return procs

    def track(self, pid: int) -> None:
        self.pids.append(pid)

    def cleanup(self) -> None:
        for procs in self.made:
            for child in procs.children:
                popen = child._popen
                if child.pid is None or popen is None:
                    continue
                if popen.returncode is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.pid, signal.SIGKILL)
                    with contextlib.suppress(Exception):
                        popen.wait(5)
                if child._pidfd is not None:
                    with contextlib.suppress(OSError):
                        os.close(child._pidfd)
                    child._pidfd = None
                ChildProcs._close_log(child)
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


class Exits:
    """An ``on_exit`` recorder: each call with its arrival time."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Child, int | None, int | None, list[str]]] = []

    def __call__(self, child: Child, code: int | None, sig: int | None, tail: list[str]) -> None:
        self.calls.append((time.monotonic(), child, code, sig, tail))

    def of(self, child: Child) -> tuple[float, Child, int | None, int | None, list[str]]:
        matches = [c for c in self.calls if c[1] is child]
        assert len(matches) == 1, f"expected one exit report for {child}, got {len(matches)}"
        return matches[0]

    async def wait(self, child: Child, timeout_s: float = 10.0) -> None:
        await wait_until(lambda: any(c[1] is child for c in self.calls), timeout_s, "on_exit")


SLEEPER = """
    import time
    print("ready", flush=True)
    time.sleep(60)
"""


# --------------------------------------------------------------------------- pure helpers


def test_describe_exit_texts() -> None:
    assert describe_exit(None, 9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(None, 15) == "killed by signal 15 (SIGTERM)"
    assert describe_exit(None, 11) == "killed by signal 11 (SIGSEGV)"
    assert describe_exit(3, None) == "exited with code 3"
    assert describe_exit(0, None) == "exited with code 0"
    assert describe_exit(None, 200) == "killed by signal 200"


def test_log_path_layout(tmp_path: Path) -> None:
    path = log_path_for(tmp_path, "exec-1", "hostworker[0]", "worker[5]")
    assert path == tmp_path / "exec-1" / "hostworker_0" / "worker_5.log"
    assert stack_path_for(path) == tmp_path / "exec-1" / "hostworker_0" / "worker_5.stack"


def test_default_log_dir_follows_config(tmp_path: Path) -> None:
    with config.override(log_dir=None):
        assert default_log_dir().name == "palatine-logs"
        assert log_path_for(None, "e", "hostw[1]", "w[2]").parent.parent.parent == (
            default_log_dir()
        )
    with config.override(log_dir=str(tmp_path / "mine")):
        assert default_log_dir() == tmp_path / "mine"


def test_child_env_table(tmp_path: Path) -> None:
    stack = tmp_path / "w_5.stack"
    env = child_env(
        world_id="w",
        proc_id="w[5]",
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        bootstrap_addr="tcp:127.0.0.1:29500",
        execution_id="exec-1",
        host_proc_id="hostw[1]",
        stack_file=stack,
        cluster_token="s3cret",
        supervision_update_interval_s=0.2,
        inherited={},
    )
    assert env == {
        "PALATINE_WORLD_ID": "w",
        "PALATINE_PROC_ID": "w[5]",
        "PALATINE_BOOTSTRAP_ADDR": "tcp:127.0.0.1:29500",
        "PALATINE_WORLD_SIZE": "8",
        "PALATINE_RANK": "5",
        "PALATINE_LOCAL_RANK": "1",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "PALATINE_CLUSTER_TOKEN": "s3cret",
        "PALATINE_EXECUTION_ID": "exec-1",
        "PALATINE_HOST_PROC_ID": "hostw[1]",
        "PALATINE_PARENT_PID": str(os.getpid()),
        "PALATINE_SUPERVISION_UPDATE_INTERVAL": "0.2",
        "PALATINE_STACK_FILE": str(stack),
    }
    # An interval the operator already set is left alone.
    kept = child_env(
        world_id="w",
        proc_id="w[0]",
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        bootstrap_addr="unix:@x",
        execution_id="e",
        host_proc_id="hostw[0]",
        stack_file=stack,
        inherited={"PALATINE_SUPERVISION_UPDATE_INTERVAL": "7"},
    )
    assert "PALATINE_SUPERVISION_UPDATE_INTERVAL" not in kept
    assert "PALATINE_CLUSTER_TOKEN" not in kept


# --------------------------------------------------------------------------- spawning and output


async def test_child_sees_host_env_plus_given(
    tmp_path: Path, reaper: Reaper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PALATINE_TEST_INHERITED", "from-host")
    procs = reaper.make(echo=False)
    extra = child_env(
        world_id="w",
        proc_id="w[3]",
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        bootstrap_addr="tcp:127.0.0.1:1",
        execution_id="exec-env",
        host_proc_id="hostw[1]",
        stack_file=tmp_path / "w_3.stack",
        supervision_update_interval_s=2.0,
        inherited={},
    )
    child = await procs.spawn(
        "w[3]",
        py("import json, os; print(json.dumps(dict(os.environ)), flush=True); print(os.getcwd())"),
        {**extra, "EXTRA": "1"},
        tmp_path / "w_3.log",
    )
    done = await child.wait(10)
    assert done.exit_code == 0
    seen = json.loads(child.tail[0])
    assert seen["PALATINE_TEST_INHERITED"] == "from-host"
    assert seen["EXTRA"] == "1"
    for key, value in extra.items():
        assert seen[key] == value
    assert seen["PALATINE_SUPERVISION_UPDATE_INTERVAL"] == "2"
    assert child.tail[1] == os.getcwd()


async def test_output_goes_to_log_tail_and_prefixed_echo(tmp_path: Path, reaper: Reaper) -> None:
    echo = io.StringIO()
    procs = reaper.make(echo_stream=echo)
    log_path = tmp_path / "logs" / "exec" / "hostw_0" / "w_0.log"
    child = await procs.spawn(
        "w[0]",
        py(
            r"""
            import sys
            print("hello out", flush=True)
            print("second out", flush=True)
            sys.stderr.write("hello err\n"); sys.stderr.flush()
            sys.stdout.buffer.write(b"bad \xff byte\n"); sys.stdout.flush()
            sys.stdout.write("no newline at end")
            """
        ),
        {},
        log_path,
    )
    assert child.pid is not None and child.state == "running"
    done = await child.wait(10)
    assert done.exit_code == 0 and done.exit_signal is None
    assert done.reason == "exited with code 0"

    raw = log_path.read_bytes()
    lines = raw.split(b"\n")
    assert lines[-1] == b""
    assert sorted(lines[:-1]) == sorted(
        [b"hello out", b"second out", b"hello err", b"bad \xff byte", b"no newline at end"]
    )
    # Per stream, order is kept.
    assert lines.index(b"hello out") < lines.index(b"second out") < lines.index(b"bad \xff byte")

    expected = {
        "hello out",
        "second out",
        "hello err",
        "bad \ufffd byte",
        "no newline at end",
    }
    assert set(child.tail) == expected
    assert procs.flush_echo(5.0)
    echoed = echo.getvalue().splitlines()
    assert set(echoed) == {f"[w[0]] {text}" for text in expected}


async def test_default_echo_goes_to_host_stderr(
    tmp_path: Path, reaper: Reaper, capsys: pytest.CaptureFixture[str]
) -> None:
    procs = reaper.make()
    child = await procs.spawn("w[1]", py("print('to the host', flush=True)"), {}, None)
    await child.wait(10)
    assert procs.flush_echo(5.0)
    assert "[w[1]] to the host\n" in capsys.readouterr().err


# --------------------------------------------------------------------------- exit watching


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "thread"])
async def test_sigkill_is_reported_within_half_a_second(reaper: Reaper, use_pidfd: bool) -> None:
    exits = Exits()
    procs = reaper.make(exits, echo=False, use_pidfd=use_pidfd)
    child = await procs.spawn("w[2]", py(SLEEPER), {}, None)
    await wait_printed(child, "ready")
    assert child.pid is not None
    killed_at = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    await exits.wait(child, 5)
    at, _, code, sig, _ = exits.of(child)
    assert at - killed_at < 2.0  # typically well under 0.5 s; slack for a stalling machine
    assert (code, sig) == (None, 9)
    assert child.state == "exited"
    assert child.exit is not None and child.exit.reason == "killed by signal 9 (SIGKILL)"
    assert not child.exit.requested
    assert child.info()["exit"] == "killed by signal 9 (SIGKILL)"
    assert gone(child.pid)


def test_sigkill_is_reported_on_the_stdlib_loop(reaper: Reaper) -> None:
    async def body() -> None:
        exits = Exits()
        procs = reaper.make(exits, echo=False)
        child = await procs.spawn("w[0]", py(SLEEPER), {}, None)
        await wait_printed(child, "ready")
        assert child.pid is not None
        killed_at = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        await exits.wait(child, 5)
        at, _, code, sig, _ = exits.of(child)
        assert at - killed_at < 2.0 and (code, sig) == (None, 9)
        await procs.aclose()

    asyncio.run(body())


async def test_exit_code_and_tail_of_last_lines(reaper: Reaper) -> None:
    exits = Exits()
    procs = reaper.make(exits, echo=False)
    child = await procs.spawn(
        "w[1]",
        py(
            """
            import sys
            for i in range(60):
                sys.stderr.write(f"line {i}\\n")
            sys.exit(3)
            """
        ),
        {},
        None,
    )
    await exits.wait(child)
    _, _, code, sig, tail = exits.of(child)
    assert (code, sig) == (3, None)
    assert tail == [f"line {i}" for i in range(10, 60)]
    assert child.exit is not None and child.exit.reason == "exited with code 3"
    assert child.exit.stderr_tail == tail


async def test_crash_tail_has_stdout_and_traceback(reaper: Reaper) -> None:
    exits = Exits()
    procs = reaper.make(exits, echo=False)
    child = await procs.spawn(
        "w[1]",
        py(
            """
            print("about to fail", flush=True)
            raise ValueError("boom")
            """
        ),
        {},
        None,
    )
    await exits.wait(child)
    _, _, code, _, tail = exits.of(child)
    assert code == 1
    assert "about to fail" in tail
    assert "ValueError: boom" in tail


async def test_async_on_exit_callback_is_run(reaper: Reaper) -> None:
    reported = asyncio.Event()
    got: list[int | None] = []

    async def on_exit(child: Child, code: int | None, sig: int | None, tail: list[str]) -> None:
        await asyncio.sleep(0)
        got.append(code)
        reported.set()

    procs = reaper.make(on_exit, echo=False)
    await procs.spawn("w[0]", py("raise SystemExit(4)"), {}, None)
    async with asyncio.timeout(10):
        await reported.wait()
    assert got == [4]
    await procs.aclose()


async def test_failing_callback_does_not_break_watching(reaper: Reaper) -> None:
    def on_exit(child: Child, code: int | None, sig: int | None, tail: list[str]) -> None:
        raise RuntimeError("callback bug")

    procs = reaper.make(on_exit, echo=False)
    first = await procs.spawn("w[0]", py("pass"), {}, None)
    second = await procs.spawn("w[1]", py("raise SystemExit(2)"), {}, None)
    assert (await first.wait(10)).exit_code == 0
    assert (await second.wait(10)).exit_code == 2


# --------------------------------------------------------------------------- spawn failures


async def test_missing_program_is_a_failed_result(tmp_path: Path, reaper: Reaper) -> None:
    exits = Exits()
    procs = reaper.make(exits, echo=False)
    prog = str(tmp_path / "no-such-program")
    child = await procs.spawn("w[4]", [prog, "--flag"], {}, tmp_path / "w_4.log")
    assert child.state == "failed"
    assert child.pid is None
    assert child.exit is not None
    assert child.exit.reason == f"cannot execute '{prog}': No such file or directory"
    assert child.info()["exit"] == child.exit.reason
    await exits.wait(child, 5)
    _, _, code, sig, tail = exits.of(child)
    assert (code, sig, tail) == (None, None, [])

    bare = await procs.spawn("w[5]", ["palatine-no-such-program-anywhere"], {}, None)
    assert bare.exit is not None
    assert bare.exit.reason == (
        "cannot execute 'palatine-no-such-program-anywhere': No such file or directory"
    )


async def test_unexecutable_program_is_a_failed_result(tmp_path: Path, reaper: Reaper) -> None:
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    procs = reaper.make(echo=False)
    child = await procs.spawn("w[0]", [str(script)], {}, None)
    assert child.state == "failed"
    assert child.exit is not None
    assert child.exit.reason == f"cannot execute '{script}': Permission denied"
    await child.wait(5)


# --------------------------------------------------------------------------- termination

SPAWNS_GRANDCHILD = """
    import signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"grandchild {gc.pid}", flush=True)
    if "--exit" in sys.argv:
        sys.exit(0)
    time.sleep(60)
"""


def grandchild_argv(*flags: str) -> list[str]:
    return [*py(SPAWNS_GRANDCHILD), *flags]


async def grandchild_of(child: Child, reaper: Reaper) -> int:
    line = await wait_printed(child, "grandchild ")
    pid = int(line.split()[1])
    reaper.track(pid)
    return pid


async def test_kill_all_leaves_no_process(reaper: Reaper) -> None:
    exits = Exits()
    procs = reaper.make(exits, echo=False)
    children = [await procs.spawn(f"w[{r}]", grandchild_argv(), {}, None) for r in range(3)]
    grandchildren = [await grandchild_of(c, reaper) for c in children]
    pids = [c.pid for c in children if c.pid is not None] + grandchildren
    assert all(not gone(pid) for pid in pids)

    killed = await procs.kill_all(grace_s=5)
    assert {c.proc_id for c in killed} == {"w[0]", "w[1]", "w[2]"}
    for child in children:
        assert child.state == "exited"
        assert child.exit is not None and child.exit.exit_signal == signal.SIGTERM
        assert child.exit.requested
    assert len(exits.calls) == 3
    assert procs.running() == []
    await wait_until(lambda: all(gone(pid) for pid in pids), 5, "every process to be gone")


async def test_kill_all_of_one_world(reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    a0 = await procs.spawn("a[0]", py(SLEEPER), {}, None)
    a1 = await procs.spawn("a[1]", py(SLEEPER), {}, None)
    b0 = await procs.spawn("b[0]", py(SLEEPER), {}, None)
    for child in (a0, a1, b0):
        await wait_printed(child, "ready")
    killed = await procs.kill_all("a", grace_s=5)
    assert sorted(c.proc_id for c in killed) == ["a[0]", "a[1]"]
    assert not a0.running and not a1.running
    assert b0.running and b0.pid is not None and not gone(b0.pid)
    assert [c.proc_id for c in procs.running()] == ["b[0]"]
    await procs.aclose(grace_s=5)
    assert not b0.running and gone(b0.pid)


async def test_child_ignoring_sigterm_is_killed_after_grace(reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    child = await procs.spawn("w[0]", grandchild_argv("--ignore-term"), {}, None)
    grandchild = await grandchild_of(child, reaper)
    started = time.monotonic()
    done = await procs.terminate(child, grace_s=0.5)
    took = time.monotonic() - started
    assert done is not None
    assert done.exit_signal == signal.SIGKILL
    assert done.reason == "killed by signal 9 (SIGKILL)"
    assert done.requested
    assert 0.5 <= took < 3.0
    # The grandchild ignored SIGTERM too (inherited); the group SIGKILL took it.
    await wait_until(lambda: gone(grandchild), 5, "the grandchild to be gone")


async def test_terminate_of_well_behaved_child_is_quick(reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    child = await procs.spawn("w[0]", py(SLEEPER), {}, None)
    await wait_printed(child, "ready")
    assert child.info()["state"] == "running"
    started = time.monotonic()
    done = await procs.terminate(child, grace_s=5)
    assert time.monotonic() - started < 2.0
    assert done is not None and done.exit_signal == signal.SIGTERM
    assert child.info()["state"] == "exited"
    # Terminating an ended child is a no-op returning the same exit.
    assert await procs.terminate(child) is done


async def test_group_of_a_dead_child_is_cleaned_up(reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    child = await procs.spawn("w[0]", grandchild_argv("--exit"), {}, None)
    grandchild = await grandchild_of(child, reaper)
    assert (await child.wait(10)).exit_code == 0
    await wait_until(lambda: gone(grandchild), 5, "the dead child's grandchild to be gone")


async def test_no_spawn_after_close(reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    await procs.aclose()
    child = await procs.spawn("w[0]", py(SLEEPER), {}, None)
    assert child.state == "failed" and child.pid is None
    assert child.exit is not None and "stopping" in child.exit.reason


# --------------------------------------------------------------------------- parent death

GRANDCHILD_ARMS = """
import time
from palatine.hosting.child_env import arm_parent_death_signal
print("armed", arm_parent_death_signal(), flush=True)
time.sleep(60)
"""

PARENT_OF_ARMED = f"""
    import os, subprocess, sys, time
    env = dict(os.environ, PALATINE_PARENT_PID=str(os.getpid()))
    gc = subprocess.Popen([sys.executable, "-c", {GRANDCHILD_ARMS!r}], env=env,
                          stdout=subprocess.PIPE, text=True)
    print(f"grandchild {{gc.pid}} {{gc.stdout.readline().strip()}}", flush=True)
    time.sleep(60)
"""


async def test_parent_death_signal_takes_the_grandchild(reaper: Reaper) -> None:
    exits = Exits()
    # Keep the group alive on the parent's death: only the parent-death signal may act.
    procs = reaper.make(exits, echo=False, kill_group_on_exit=False)
    parent = await procs.spawn("w[0]", py(PARENT_OF_ARMED), {}, None)
    line = await wait_printed(parent, "grandchild ", 20)
    _, pid_text, *rest = line.split()
    grandchild = int(pid_text)
    reaper.track(grandchild)
    assert rest == ["armed", "True"]
    assert not gone(grandchild)
    assert parent.pid is not None
    os.kill(parent.pid, signal.SIGKILL)
    await exits.wait(parent, 5)
    await wait_until(lambda: gone(grandchild), 5, "the armed grandchild to die")


async def test_arm_exits_at_once_when_parent_already_changed(reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    code = """
        from palatine.hosting.child_env import arm_parent_death_signal
        arm_parent_death_signal()
        print("still running", flush=True)
    """
    child = await procs.spawn("w[0]", py(code), {"PALATINE_PARENT_PID": "1"}, None)
    done = await child.wait(10)
    assert done.exit_code == 1
    assert "still running" not in child.tail

    unset = await procs.spawn(
        "w[1]",
        py("from palatine.hosting.child_env import arm_parent_death_signal as a; print(a())"),
        {"PALATINE_PARENT_PID": ""},
        None,
    )
    assert (await unset.wait(10)).exit_code == 0
    assert unset.tail == ["False"]


def test_arm_without_variable_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PALATINE_PARENT_PID", raising=False)
    assert arm_parent_death_signal() is False


# --------------------------------------------------------------------------- stack dumps

SPINNER = """
    from palatine.hosting.stacks import register_faulthandler
    register_faulthandler()

    def spin_forever_here():
        print("spinning", flush=True)
        while True:
            pass

    spin_forever_here()
"""

NAPPER = """
    import time
    from palatine.hosting.stacks import register_faulthandler
    register_faulthandler()

    def nap_in_sleep():
        print("napping", flush=True)
        time.sleep(60)

    nap_in_sleep()
"""


async def test_faulthandler_dump_of_a_busy_child(tmp_path: Path, reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    log_path = tmp_path / "w_0.log"
    stack = stack_path_for(log_path)
    child = await procs.spawn("w[0]", py(SPINNER), {"PALATINE_STACK_FILE": str(stack)}, log_path)
    await wait_printed(child, "spinning")
    assert child.pid is not None
    method, text = await dump_external(child.pid, stack, timeout_s=5, use_pyspy=False)
    assert method == "faulthandler"
    assert "spin_forever_here" in text
    # A second dump returns only what it added, and the child keeps running.
    method2, text2 = await dump_external(child.pid, stack, timeout_s=5, use_pyspy=False)
    assert method2 == "faulthandler"
    assert text2.count("spin_forever_here") == text.count("spin_forever_here") >= 1
    assert child.running and not gone(child.pid)


async def test_faulthandler_dump_of_a_sleeping_child(tmp_path: Path, reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    stack = tmp_path / "w_1.stack"
    child = await procs.spawn("w[1]", py(NAPPER), {"PALATINE_STACK_FILE": str(stack)}, None)
    await wait_printed(child, "napping")
    assert child.pid is not None
    method, text = await dump_external(child.pid, stack, timeout_s=5, use_pyspy=False)
    assert method == "faulthandler"
    assert "nap_in_sleep" in text


async def test_dump_refuses_child_without_handler(tmp_path: Path, reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    child = await procs.spawn("w[0]", py(SLEEPER), {}, None)
    await wait_printed(child, "ready")
    assert child.pid is not None
    with pytest.raises(StackDumpError, match="does not handle SIGUSR1"):
        await dump_external(child.pid, tmp_path / "absent.stack", timeout_s=2, use_pyspy=False)
    assert child.running and not gone(child.pid)


async def test_dump_of_exited_process_fails_cleanly(tmp_path: Path, reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    child = await procs.spawn("w[0]", py("pass"), {}, None)
    await child.wait(10)
    assert child.pid is not None
    with pytest.raises(StackDumpError):
        await dump_external(child.pid, tmp_path / "x.stack", timeout_s=1, use_pyspy=False)


@pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")
async def test_pyspy_dump_of_a_busy_child(tmp_path: Path, reaper: Reaper) -> None:
    procs = reaper.make(echo=False)
    stack = tmp_path / "w_0.stack"
    child = await procs.spawn("w[0]", py(SPINNER), {"PALATINE_STACK_FILE": str(stack)}, None)
    await wait_printed(child, "spinning")
    assert child.pid is not None
    method, text = await dump_external(child.pid, stack, native=True, timeout_s=10)
    # py-spy may lack ptrace permission here; then the faulthandler fallback answers.
    assert method in ("py-spy", "faulthandler")
    assert "spin_forever_here" in text


def test_handoff_variables_round_trip_and_a_bad_number_reads_as_not_handed() -> None:
    from palatine.hosting.child_env import Handoff

    handed = Handoff(proc_id="w[3]", bootstrap_addr="unix:@x", rank=3, parent_pid=42, lifeline_fd=7)
    env = handed.to_env()
    assert env == {
        "PALATINE_PROC_ID": "w[3]",
        "PALATINE_BOOTSTRAP_ADDR": "unix:@x",
        "PALATINE_RANK": "3",
        "PALATINE_PARENT_PID": "42",
        "PALATINE_LIFELINE_FD": "7",
    }
    assert Handoff.from_env(env) == handed
    assert Handoff.from_env({"PALATINE_PARENT_PID": "me", "PALATINE_WORLD_ID": " w "}) == Handoff(
        world_id="w"
    )
