"""Process titles: each palatine process names itself, so that ``ps``, ``top`` and
``nvidia-smi`` tell the ranks apart (``palatine worker mesh0[3]``, ``palatine host 1``,
``palatine system``).

The title replaces what ``/proc/<pid>/cmdline`` shows (through ``setproctitle``); the
arguments the process was started with follow the name, so that a search for a job's
address among the processes still finds them. The short name (``/proc/<pid>/comm``, 15
characters, what ``top`` shows by default) is set too, without spaces (`comm_for`:
``palatine-host-1``, ``worker[3]``): tools that parse ``/proc/<pid>/stat`` word by word,
Slurm's process tracking among them, would otherwise misread the process's parent and
lose it from its job's tree, so that cancelling the job would not signal it. Without ``setproctitle`` (a broken
install), nothing changes: a title is a convenience, never a reason to fail.

Importing this module readies ``setproctitle`` (`_ready`): it finds the memory it may
write the title into from the process's original arguments and environment, which a
fork server's child no longer has once its environment is replaced by the worker's. So
``palatine.cli.worker``, which fork servers import before they fork, imports this at
its top.
"""

from __future__ import annotations

import os
import sys

__all__ = ["comm_for", "name_process", "title_for"]

_COMM_LEN = 15  # (the kernel's TASK_COMM_LEN, less its NUL)

_NOENV = "SPT_NOENV"  # setproctitle: leave the environment's memory alone


def _ready() -> None:
    try:
        # Only the argument area is written, never the environment's: /proc/<pid>/environ
        # stays what it was, for the tools that read a process's variables there (Slurm,
        # profilers looking for SLURM_JOB_ID). A title is then at most as long as the
        # command line was, which palatine's titles are not.
        saved = os.environ.get(_NOENV)
        os.environ[_NOENV] = "1"
        try:
            from setproctitle import getproctitle

            getproctitle()  # (its first call takes the measure of the argument area)
        finally:
            if saved is None:
                del os.environ[_NOENV]
            else:
                os.environ[_NOENV] = saved
    except ImportError:
        return


_ready()


def title_for(name: str, argv: list[str]) -> str:
    """``name`` followed by ``argv``'s options (what came after the subcommand)."""
    rest = " ".join(argv)
    return f"{name} {rest}" if rest else name


def comm_for(name: str) -> str:
    """The short name (no spaces, at most 15 characters) of a process titled ``name``:
    ``palatine system`` -> ``palatine-system``, ``palatine host 1`` -> ``palatine-host-1``,
    ``palatine worker mesh0[3]`` -> ``worker-mesh0[3]``, a longer one its id alone."""
    words = name.split()
    if words and words[0] == "palatine":
        words = words[1:]
    if not words:
        return "palatine"
    role, ident = words[0], "-".join(words[1:])
    tries = (
        [f"palatine-{role}-{ident}", f"{role}-{ident}", ident]
        if ident
        else [f"palatine-{role}", role]
    )
    return next((t for t in tries if len(t) <= _COMM_LEN), tries[-1][-_COMM_LEN:])


def name_process(name: str, argv: list[str] | None = None) -> None:
    """Title this process ``name``, then ``argv`` (default: this process's arguments
    after ``palatine <subcommand>``)."""
    try:
        from setproctitle import setproctitle, setthreadtitle
    except ImportError:
        return
    setproctitle(title_for(name, sys.argv[2:] if argv is None else argv))
    setthreadtitle(comm_for(name))  # (called on the main thread: the process's comm)
