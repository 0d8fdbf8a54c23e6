"""Process titles: each palatine process names itself, so that ``ps``, ``top`` and
``nvidia-smi`` tell the ranks apart (``palatine worker mesh0[3]``, ``palatine host 1``,
``palatine system``).

The title replaces what ``/proc/<pid>/cmdline`` shows (through ``setproctitle``); the
arguments the process was started with follow the name, so that a search for a job's
address among the processes still finds them. Without ``setproctitle`` (a broken
install), nothing changes: a title is a convenience, never a reason to fail.

Importing this module readies ``setproctitle`` (`_ready`): it finds the memory it may
write the title into from the process's original arguments and environment, which a
fork server's child no longer has once its environment is replaced by the worker's. So
``palatine.cli.worker``, which fork servers import before they fork, imports this at
its top.
"""

from __future__ import annotations

import sys

__all__ = ["name_process", "title_for"]


def _ready() -> None:
    try:
        from setproctitle import getproctitle
    except ImportError:
        return
    getproctitle()  # (its first call takes the measure of the argument area)


_ready()


def title_for(name: str, argv: list[str]) -> str:
    """``name`` followed by ``argv``'s options (what came after the subcommand)."""
    rest = " ".join(argv)
    return f"{name} {rest}" if rest else name


def name_process(name: str, argv: list[str] | None = None) -> None:
    """Title this process ``name``, then ``argv`` (default: this process's arguments
    after ``palatine <subcommand>``)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title_for(name, sys.argv[2:] if argv is None else argv))
