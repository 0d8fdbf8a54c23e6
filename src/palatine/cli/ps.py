"""``palatine ps``: this user's live jobs on this machine.

    palatine ps [--json]

One line per job a running ``local_mesh``, `LocalJob`, `SlurmJob` or ``palatine launch``
recorded (`palatine.job.records`), oldest first: its id (what ``--job`` takes), the pid
that keeps it, how long it has run, its shape, its Slurm job id, the system's address and
its log dir. Records whose process is gone are removed on the way. Exit 0, with no jobs
too (then one line on stderr says so).
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON list of the job records")


def run(args: argparse.Namespace) -> int:
    import msgspec

    from palatine.job.records import describe_age, live_jobs

    jobs = live_jobs()
    if args.json:
        sys.stdout.write(msgspec.json.encode(jobs).decode() + "\n")
        return 0
    if not jobs:
        print("no live palatine jobs of this user on this machine", file=sys.stderr)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("job", "pid", "up", "shape", "slurm job", "system", "logs"):
        table.add_column(col, no_wrap=True)
    now = time.time()
    for j in jobs:
        table.add_row(j.id, str(j.pid), describe_age(now - j.started), j.shape or "-",
                      j.scheduler_job or "-", j.system_addr, j.log_dir or "-")  # fmt: skip
    # Not a terminal: as wide as the table is (a cell is never cut).
    console = Console() if sys.stdout.isatty() else Console(width=100_000)
    console.print(table)
    return 0
