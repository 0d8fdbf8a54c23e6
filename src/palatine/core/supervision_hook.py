"""The unhandled-fault hook: where a root actor's failure goes when no coordinator exists.

A proc without a supervision coordinator (a bare proc) calls the hook set by
`set_unhandled_fault_hook`, and so does a client whose mesh's actor failed (with a
`palatine.errors.MeshFailure`); the default logs at ERROR. Role processes install a hook
that exits the process with status 1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["set_unhandled_fault_hook", "unhandled_fault"]

log = logging.getLogger(__name__)


def _default(event: Any) -> None:
    if isinstance(event, Exception):  # a `palatine.errors.MeshFailure`: it names everything
        log.error("unhandled actor failure: %s", event)
    else:
        log.error("unhandled actor failure: %s: %s", event.actor_id, event.message)


_hook: Callable[[Any], None] = _default


def set_unhandled_fault_hook(fn: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """Install ``fn(event)`` for root failures with no coordinator (None restores the
    default); returns the hook it replaces (to put back later)."""
    global _hook
    before = _hook
    _hook = fn if fn is not None else _default
    return before


def unhandled_fault(event: Any) -> None:
    _hook(event)
