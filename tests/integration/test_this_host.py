"""`this_host()` proc meshes from plain scripts: real OS processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(90)

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from palatine import Actor, endpoint, this_host, RemoteException
    from palatine.core.future import LOOP_THREAD_ERROR

    class Counter(Actor):
        def __init__(self, start=0):
            self.n = start

        @endpoint
        async def incr(self, by=1):
            self.n += by
            return self.n

        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def boom(self):
            raise ValueError("boom on purpose")

        @endpoint
        async def nap(self, s):
            await asyncio.sleep(s)
            return s

    t0 = time.monotonic()
    procs = this_host().spawn_procs(per_host={"procs": 4})
    counters = procs.spawn("counter", Counter, 0)
    print("SPAWNED", round(time.monotonic() - t0, 3))
    print("CALL", counters.incr.call(1).get().values())
    pids = counters.pid.call().get().values()
    print("DISTINCT_PIDS", len(set(pids)), os.getpid() not in pids)
    print("SLICE", counters.slice(procs=2).incr.call_one(1).get())
    t = time.monotonic()
    assert counters.nap.broadcast(5.0) is None  # a blocking broadcast would take 5 s
    print("BROADCAST_RETURNS_AT_ONCE", time.monotonic() - t < 2.0)
    items = sorted(counters.boom.stream())
    print("STREAM_ERRORS", [(r, type(v).__name__) for r, v in items])
    try:
        counters.slice(procs=1).boom.call_one().get()
    except RemoteException as e:
        print("REMOTE", e.type_name, e.message)

    async def use_await():
        vm = await counters.incr.call(0)
        return vm.values()

    print("AWAIT", asyncio.run(use_await()))

    from palatine.core import runtime
    fut = counters.incr.call(0)
    def on_loop():
        try:
            fut.get()
        except RuntimeError as e:
            return str(e)
        return "no error"
    print("ON_LOOP", runtime.submit(lambda: asyncio.sleep(0, on_loop())).get())
    procs.stop().get()
    print("STOPPED")
    """
)


def test_plain_script_drives_a_four_proc_mesh(tmp_path: object) -> None:
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert out.returncode == 0, out.stderr[-3000:]
    assert lines["CALL"] == "[1, 1, 1, 1]"
    assert lines["DISTINCT_PIDS"] == "4 True"
    assert lines["SLICE"] == "2"
    assert lines["BROADCAST_RETURNS_AT_ONCE"] == "True"
    assert lines["STREAM_ERRORS"] == str([(r, "RemoteException") for r in range(4)])
    assert lines["REMOTE"] == "ValueError boom on purpose"
    assert lines["AWAIT"] == "[1, 1, 2, 1]"
    assert lines["ON_LOOP"] == "blocking palatine call on the event loop thread; use await"
    assert "STOPPED" in out.stdout


FORK_SCRIPT = textwrap.dedent(
    """
    import os, time
    import psutil
    from palatine import Actor, endpoint, this_host

    class Probe(Actor):
        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def sleep(self, s):
            time.sleep(s)
            return s

    parents = set()
    for k in range(2):
        procs = this_host().spawn_procs(per_host={"procs": 2})
        mesh = procs.spawn("probe", Probe)
        pids = list(mesh.pid.call().get().values())
        parents |= {psutil.Process(p).ppid() for p in pids}
        if k == 1:
            pending = mesh.slice(procs=1).sleep.call_one(30)
            time.sleep(0.2)
            t0 = time.monotonic()
            os.kill(pids[1], 9)
            try:
                pending.get(timeout=10)
            except Exception as e:
                print("DETECTED", type(e).__name__, time.monotonic() - t0 < 2)
        procs.stop().get(timeout=20)
    (parent,) = parents
    print("PARENT", "me" if parent == os.getpid() else " ".join(psutil.Process(parent).cmdline()))
    print("SERVER", parent)
    """
)


