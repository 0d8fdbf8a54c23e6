"""A job survives a restart of its system: `local_mesh` starts ``palatine system`` again
at the same address when it dies, and the running hosts, procs, controller and client
rejoin it with their identities; the training loop goes on with no call failed, and the
rebuilt registry supervises as before. A system that stops answering (SIGSTOP: stuck,
or swapping) is killed and restarted as a dead one, before the procs give up on it.
Without a restart, the loss is reported at once.

Each test runs a script as a user would (a fresh interpreter, a real local mesh) and
kills processes with SIGKILL from outside, as a fault would.
"""

from __future__ import annotations

import pytest
from user_scripts import MESH_HELPERS, run_script

pytestmark = pytest.mark.timeout(180)


PRELUDE = (
    MESH_HELPERS
    + """
    from palatine.cli import demo
    from palatine.core import runtime
    from palatine.channel.addr import parse
    from palatine.system.service import System

    def snapshot(addr):
        async def ask():
            client = await System(parse(addr)).attach(timeout_s=10)
            try:
                return await client.snapshot()
            finally:
                await client.close()
        return runtime.submit(ask).get()

    def training(mesh):
        # the demo's model on the mesh, one step taken: its state and its step
        state = remote(demo.init_state)(mesh.process_group(), 0, 64, 0.05, 32)
        step = remote(demo.train_step, mutates=("state",))
        fetch(step(state)).result(timeout=60)
        return state, step
"""
)


def test_training_goes_on_across_a_sigkill_and_restart_of_the_system() -> None:
    lines, _ = run_script(
        PRELUDE
        + """
    with local_mesh(1, 2) as mesh:
        with mesh.activate():
            state, step = training(mesh)
            before = pids_of(mesh)
            cluster = mesh._local
            old = cluster.system.pid
            os.kill(old, signal.SIGKILL)
            t0 = time.monotonic()
            steps = 0
            while time.monotonic() - t0 < 3.0:  # the restart and the rejoins happen meanwhile
                fetch(step(state)).result(timeout=60)
                steps += 1
            print("RESTARTED", cluster.system.pid != old, len(cluster.system_restarts))
            print("STEPS", steps > 3)
            snap = snapshot(cluster.system_addr)
            worker = snap.worlds["worker"]
            print("WORLD", worker.status, sorted(e.pid for e in worker.procs.values()) == sorted(before))
            print("CONTROLLER", snap.worlds["controller"].status)
            print("PIDS", pids_of(mesh) == before)
            sums = {fetch(remote(demo.evaluate)(state), shard=r).result(timeout=60)[1]
                    for r in range(2)}
            print("REPLICAS", len(sums))
            # the rebuilt registry supervises: a worker killed now is reported by name
            os.kill(before[1], signal.SIGKILL)
            e = until_failed(mesh)
            print("FAILED", e.kind, "worker[1]" in str(e), "signal 9" in str(e))
    """
    )
    assert lines["RESTARTED"] == "True 1"
    assert lines["STEPS"] == "True"
    assert lines["WORLD"] == "Live True"
    assert lines["CONTROLLER"] == "Live"
    assert lines["PIDS"] == "True"
    assert lines["REPLICAS"] == "1"
    assert lines["FAILED"] == "proc_failed True True"


def test_a_stalled_system_is_killed_and_started_again_and_the_job_goes_on() -> None:
    # SIGSTOP: the system neither dies nor answers (as when stuck or swapping). The procs
    # give up on it after `system_loss_timeout` (10 s); the launcher must restart it first.
    lines, _ = run_script(
        PRELUDE
        + """
    from palatine import config

    def slow(seconds):
        import time
        time.sleep(seconds)
        return seconds

    with local_mesh(1, 2) as mesh:
        with mesh.activate():
            cluster = mesh._local
            state, step = training(mesh)
            before = pids_of(mesh)
            pending = fetch(remote(slow)(1.0))  # a call under way when the system stalls
            old = cluster.system.pid
            os.kill(old, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                print("PENDING", pending.result(timeout=60))
                # the job goes on throughout: the restart, then the procs rejoining it
                limit = config.system_loss_timeout_s() + 10
                rejoined = False
                while time.monotonic() - t0 < limit and not rejoined:
                    fetch(step(state)).result(timeout=60)
                    if cluster.system_restarts and cluster.system.pid != old:
                        snap = snapshot(cluster.system_addr)
                        w = snap.worlds.get("worker")
                        c = snap.worlds.get("controller")
                        rejoined = (
                            w is not None and w.status == "Live" and c is not None
                            and c.status == "Live"
                            and sorted(e.pid for e in w.procs.values()) == sorted(before)
                        )
                print("REJOINED", rejoined, round(time.monotonic() - t0, 2))
                print("WITHIN", time.monotonic() - t0 < config.system_loss_timeout_s())
                ended, how, new, _ = cluster.system_restarts[0]
                print("RESTART", ended == old, new == cluster.system.pid, len(cluster.system_restarts))
                print("HOW", how)
                for _ in range(5):  # rejoined: acknowledged again, the procs stay
                    fetch(step(state)).result(timeout=60)
                print("PIDS", pids_of(mesh) == before)
            finally:
                try:
                    os.kill(old, signal.SIGCONT)
                except ProcessLookupError:
                    pass
    """
    )
    assert lines["PENDING"] == "1.0"
    assert lines["REJOINED"].startswith("True "), lines["REJOINED"]
    assert lines["WITHIN"] == "True"
    assert lines["RESTART"] == "True True 1"
    assert "did not answer" in lines["HOW"] and "killed" in lines["HOW"], lines["HOW"]
    assert lines["PIDS"] == "True"


