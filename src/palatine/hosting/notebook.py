"""Workers' output in the notebook cell that made it.

In a Jupyter kernel, text written to ``sys.stderr`` lands in the cell that runs when it
is written. Workers' lines reach the client a little after the call that printed them
(through their host), and the client's `OutputSink` holds each line up to its
aggregation window (half a second) waiting for the same line from other ranks; a short
cell has ended by then, and its workers' output would show up under whatever cell runs
next. So, under IPython, every cell's end (IPython's ``post_run_cell`` event) writes out
what the process's sinks hold and waits, bounded, until it is on the console: the lines
that arrived while the cell ran stay with it.

Outside IPython nothing is registered and nothing changes.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any, Protocol

__all__ = ["CellFlushable", "flush_each_cell", "flush_cells_now", "CELL_FLUSH_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: How long a cell's end waits at most for its output to be written (per sink).
CELL_FLUSH_TIMEOUT_S = 1.0


class CellFlushable(Protocol):
    """Something holding output for the console (an `OutputSink`)."""

    def flush_cell(self, timeout_s: float) -> None:
        """Write what is held now and wait (at most ``timeout_s``) until it is written;
        callable from any thread but the one that runs the holder's loop."""


_lock = threading.Lock()
_flushables: weakref.WeakSet[Any] = weakref.WeakSet()
_registered: object | None = None  # the IPython shell our hook is registered with


def _shell() -> Any:
    """The running IPython shell, or None (IPython not imported, or no shell)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except Exception:  # noqa: BLE001 - a broken IPython is no shell to us
        return None


def flush_each_cell(holder: CellFlushable) -> None:
    """Flush ``holder`` at the end of every cell, if this process runs an IPython shell.

    The hook is registered once per shell and holds ``holder`` weakly: a holder that is
    gone is forgotten."""
    global _registered
    shell = _shell()
    if shell is None:
        return
    with _lock:
        _flushables.add(holder)
        if _registered is shell:
            return
        _registered = shell
    shell.events.register("post_run_cell", _after_cell)


def flush_cells_now(timeout_s: float = CELL_FLUSH_TIMEOUT_S) -> None:
    """Write what every registered holder holds (what a cell's end does)."""
    with _lock:
        holders = list(_flushables)
    for holder in holders:
        try:
            holder.flush_cell(timeout_s)
        except Exception as e:  # noqa: BLE001 - a cell's end must not fail for its output
            log.debug("output at a cell's end not flushed: %s", e)


def _after_cell(*_result: Any) -> None:
    flush_cells_now()
