"""Job records: every running job leaves a small file by which operators find it.

A job (``local_mesh``, `LocalJob`, `SlurmJob`, ``palatine launch``) writes one record
while it runs, ``<id>.json`` in the per-user runtime directory (`runtime_dir`):
``$XDG_RUNTIME_DIR/palatine`` when that variable names an absolute directory, else
``palatine-<uid>`` in the temp dir. The record says where the job's system listens, which
file holds its cluster token (mode 0600), its log dir, the pid that keeps it (and that
process's start time, so a reused pid is not taken for it), when it started and its
shape. ``palatine ps`` lists the live ones; ``top``, ``stacks``, ``snapshot`` and
``stop`` reach one by ``--job ID|latest`` (`select`).

Who writes: the job's system (``palatine system``, which knows its address and token once
it serves) for local jobs, so a ``local_mesh`` is recorded without its client doing
anything; a `SlurmJob` writes its own (its id is Slurm's, known only after ``sbatch``)
and tells its system not to (`RECORD_ENV`). A record is removed when its job ends; one
whose process is gone (a SIGKILL, a lost machine) is ignored and removed by the next
reader (`live_jobs`).

Another user's jobs are neither listed nor reachable: the directory is made 0700 and
refused unless this user owns it with no group or other access, a record is read only
when this user owns it, and a token file is made 0600.

The struct and the choice of a job (`JobRecord`, `select`, `runtime_dir`) are sans-IO;
`RecordDir` does the file work.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final, TextIO

import msgspec

__all__ = [
    "RECORD_ENV",
    "SHAPE_ENV",
    "JobRecord",
    "JobSelectionError",
    "RecordDir",
    "announce",
    "announce_line",
    "describe_age",
    "job_id_of",
    "live_jobs",
    "runtime_dir",
    "select",
]

RECORD_ENV: Final = "PALATINE_JOB_RECORD"
"""Set to ``launcher`` in a system's environment when its launcher records the job
itself (`SlurmJob`): the system then writes no record of its own."""

SHAPE_ENV: Final = "PALATINE_JOB_SHAPE"
"""The job's shape as a launcher hands it to its system (``2x4``: hosts × procs per
host), for the record."""


class JobSelectionError(ValueError):
    """``--job`` names no live job, or several jobs run and none was named."""


class JobRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One running job, as ``<id>.json`` in the runtime directory."""

    id: str
    system_addr: str
    token_file: str
    log_dir: str
    pid: int  # the process that keeps the job: its system, or its launcher
    started: float  # wall time the job started (seconds since the epoch)
    shape: str = ""  # hosts x procs per host ("2x4"); "" where nobody said
    machine: str = ""  # hostname of the machine the pid runs on
    scheduler_job: str = ""  # Slurm's job id, for a Slurm job
    pid_started: float | None = None  # start time of ``pid`` (a reused pid is not it)

    def env(self) -> dict[str, str]:
        """The variables a client command needs to reach this job."""
        return {
            "PALATINE_SYSTEM_ADDR": self.system_addr,
            "PALATINE_CLUSTER_TOKEN_FILE": self.token_file,
        }


