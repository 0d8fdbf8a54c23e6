"""How the scheduler ended the job a client runs in, for the client's errors.

When Slurm ends a job under its program (``scancel``, its time limit, preemption, a lost
node), the client sees only the job's ranks go (``exited: left: stopped by signal``);
Slurm knows why. `slurm_ended` asks it (``scontrol``), bounded, and `slurm_job_of` says
which job a process runs in: the one ``palatine launch`` hands its program
(``PALATINE_JOB_ID``), else the allocation it runs inside (``SLURM_JOB_ID``). The
session asks when its first failure arrives (`palatine.tensor.client.session`), and
`palatine.job.slurm` asks the same of a job it submitted.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from typing import Final

from palatine.hosting.child_env import Handoff

__all__ = ["ENDED_BY_SLURM", "scheduler_output", "scontrol_field", "slurm_ended", "slurm_job_of"]

SCHEDULER_TIMEOUT_S: Final = 60.0  # one sbatch / squeue / scancel / scontrol call
SETTLE_S: Final = 5.0  # how long Slurm may take to say how it ended a job it is completing

#: How Slurm itself ends a job, by its state (`slurm_ended`)
ENDED_BY_SLURM: Final = {
    "CANCELLED": "was cancelled (scancel)",
    "TIMEOUT": "reached its time limit",
    "DEADLINE": "reached its deadline",
    "PREEMPTED": "was preempted",
    "NODE_FAIL": "lost a node (NODE_FAIL)",
    "BOOT_FAIL": "could not boot its nodes (BOOT_FAIL)",
    "OUT_OF_MEMORY": "ran out of memory",
}


def scheduler_output(argv: list[str], timeout_s: float = SCHEDULER_TIMEOUT_S) -> str | None:
    """One Slurm command's standard output; None when it fails or does not answer within
    ``timeout_s``."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def scontrol_field(
    kind: str, name: str, key: str, timeout_s: float = SCHEDULER_TIMEOUT_S
) -> str | None:
    """``key``'s value in ``scontrol show kind name`` (None if empty, unset or unknown)."""
    out = scheduler_output(["scontrol", "-o", "show", kind, name], timeout_s) or ""
    for word in out.split():
        if word.startswith(f"{key}="):
            value = word.split("=", 1)[1]
            return None if value in ("", "(null)") else value
    return None


def slurm_ended(
    job_id: str, wait_s: float = SETTLE_S, timeout_s: float = SCHEDULER_TIMEOUT_S
) -> str | None:
    """How Slurm itself ended job ``job_id``, in words (``Slurm job 7 was cancelled
    (scancel)``), once ``scontrol`` reports that state; None while the job runs, when it
    ended by itself, or when Slurm does not say within ``timeout_s`` in all. While Slurm
    is still stopping the job's processes it says only ``COMPLETING``: that is waited out
    for at most ``wait_s``."""
    start = time.monotonic()
    deadline = start + min(wait_s, timeout_s)
    while True:
        left = start + timeout_s - time.monotonic()
        state = scontrol_field("job", job_id, "JobState", left) if left > 0 else None
        if state in ENDED_BY_SLURM:
            return f"Slurm job {job_id} {ENDED_BY_SLURM[state]}"
        if state != "COMPLETING" or time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def slurm_job_of(environ: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job this process runs in: the one ``palatine launch`` handed it, else
    the allocation it runs inside; None when neither (a local job, or no scheduler)."""
    environ = os.environ if environ is None else environ
    for job in (Handoff.from_env(environ).job_id, environ.get("SLURM_JOB_ID", "")):
        job = job.strip()
        if job[:1].isdigit():  # (a Slurm id: 7, 7_3 of an array; "local" is no job of it)
            return job
    return None
