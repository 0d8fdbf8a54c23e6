"""``palatine top``'s frame: resources from heartbeats for procs on any host, and rows
sorted by rank, CPU, RSS or loop lag."""

from __future__ import annotations

import io

from rich.console import Console

from palatine.cli.top import frame
from palatine.protocol.system import ProcEntry, SystemSnapshot, WorldSnapshot


def entry(pid: int, cpu: float, rss_mib: int, lag_ms: float, **res: float) -> ProcEntry:
    return ProcEntry(labels={}, addr="", pid=pid, host="elsewhere", health="Alive",
                     exit_code=None, exit_signal=None, failed_actors=[], loop_lag_s=lag_ms / 1e3,
                     resources={"cpu_percent": cpu, "rss_bytes": rss_mib * 2**20, **res})  # fmt: skip


def render(snap: SystemSnapshot, order: str) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=400).print(frame(snap, {}, order))
    return out.getvalue().splitlines()


def snapshot(**res: float) -> SystemSnapshot:
    procs = {
        "w[0]": entry(100, cpu=5, rss_mib=300, lag_ms=1, **res),
        "w[1]": entry(101, cpu=90, rss_mib=100, lag_ms=2, **res),
        "w[2]": entry(102, cpu=40, rss_mib=900, lag_ms=30, **res),
    }
    world = WorldSnapshot(status="Live", labels={}, host_procs=[], procs=procs)
    return SystemSnapshot(execution_id="x", worlds={"w": world})


def procs_in_order(lines: list[str]) -> list[str]:
    return [p for line in lines for p in ("w[0]", "w[1]", "w[2]") if f" {p} " in line]


def test_procs_on_another_host_show_the_cpu_and_rss_of_their_heartbeats() -> None:
    lines = render(snapshot(), "rank")
    row = next(line for line in lines if " w[1] " in line)
    assert "90%" in row and "100 MiB" in row and "elsewhere" in row


def test_rows_sort_by_rank_cpu_rss_or_lag() -> None:
    snap = snapshot()
    assert procs_in_order(render(snap, "rank")) == ["w[0]", "w[1]", "w[2]"]
    assert procs_in_order(render(snap, "cpu")) == ["w[1]", "w[2]", "w[0]"]
    assert procs_in_order(render(snap, "rss")) == ["w[2]", "w[0]", "w[1]"]
    assert procs_in_order(render(snap, "lag")) == ["w[2]", "w[1]", "w[0]"]
    assert "by cpu" in render(snap, "cpu")[0]


def test_gpu_columns_appear_only_where_a_proc_reports_a_gpu() -> None:
    assert not any("gpu mem" in line for line in render(snapshot(), "rank"))
    lines = render(snapshot(gpu_util_percent=75, gpu_mem_bytes=2 * 2**30), "rank")
    assert any("gpu mem" in line for line in lines)
    assert "75%" in next(line for line in lines if " w[0] " in line)
    assert "2048 MiB" in next(line for line in lines if " w[0] " in line)


def test_a_mesh_taller_than_the_terminal_scrolls_and_says_which_rows_it_shows() -> None:
    from palatine.cli.top import _scrolled

    snap = snapshot()
    out = io.StringIO()
    Console(file=out, width=400).print(frame(snap, {}, "rank", top=1, rows=1))
    lines = out.getvalue().splitlines()
    assert procs_in_order(lines) == ["w[1]"]
    assert any("procs 2-2 of 3" in line for line in lines)
    assert procs_in_order(render(snap, "rank")) == ["w[0]", "w[1]", "w[2]"]  # no rows: all
    assert _scrolled(0, 1, page=2, total=3) == 1
    assert _scrolled(1, 1, page=2, total=3) == 1  # not past the last page
    assert _scrolled(1, -1.0, page=2, total=3) == 0
    assert _scrolled(0, 1.0, page=2, total=5) == 2
    assert _scrolled(2, None, page=2, total=5) == 0
