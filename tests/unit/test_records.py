"""Job records (palatine.job.records): the choice of a job, and the runtime directory."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from palatine.job.records import (
    JobRecord,
    JobSelectionError,
    RecordDir,
    announce,
    job_id_of,
    runtime_dir,
    select,
)


def rec(job_id: str, started: float, pid: int | None = None, slurm: str = "") -> JobRecord:
    return JobRecord(id=job_id, system_addr=f"unix:@{job_id}", token_file="/t", log_dir="/l",
                     pid=os.getpid() if pid is None else pid, started=started,
                     scheduler_job=slurm)  # fmt: skip


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_without_a_job_named_the_only_live_job_is_chosen() -> None:
    assert select([rec("a", 1.0)], None).id == "a"


def test_without_a_job_named_several_live_jobs_are_an_error_listing_them() -> None:
    with pytest.raises(JobSelectionError, match=r"2 live jobs \(a, b\).*--job"):
        select([rec("a", 1.0), rec("b", 2.0)], None)


def test_no_live_job_is_an_error_that_says_how_to_name_a_system() -> None:
    with pytest.raises(JobSelectionError, match="PALATINE_SYSTEM_ADDR"):
        select([], None)
    with pytest.raises(JobSelectionError, match="no --job latest"):
        select([], "latest")


def test_latest_is_the_newest_job() -> None:
    assert select([rec("old", 1.0), rec("new", 5.0), rec("mid", 3.0)], "latest").id == "new"


def test_a_job_is_named_by_its_id_its_slurm_id_or_a_unique_prefix() -> None:
    jobs = [rec("alice-1-aa", 1.0), rec("alice-2-bb", 2.0, slurm="4711")]
    assert select(jobs, "alice-1-aa").id == "alice-1-aa"
    assert select(jobs, "4711").id == "alice-2-bb"
    assert select(jobs, "alice-2").id == "alice-2-bb"
    with pytest.raises(JobSelectionError, match="matches several"):
        select(jobs, "alice-")
    with pytest.raises(JobSelectionError, match="matches no"):
        select(jobs, "bob")


def test_the_runtime_dir_is_under_xdg_runtime_dir_else_per_uid_in_the_temp_dir() -> None:
    assert runtime_dir({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/palatine")
    fallback = runtime_dir({"XDG_RUNTIME_DIR": "relative"}, uid=7)
    assert fallback.name == "palatine-7"
    assert runtime_dir({}, uid=7) == fallback


def test_a_jobs_id_is_its_execution_id_else_the_job_id_handed_over() -> None:
    both = {"PALATINE_EXECUTION_ID": "exe", "PALATINE_JOB_ID": "job"}
    assert job_id_of(both) == "exe"
    assert job_id_of({"PALATINE_JOB_ID": "job"}) == "job"
    assert job_id_of({}) == ""


def test_a_record_and_its_token_are_private_and_go_when_removed(tmp_path: Path) -> None:
    d = RecordDir(tmp_path / "palatine")
    token = d.write_token("j1", "secret")
    path = d.write(rec("j1", time.time()))
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    for p in (path, token):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert token.read_text().strip() == "secret"
    assert [r.id for r in d.live()] == ["j1"]
    d.remove("j1")
    assert not path.exists() and not token.exists()
    assert d.live() == []


def test_a_record_whose_process_is_gone_is_ignored_and_removed(tmp_path: Path) -> None:
    d = RecordDir(tmp_path / "palatine")
    d.write(rec("live", 1.0))
    stale = d.write(rec("stale", 2.0, pid=dead_pid()))
    assert [r.id for r in d.live()] == ["live"]
    assert not stale.exists()


def test_a_record_of_a_reused_pid_is_stale(tmp_path: Path) -> None:
    d = RecordDir(tmp_path / "palatine")
    path = d.write(msgspec.structs.replace(rec("reused", 1.0), pid_started=1.0))
    assert d.live() == []
    assert not path.exists()


def test_a_directory_open_to_others_is_refused_and_lists_nothing(tmp_path: Path) -> None:
    d = RecordDir(tmp_path / "palatine")
    d.write(rec("j", 1.0))
    os.chmod(d.path, 0o755)
    assert d.live() == []
    with pytest.raises(PermissionError, match="mode 0755"):
        d.write(rec("k", 1.0))


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_another_users_record_is_not_listed(tmp_path: Path) -> None:
    d = RecordDir(tmp_path / "palatine")
    path = d.write(rec("theirs", 1.0))
    os.chown(path, 54321, 54321)
    assert d.live() == []


def test_a_record_that_is_no_record_is_skipped(tmp_path: Path) -> None:
    d = RecordDir(tmp_path / "palatine")
    d.ensure()
    (d.path / "junk.json").write_text("{not json")
    (d.path / "other.json").write_bytes(msgspec.json.encode(rec("mismatch", 1.0)))
    assert d.live() == []


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_job_id_is_announced_once_on_a_terminal_and_not_into_a_pipe() -> None:
    tty, pipe = _Tty(), io.StringIO()
    announce("alice-1", tty)
    announce("alice-1", pipe)
    assert tty.getvalue() == "palatine: job alice-1 (palatine ps; palatine top --job alice-1)\n"
    assert pipe.getvalue() == ""
