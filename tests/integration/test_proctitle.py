"""Each process of a job names itself (``palatine worker W[r]``, ``palatine host N``,
``palatine system``), as ``ps`` and ``top`` show it: read from ``/proc/<pid>/cmdline``
of the real processes of a local mesh."""

from __future__ import annotations

from pathlib import Path

import psutil

import palatine
from palatine.hosting.proctitle import title_for


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_a_title_is_the_name_then_the_processes_options() -> None:
    assert title_for("palatine system", ["--system-addr", "unix:@x"]) == (
        "palatine system --system-addr unix:@x"
    )
    assert title_for("palatine worker w[3]", []) == "palatine worker w[3]"


def test_system_host_and_workers_name_themselves_in_their_cmdline() -> None:
    with palatine.local_mesh(hosts=2, procs_per_host=2, startup_timeout_s=90) as mesh:
        titles = [cmdline(p.pid) for p in psutil.Process().children(recursive=True)]
        addr = mesh.system_addr
    assert any(t.startswith(f"palatine system --system-addr {addr}") for t in titles), titles
    for h in (0, 1):
        assert any(t.startswith(f"palatine host {h} --system-addr {addr}") for t in titles), titles
    workers = sorted(t for t in titles if t.startswith("palatine worker"))
    assert workers == [f"palatine worker worker[{r}]" for r in range(4)], titles