def test_a_worker_killed_while_the_system_is_down_is_reported_with_its_signal() -> None:
    lines, _ = run_script(
        PRELUDE
        + """
    with local_mesh(1, 2) as mesh:
        with mesh.activate():
            before = pids_of(mesh)
            os.kill(mesh._local.system.pid, signal.SIGKILL)
            os.kill(before[1], signal.SIGKILL)
            t0 = time.monotonic()
            e = until_failed(mesh)
            print("FAILED", e.kind, "worker[1]" in str(e), "signal 9" in str(e))
            print("WITHIN", time.monotonic() - t0 < 10)
    """
    )
    assert lines["FAILED"] == "proc_failed True True"
    assert lines["WITHIN"] == "True"


def test_a_system_killed_more_often_than_it_may_restart_fails_the_job_at_once() -> None:
    lines, _ = run_script(
        PRELUDE
        + """
    def slow():
        import time
        time.sleep(60)
        return 1

    with local_mesh(1, 2, system_restarts=1) as mesh:
        with mesh.activate():
            fetch(remote(pid)()).result(timeout=60)
            cluster = mesh._local
            first = cluster.system.pid
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while len(cluster.system_restarts) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            fetch(remote(pid)()).result(timeout=60)
            pending = fetch(remote(slow)())
            second = cluster.system.pid
            t0 = time.monotonic()
            os.kill(second, signal.SIGKILL)
            try:
                pending.result(timeout=60)
            except DeviceException as e:
                print("LOST", e.kind, time.monotonic() - t0 < 1.0)
                print("NAMES", f"pid {second}" in str(e), "SIGKILL" in str(e))
            left = time.monotonic()
    print("LEFT", time.monotonic() - left < 2.0)
    """
    )
    assert lines["LOST"] == "system_lost True"
    assert lines["NAMES"] == "True True"
    assert lines["LEFT"] == "True"


def test_a_system_restarted_by_hand_without_its_execution_id_gets_the_job_back() -> None:
    # A job whose launcher does not keep its system: the user starts `palatine system`
    # again at the same address, with the cluster token and nothing else.
    lines, _ = run_script(
        PRELUDE
        + """
    from palatine import connect
    from palatine.tensor.client.local import start_local
    from palatine.tensor.client.procs import RoleProcess

    cluster = start_local(1, 2, system_restarts=0)
    try:
        token = cluster.env["PALATINE_CLUSTER_TOKEN"]
        with connect(cluster.system_addr, "worker", _token=token) as mesh, mesh.activate():
            before = pids_of(mesh)
            old = snapshot(cluster.system_addr).execution_id
            cluster.system.kill()
            env = {k: v for k, v in cluster.env.items() if k != "PALATINE_EXECUTION_ID"}
            again = RoleProcess(["system", "--system-addr", cluster.system_addr], env, 30)
            cluster.procs.append(again)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                snap = snapshot(cluster.system_addr)
                w = snap.worlds.get("worker")
                if w is not None and w.status == "Live" and snap.worlds.get("controller"):
                    break
                time.sleep(0.1)
            print("BACK", w.status, sorted(e.pid for e in w.procs.values()) == sorted(before))
            print("EXECUTION", snap.execution_id == old)
            print("PIDS", pids_of(mesh) == before)
    finally:
        cluster.stop(2.0)
    """
    )
    assert lines["BACK"] == "Live True"
    assert lines["EXECUTION"] == "True"
    assert lines["PIDS"] == "True"
