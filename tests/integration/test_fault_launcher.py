"""Faults a `local_mesh`'s hosts absorb, as a user meets them: a rank lost early in a
mesh's life, while the hosts' fork servers still import what respawned ranks will need
(``fork_server_warm``), is recovered at once: the respawn starts cold, it does not queue
behind the warm-up. (A stalled system: `test_system_restart`.)

Each test runs a script as a user would (a fresh interpreter, a real local mesh) and
injects the fault from outside with a signal.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from user_scripts import MESH_HELPERS, run_script

pytestmark = pytest.mark.timeout(180)


def test_a_rank_lost_while_the_fork_server_warms_is_recovered_at_once(tmp_path: Path) -> None:
    # The warm-up is made to last (a module that takes 60 s to import) so that the
    # recovery surely falls inside it; before, the respawn waited 5 s for the import.
    mark = tmp_path / "warming"
    (tmp_path / "slow_warm.py").write_text(
        f"import pathlib, time\npathlib.Path({str(mark)!r}).touch()\ntime.sleep(60)\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    lines, _ = run_script(
        MESH_HELPERS
        + f"""
    import pathlib
    mark = pathlib.Path({str(mark)!r})
    with local_mesh(1, 2) as mesh:
        with mesh.activate():
            before = pids_of(mesh)
            deadline = time.monotonic() + 30
            while not mark.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            print("WARMING", mark.exists())
            os.kill(before[1], signal.SIGKILL)
            e = until_failed(mesh)
            rec = mesh.recover(timeout_s=60)
            print("RECOVERED", rec.ranks, rec.seconds < 2.5, round(rec.seconds, 2))
            print("BACK", fetch(remote(pid)(), shard=1).result(timeout=60) != before[1])
    """,
        env={"PYTHONPATH": path, "PALATINE_FORK_SERVER_WARM": "slow_warm"},
    )
    assert lines["WARMING"] == "True"
    assert lines["RECOVERED"].startswith("[1] True "), lines["RECOVERED"]
    assert lines["BACK"] == "True"
