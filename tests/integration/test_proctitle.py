"""Each process of a job names itself (``palatine worker W[r]``, ``palatine host N``,
``palatine system``), as ``ps`` and ``top`` show it: read from ``/proc/<pid>/cmdline``
of the real processes of a local mesh."""

from __future__ import annotations

from pathlib import Path

import psutil

import palatine
from palatine.hosting.proctitle import comm_for, title_for


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_a_title_is_the_name_then_the_processes_options() -> None:
    assert title_for("palatine system", ["--system-addr", "unix:@x"]) == (
        "palatine system --system-addr unix:@x"
    )
    assert title_for("palatine worker w[3]", []) == "palatine worker w[3]"


def test_a_short_name_has_no_spaces_and_fits_the_kernels_15_characters() -> None:
    assert comm_for("palatine system") == "palatine-system"
    assert comm_for("palatine host 1") == "palatine-host-1"
    assert comm_for("palatine host 12") == "host-12"
    assert comm_for("palatine worker mesh0[3]") == "worker-mesh0[3]"
    assert comm_for("palatine worker worker[3]") == "worker[3]"
    assert comm_for("palatine worker averyveryverylongworld[1234]") == "longworld[1234]"


def test_system_host_and_workers_name_themselves_in_their_cmdline() -> None:
    with palatine.local_mesh(hosts=2, procs_per_host=2, startup_timeout_s=90) as mesh:
        addr = mesh.system_addr
        # this mesh's processes (an earlier test's may still be ending under this one)
        children = [
            p
            for p in psutil.Process().children(recursive=True)
            if str(addr) in cmdline(p.pid) or cmdline(p.pid).startswith("palatine worker")
        ]
        titles = [cmdline(p.pid) for p in children]
        for p in children:
            # /proc/<pid>/stat still reads word by word (as Slurm's process tracking reads
            # it): the short name has no space, and the parent is where it belongs
            stat = Path(f"/proc/{p.pid}/stat").read_text().split()
            assert stat[1].startswith("(") and stat[1].endswith(")"), stat[:4]
            assert int(stat[3]) == p.ppid()
            # the environment's memory is left alone (/proc/<pid>/environ)
            assert b"PALATINE_CLUSTER_TOKEN=" in Path(f"/proc/{p.pid}/environ").read_bytes()
    assert any(t.startswith(f"palatine system --system-addr {addr}") for t in titles), titles
    for h in (0, 1):
        assert any(t.startswith(f"palatine host {h} --system-addr {addr}") for t in titles), titles
    workers = sorted(t for t in titles if t.startswith("palatine worker"))
    assert workers == [f"palatine worker worker[{r}]" for r in range(4)], titles
