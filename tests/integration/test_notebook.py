"""palatine in a Jupyter kernel: a notebook built here runs in a fresh kernel of this
Python (nbclient), cell by cell, as a person would run it.

The cells cover the quickstart (`local_mesh`, `remote`/`fetch`), workers that print (their
lines in the cell that made them print), an actor mesh (`this_host().spawn_procs`), a
top-level ``await`` of an endpoint call, and a killed worker (the next fetch raises a
`DeviceException` naming the rank); ``palatine ps`` lists the kernel's mesh. The
kernel spec is written to a temporary prefix, so nothing outside the test's own
directory is touched.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402 - after the skips
from jupyter_client.manager import KernelManager  # noqa: E402

pytestmark = pytest.mark.timeout(240)

KERNEL = "palatine-test"

QUICKSTART = """\
import os, signal
from palatine import DeviceException, fetch, inspect, local_mesh, remote

def scale(rank, k):
    return rank * k

mesh = local_mesh(hosts=1, procs_per_host=4, startup_timeout_s=90)
with mesh.activate():
    r = mesh.rank("proc")
    print("scaled", fetch(remote(scale)(r, 10), shard={"host": 0, "proc": 2}).result(timeout=60))
"""

PRINTING = """\
def shout(rank):
    print(f"hello from rank {int(rank)}", flush=True)

with mesh.activate():
    remote(shout)(r)
    pids = [inspect(remote(os.getpid)(), shard={"host": 0, "proc": p}) for p in range(4)]
print("pids", len(pids))
"""

ACTORS = """\
from palatine import Actor, endpoint, this_host

class Counter(Actor):
    def __init__(self, start: int = 0):
        self.n = start

    @endpoint
    async def incr(self, by: int = 1) -> int:
        self.n += by
        print(f"counter at {self.n}", flush=True)
        return self.n

procs = this_host().spawn_procs(per_host={"procs": 2})
counters = procs.spawn("counter", Counter, 0)
print("first", list(counters.incr.call(1).get(timeout=60).values()))
print("second", list(counters.incr.call(1).get(timeout=60).values()))
"""

AWAIT = """\
values = await counters.incr.call(5)
print("awaited", list(values.values()))
procs.stop().get(timeout=60)
"""

KILLED = """\
os.kill(pids[2], signal.SIGKILL)
try:
    with mesh.activate():
        fetch(remote(os.getpid)(), shard={"host": 0, "proc": 2}).result(timeout=30)
    print("no exception")
except DeviceException as e:
    print(f"caught DeviceException rank={e.rank} signal={e.exit_signal}: {e}")
"""

LISTED = """\
import subprocess, sys
ps = subprocess.run([sys.executable, "-m", "palatine", "ps"], capture_output=True, text=True, timeout=60)
print("listed", mesh.job_id is not None and mesh.job_id in ps.stdout)
"""

SHUTDOWN = """\
mesh.shutdown()
print("shut down")
"""


@pytest.fixture
def kernel_manager(tmp_path: Path) -> KernelManager:
    """A manager of a kernel running this Python, from a spec in a temporary prefix."""
    prefix = tmp_path / "jupyter"
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", KERNEL],
        check=True,
        capture_output=True,
        timeout=60,
    )
    specs = KernelSpecManager(kernel_dirs=[str(prefix / "share" / "jupyter" / "kernels")])
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)


def text_of(cell: Any, stream: str) -> str:
    """What a cell wrote to ``stream`` (stdout or stderr), all of it."""
    return "".join(
        o.get("text", "")
        for o in cell.outputs
        if o.get("output_type") == "stream" and o.get("name") == stream
    )


def test_a_notebook_drives_meshes_actors_and_sees_worker_output_and_failures(
    tmp_path: Path, kernel_manager: KernelManager
) -> None:
    sources = [QUICKSTART, PRINTING, LISTED, ACTORS, AWAIT, KILLED, SHUTDOWN]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    client = nbclient.NotebookClient(
        nb,
        km=kernel_manager,
        timeout=120,
        startup_timeout=60,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # a cell that raises fails here, with its traceback
    quickstart, printing, listed, actors, awaited, killed, shutdown = nb.cells

    assert "scaled tensor(20)" in text_of(quickstart, "stdout")

    # Each rank's line, behind its world and rank, in the cell whose call printed it.
    out = text_of(printing, "stderr")
    for rank in range(4):
        assert re.search(rf"\[\S+ [\d,-]*\b{rank}\b[\d,-]*\] hello from rank {rank}\n", out), out
    assert "pids 4" in text_of(printing, "stdout")

    assert "listed True" in text_of(listed, "stdout")  # palatine ps names the job

    assert "first [1, 1]" in text_of(actors, "stdout")
    assert "second [2, 2]" in text_of(actors, "stdout")
    assert "counter at 1" in text_of(actors, "stderr")

    assert "awaited [7, 7]" in text_of(awaited, "stdout")

    caught = text_of(killed, "stdout")
    assert "caught DeviceException rank=2 signal=9" in caught, caught
    assert "SIGKILL" in caught and "worker[2]" in caught

    assert "shut down" in text_of(shutdown, "stdout")
