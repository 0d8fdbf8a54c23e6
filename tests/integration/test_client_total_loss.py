"""A client whose controller dies with the rest of its job fails its pending calls at once.

The system, the host(s) and the controller are SIGKILLed together, as the OOM killer or
a lost node would end them, while a fetch is pending. The fetch raises a
`DeviceException` (``controller_lost``) naming the controller's process, its pid and how
it ended, within seconds (far inside the heartbeat and liveness bounds, 20 s and 30 s),
whatever else died with it; the return of what the client still sends to the dead
controller is said once, not over and over; the script leaves its mesh and exits.

A `local_mesh` learns it from its launcher, which is the roles' parent. A program that
only `connect`s (as under ``palatine launch``) learns it from its own messages to the
controller coming back; that is tested too, with the keep-alive shortened so that it
beats every second.
"""

from __future__ import annotations

import time

import psutil
import pytest
from user_scripts import MESH_HELPERS, run_script

pytestmark = pytest.mark.timeout(120)

PRELUDE = (
    MESH_HELPERS
    + """
    def slow():
        import time
        time.sleep(60)
        return 1

    def role_pids(cluster):
        # each role of a local mesh by the name of its log: system, host-0, controller
        return {rp.log_path.rsplit("/", 1)[-1][:-len(".log")]: rp.pid for rp in cluster.procs}

    def lose_together(mesh, pids, within, names):
        # SIGKILL pids at once with a fetch pending; what the fetch raises, and how soon
        print("ALL", *pids, *pids_of(mesh))
        pending = fetch(remote(slow)())
        for p in pids:
            os.kill(p, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            pending.result(timeout=60)
        except DeviceException as e:
            print("FAILED", e.kind, round(time.monotonic() - t0, 2))
            print("WITHIN", time.monotonic() - t0 < within)
            print("NAMES", *[name in str(e) for name in names])
            print("TEXT", " ".join(str(e).split()))
            return e
"""
)


def _check(lines: dict[str, str], stderr: str, names: int) -> None:
    """The fetch failed in time, naming all it should; the script left its mesh within
    10 s, said the returns at most once, and left no process of its mesh behind."""
    assert lines["FAILED"].startswith("controller_lost "), lines["FAILED"]
    assert lines["WITHIN"] == "True", lines["FAILED"]
    assert lines["NAMES"] == " ".join(["True"] * names), lines["TEXT"]
    assert lines["LEFT"].endswith(" True"), lines["LEFT"]
    assert stderr.count("was undeliverable") <= 1, stderr[-3000:]
    pids = [int(p) for p in lines["ALL"].split()]
    deadline = time.monotonic() + 5  # a killed host's workers follow it at once
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if psutil.pid_exists(p)] == [], "processes of the mesh left"


@pytest.mark.parametrize("run", range(5))
def test_a_fetch_fails_at_once_naming_the_controller_when_system_host_and_controller_die_together(
    run: int,
) -> None:
    lines, stderr = run_script(
        PRELUDE
        + """
    with local_mesh(1, 2) as mesh:
        with mesh.activate():
            roles = role_pids(mesh._local)
            e = lose_together(mesh, roles.values(), 3.0, [
                f"pid {roles['controller']}", "SIGKILL", f"system (pid {roles['system']})",
                f"host-0 (pid {roles['host-0']})",
            ])
            print("ATTRS", e.pid == roles["controller"], e.exit_signal)
            try:  # every later call raises it too
                fetch(remote(pid)()).result(timeout=10)
            except DeviceException as later:
                print("LATER", later.kind)
            left = time.monotonic()
    print("LEFT", round(time.monotonic() - left, 2), time.monotonic() - left < 10.0)
    """
    )
    _check(lines, stderr, 4)
    assert lines["ATTRS"] == "True 9"
    assert lines["LATER"] == "controller_lost"


def test_a_fetch_fails_at_once_naming_the_controller_when_it_dies_with_its_host() -> None:
    # The system lives: it also declares the controller dead; the launcher says it first.
    lines, stderr = run_script(
        PRELUDE
        + """
    with local_mesh(2, 1) as mesh:
        with mesh.activate():
            roles = role_pids(mesh._local)
            lose_together(mesh, [roles["controller"], roles["host-1"]], 3.0,
                          [f"pid {roles['controller']}", "SIGKILL"])
            left = time.monotonic()
    print("LEFT", round(time.monotonic() - left, 2), time.monotonic() - left < 10.0)
    """
    )
    _check(lines, stderr, 2)


def test_a_program_that_only_connects_fails_within_a_beat_when_its_whole_job_dies() -> None:
    # As a program under `palatine launch`: it attaches with connect() and is no parent of
    # the roles, so only its own messages to the controller tell it the controller is gone:
    # a beat every second (a third of the liveness timeout set below), and on a local
    # session what it sends comes back at once.
    lines, stderr = run_script(
        PRELUDE
        + """
    import palatine
    from palatine.job import LocalJob

    job = LocalJob(1, 2)
    try:
        os.environ.update(job.client_env())
        with palatine.connect() as mesh:
            assert mesh._local is None
            with mesh.activate():
                roles = role_pids(job._cluster)
                lose_together(mesh, roles.values(), 5.0, ["controller[0]", "undeliverable"])
                left = time.monotonic()
        print("LEFT", round(time.monotonic() - left, 2), time.monotonic() - left < 10.0)
    finally:
        job.cancel(clean=False)
    """,
        env={"PALATINE_CLIENT_LIVENESS_TIMEOUT": "3"},
    )
    _check(lines, stderr, 2)
