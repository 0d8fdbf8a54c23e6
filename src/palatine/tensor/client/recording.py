"""What a recorded call issued (`palatine.compile`'s first repeatable call).

`Session.issue` hands each seq's commands to the active `Recorder` while the call runs on
the recording thread. Sans-IO: it keeps the commands by slice and the refs they define
and use, notes the defined refs the client drops (temporaries a replay frees again), and
the first reason the call cannot be replayed.
"""

from __future__ import annotations

import threading
from typing import Any

from palatine.protocol.worker import (
    BackendNetworkInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallFunction,
    CreateProcessGroup,
    RecordedCommand,
    Reduce,
    RequestStatus,
    SendTensor,
    SendValue,
    Slice,
)
from palatine.tensor.client.drops import Drops
from palatine.tensor.client.sites import capture_site
from palatine.wire.codec import Message

__all__ = ["RECORDABLE", "Recorder"]

#: The commands a recording holds (`RecordedCommand`), for isinstance.
RECORDABLE: tuple[type[Any], ...] = (
    CallFunction,
    Reduce,
    SendTensor,
    BorrowCreate,
    BorrowFirstUse,
    BorrowLastUse,
    BorrowDrop,
)


class Recorder:
    """What one recorded call issued: its commands by slice, and the refs they define
    and use (on the recording thread only: another thread's work is not the call's)."""

    def __init__(self, drops: Drops, start_ref: int) -> None:
        self._drops = drops
        self.thread = threading.get_ident()
        #: Refs below this existed before the call (captured tensors or arguments).
        self.start_ref = start_ref
        self.commands: list[tuple[Slice, RecordedCommand]] = []
        #: Refs the recorded commands define (results and what they write).
        self.defs: set[int] = set()
        #: Refs they use that existed before the call.
        self.uses: set[int] = set()
        #: Why this call cannot be replayed: the first reason, with where it was issued.
        self.refusal: str | None = None
        #: Refs it defined that the client has dropped since (`Drops.watch`).
        self.dead: set[int] = set()

    def capture(self, label: str, defs: list[int], uses: list[int], cmds: Any) -> None:
        """One seq of the recorded call (`Session.issue`, its lock held)."""
        for sl, cmd in cmds:
            if type(cmd) is RequestStatus:
                continue  # the session's own bookkeeping, not the call's
            if isinstance(cmd, RECORDABLE):
                self.commands.append((sl, cmd))
            else:
                self.refuse(_why(label, cmd))
        self.defs.update(defs)
        self._drops.watch(defs, self.dead)
        self.uses.update(u for u in uses if u < self.start_ref)

    def refuse(self, why: str) -> None:
        """Mark the call as not replayable (the first reason is kept)."""
        if self.refusal is None:
            self.refusal = why


def _why(label: str, cmd: Message) -> str:
    site = capture_site()
    where = f" (at {site.short()})" if site is not None else ""
    if type(cmd) is SendValue:
        return f"fetches a value ({label}){where}: a replay would not bring it back"
    if type(cmd) is BackendNetworkInit or type(cmd) is CreateProcessGroup:
        return (
            f"sets up collectives ({label}){where}: let a plain call do that first "
            "(compile's warmup)"
        )
    return f"issues {type(cmd).__name__} ({label}){where}, which a recording cannot hold"
