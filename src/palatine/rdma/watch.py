"""The owner's death as the system declares it, for transfers that the network alone
would only time out.

A reader's socket learns of a dead owner at once when the owner's kernel closes the
connection; an owner whose host vanished (a cut link, a powered-off machine) closes
nothing, and the transfer would wait for its timeout. The system declares such a proc
dead within its heartbeat bound and tells the procs that resolved it (``PeerGone``).
So the first transfer an actor's proc makes to an owner resolves the owner's proc once
(in the background) and watches it (`palatine.core.proc.Proc.watch`); a transfer under
way then fails as soon as the notice comes. One watch per owner per proc.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from palatine.core.proc import PeerGoneNotice, Proc
from palatine.errors import IdParseError
from palatine.ids import ProcId
from palatine.rdma.handle import BufferHandle

__all__ = ["caller_proc", "owner_watch", "matches"]

log = logging.getLogger(__name__)

_watches: dict[tuple[int, ProcId], asyncio.Future[PeerGoneNotice]] = {}
_resolving: set[asyncio.Task[Any]] = set()  # owned here until each ends


def caller_proc() -> Proc | None:
    """The proc of the running actor (None in a script: no watch there)."""
    try:
        from palatine.core.actor import context

        return Proc.of(context())
    except (RuntimeError, TypeError):
        return None


async def _resolve(proc: Proc, owner: ProcId) -> None:
    assert proc.resolver is not None
    try:
        await proc.resolver(owner)
    except Exception as e:  # noqa: BLE001 - only a watch is lost; the transfer decides
        log.debug("rdma: resolving the owner %s: %s", owner, e)


def owner_watch(proc: Proc, h: BufferHandle) -> asyncio.Future[PeerGoneNotice] | None:
    """A future completing when the system declares ``h``'s owner proc dead (on the loop)."""
    try:
        owner = ProcId.parse(h.owner.proc)
    except IdParseError:
        return None  # a client's buffer: no proc the system knows
    key = (id(proc), owner)
    fut = _watches.get(key)
    if fut is None or (fut.done() and not matches(fut.result(), h)):
        fut = _watches[key] = proc.watch(owner)
        if not fut.done() and proc.resolver is not None:
            task = proc.loop.create_task(_resolve(proc, owner))
            _resolving.add(task)
            task.add_done_callback(_resolving.discard)
    return fut


def matches(notice: PeerGoneNotice, h: BufferHandle) -> bool:
    """Whether ``notice`` is about the incarnation of the owner that holds ``h``."""
    return notice.pid is None or notice.pid == h.owner.pid