def runtime_dir(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """Where this user's job records live (see the module)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_RUNTIME_DIR", "")
    if base and os.path.isabs(base):
        return Path(base) / "palatine"
    return Path(tempfile.gettempdir()) / f"palatine-{os.getuid() if uid is None else uid}"


def select(jobs: list[JobRecord], wanted: str | None) -> JobRecord:
    """The job ``wanted`` names among the live ``jobs`` (oldest first): ``latest`` is
    the newest; an id matches a record's id, its Slurm job id, or else a unique prefix of
    an id; None means the only one. `JobSelectionError` otherwise, listing the ids."""
    ids = ", ".join(j.id for j in jobs)
    if wanted is None:
        if len(jobs) == 1:
            return jobs[0]
        if not jobs:
            raise JobSelectionError(
                "no live palatine job of this user on this machine (palatine ps lists "
                "them); name a system with --system-addr or PALATINE_SYSTEM_ADDR"
            )
        raise JobSelectionError(
            f"{len(jobs)} live jobs ({ids}): choose one with --job ID or --job latest"
        )
    if not jobs:
        raise JobSelectionError(
            f"no live palatine job of this user on this machine, so no --job {wanted}"
        )
    if wanted == "latest":
        return max(jobs, key=lambda j: j.started)
    exact = [j for j in jobs if wanted in (j.id, j.scheduler_job)]
    if len(exact) == 1:
        return exact[0]
    prefixed = [j for j in jobs if j.id.startswith(wanted)]
    if len(prefixed) == 1 and not exact:
        return prefixed[0]
    what = "several" if exact or prefixed else "no"
    raise JobSelectionError(f"--job {wanted} matches {what} live jobs (live: {ids})")


def job_id_of(environ: Mapping[str, str]) -> str:
    """The id a job's system records it under, from the system's environment: its
    execution id (``PALATINE_EXECUTION_ID``, which every role of a local job shares), else
    the job id its launcher hands it (``PALATINE_JOB_ID``), else ``""``."""
    from palatine.hosting.child_env import Handoff

    handed = Handoff.from_env(environ)
    return handed.execution_id or handed.job_id


def announce_line(job_id: str) -> str:
    """The one line a job's start says about it, on stderr."""
    return f"palatine: job {job_id} (palatine ps; palatine top --job {job_id})"


def announce(job_id: str | None, stream: TextIO | None = None) -> None:
    """Say ``job_id`` once, when the job starts, on ``stream`` (stderr) if it is a
    terminal: a person at one learns what ``--job`` takes, while a program's output
    captured in a pipe or a file stays its own."""
    stream = sys.stderr if stream is None else stream
    if job_id and stream.isatty():
        print(announce_line(job_id), file=stream, flush=True)


def describe_age(seconds: float) -> str:
    """``42 s``, ``3 min``, ``2.5 h``: how long a job has run, for ``palatine ps``."""
    if seconds < 120:
        return f"{max(0, seconds):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _process_started(pid: int) -> float | None:
    """When process ``pid`` started (None when it does not exist or cannot be seen)."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def _alive(rec: JobRecord) -> bool:
    started = _process_started(rec.pid)
    if started is None:
        return False
    # (create_time has a clock tick's resolution: a reused pid starts later than that)
    return rec.pid_started is None or abs(started - rec.pid_started) < 1.0


class RecordDir:
    """The runtime directory of this user's job records (`runtime_dir` by default)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = runtime_dir() if path is None else path

    def ensure(self) -> Path:
        """Make the directory (0700) if needed; `PermissionError` when it is not this
        user's alone (another user's, or open to group or others)."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(self.path)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(
                f"job records: {self.path} is not this user's alone (owner uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):04o}); it must be uid {os.getuid()}, mode 0700"
            )
        return self.path

    def _file(self, job_id: str, suffix: str) -> Path:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise ValueError(f"job id {job_id!r} cannot name a record file")
        return self.path / f"{job_id}{suffix}"

    def _write_private(self, path: Path, data: bytes) -> None:
        """``data`` into ``path`` atomically, mode 0600 whatever the umask."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def write_token(self, job_id: str, token: str) -> Path:
        """The job's token in ``<id>.token`` (0600), for a job whose token is in no file."""
        self.ensure()
        path = self._file(job_id, ".token")
        self._write_private(path, (token + "\n").encode())
        return path

    def write(self, rec: JobRecord) -> Path:
        """Write (or replace) ``rec``'s record; its path."""
        self.ensure()
        if rec.pid_started is None:
            rec = msgspec.structs.replace(rec, pid_started=_process_started(rec.pid))
        path = self._file(rec.id, ".json")
        self._write_private(path, msgspec.json.encode(rec))
        return path

    def exists(self, job_id: str) -> bool:
        """Whether a record of ``job_id`` is there (live or not)."""
        return self._file(job_id, ".json").exists()

    def remove(self, job_id: str) -> None:
        """Remove ``job_id``'s record and the token file made for it (if any)."""
        for suffix in (".json", ".token"):
            with contextlib.suppress(FileNotFoundError):
                self._file(job_id, suffix).unlink()

    def _records(self) -> Iterator[JobRecord]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            return  # not ours alone: nothing there is trusted
        uid = os.getuid()
        for path in sorted(self.path.glob("*.json")):
            try:
                if path.stat().st_uid != uid:
                    continue
                rec = msgspec.json.decode(path.read_bytes(), type=JobRecord)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                continue  # (a record half-gone, or not one: nothing to list)
            if path.stem != rec.id:
                continue
            yield rec

    def live(self) -> list[JobRecord]:
        """The live jobs' records, oldest first; stale ones (process gone) are removed."""
        out = []
        for rec in self._records():
            if _alive(rec):
                out.append(rec)
            else:
                self.remove(rec.id)
        return sorted(out, key=lambda r: r.started)

    @contextlib.contextmanager
    def recorded(self, rec: JobRecord) -> Iterator[JobRecord]:
        """``rec`` recorded for as long as the block runs."""
        self.write(rec)
        try:
            yield rec
        finally:
            self.remove(rec.id)


def live_jobs(path: Path | None = None) -> list[JobRecord]:
    """This user's live jobs on this machine, oldest first (`RecordDir.live`)."""
    return RecordDir(path).live()