@pytest.mark.parametrize("fork_server", ["1", "0"])
def test_procs_come_from_one_fork_server_unless_it_is_off(fork_server: str) -> None:
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    env["PALATINE_FORK_SERVER"] = fork_server
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=80, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["DETECTED"].endswith(" True"), lines["DETECTED"]
    if fork_server == "1":
        # (its command line, as the process title module left it readable)
        assert "from palatine.hosting.forkserver_main import main" in lines["PARENT"]
        server = int(lines["SERVER"])
        deadline = time.monotonic() + 5
        while True:
            try:  # (it may go between any two looks)
                if psutil.Process(server).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, "the fork server outlived its host"
            time.sleep(0.01)
    else:
        assert lines["PARENT"] == "me"


UNSENDABLE = textwrap.dedent(
    """
    import time
    from palatine import Actor, RemoteException, endpoint, this_host

    class Returns(Actor):
        @endpoint
        def generator(self):
            return (i for i in range(3))

        @endpoint
        def one(self):
            return 1

    mesh = this_host().spawn_procs(per_host={"procs": 2}).spawn("r", Returns)
    t0 = time.monotonic()
    try:
        mesh.slice(procs=0).generator.call_one().get(timeout=30)
    except RemoteException as e:
        print("ERROR", round(time.monotonic() - t0, 3), str(e).splitlines()[0])
    print("AFTER", mesh.one.call().get(timeout=30).values())
    """
)


def test_an_actor_returning_what_cannot_be_pickled_fails_that_call_only() -> None:
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-c", UNSENDABLE], capture_output=True, text=True, timeout=80, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    took, text = lines["ERROR"].split(" ", 1)
    assert float(took) < 1.0
    assert text.startswith(
        "TypeError: generator returned a generator, which cannot be sent: "
        "cannot pickle 'generator' object in mesh0[0].r[0]"
    ), text
    assert lines["AFTER"] == "[1, 1]"
    assert "panic" not in out.stderr and "evict" not in out.stderr, out.stderr[-2000:]


QUIET = textwrap.dedent(
    """
    from palatine import Actor, endpoint, this_host

    class Talker(Actor):
        @endpoint
        def say(self):
            print("hello from an actor", flush=True)
            return 1

    procs = this_host().spawn_procs(per_host={"procs": 2})
    procs.spawn("t", Talker).say.call().get(timeout=30)
    procs.stop().get(timeout=30)
    """
)


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_the_console_shows_the_programs_output_and_palatines_chatter_only_at_debug(
    level: str,
) -> None:
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    env["PALATINE_LOG_LEVEL"] = level
    out = subprocess.run(
        [sys.executable, "-c", QUIET], capture_output=True, text=True, timeout=80, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.endswith("hello from an actor")]
    assert said == ["[mesh0 0-1] hello from an actor"]
    chatter = [
        line for line in out.stderr.splitlines() if '"event": "ready"' in line or " INFO " in line
    ]
    if level == "INFO":
        assert chatter == [], out.stderr
    else:
        assert any('"event": "ready"' in line for line in chatter), out.stderr


BOTH = textwrap.dedent(
    """
    from palatine import Actor, endpoint, fetch, local_mesh, remote, this_host

    class One(Actor):
        @endpoint
        def one(self):
            return 1

    first = this_host().spawn_procs(per_host={"procs": 1})
    with local_mesh(1, 1):
        print("MESH", fetch(remote(len)("ab")).result(timeout=60), flush=True)
    second = this_host().spawn_procs(per_host={"procs": 1})  # after the local mesh
    print("ACTORS", first.spawn("a", One).one.call_one().get(timeout=30),
          second.spawn("b", One).one.call_one().get(timeout=30), flush=True)
    """
)


def test_a_script_with_a_local_mesh_and_this_host_reaches_both() -> None:
    # Both are private clusters of the script; a fresh token for the local mesh would
    # have locked this_host()'s later procs out of their own system.
    env = dict(os.environ)
    env.pop("PALATINE_CLUSTER_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-c", BOTH], capture_output=True, text=True, timeout=80, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MESH 2" in out.stdout and "ACTORS 1 1" in out.stdout, out.stdout + out.stderr[-2000:]
