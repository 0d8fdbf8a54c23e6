"""Running a test's script as a user would: a fresh interpreter on a real mesh.

`run_script` runs the dedented body with this interpreter (the cluster token of the
test run is left out, so the script's mesh makes its own) and gives back its ``KEY
value`` lines and its stderr; a script that fails fails the test with its output.
`MESH_HELPERS` is a prelude of what scripts on a local mesh keep needing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_script(
    body: str, timeout_s: float = 200, env: dict[str, str] | None = None
) -> tuple[dict[str, str], str]:
    """Run ``body`` as a fresh script; its ``KEY value`` lines, and its stderr."""
    environ = {**os.environ, **(env or {})}
    environ.pop("PALATINE_CLUSTER_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=environ,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    return lines, out.stderr


MESH_HELPERS = """
    import os, signal, time
    from palatine import DeviceException, fetch, local_mesh, remote

    def pid():
        return os.getpid()

    def pids_of(mesh):
        return [fetch(remote(pid)(), shard=r).result(timeout=60) for r in range(len(mesh))]

    def until_failed(mesh, within=30):
        # a failure reaches the client in milliseconds; a fetch raises it
        t0 = time.monotonic()
        while time.monotonic() - t0 < within:
            try:
                fetch(remote(pid)(), shard=0).result(timeout=within)
            except DeviceException as e:
                return e
            time.sleep(0.01)
        raise AssertionError("no failure reported")
"""
