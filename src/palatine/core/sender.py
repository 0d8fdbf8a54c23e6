"""Who sends: the mailbox that code running here sends from.

Inside an actor's handler it is the actor's own mailbox (`palatine.core.actor.context`);
anywhere else in the process (a script, a thread) it is the process's client instance,
installed by whoever made this process a palatine proc (`this_host().spawn_procs`,
`System.attach`, a job). Meshes, refs and ports all send through `caller_mailbox`.
"""

from __future__ import annotations

from typing import Any

from palatine.core.actor import _current_cx
from palatine.core.mailbox import Mailbox
from palatine.errors import PalatineError

__all__ = ["set_default_client", "default_client", "caller_mailbox"]

_default_client: Any = None


def set_default_client(client: Any) -> None:
    """Install the client instance that non-actor code in this process sends from."""
    global _default_client
    _default_client = client


def default_client() -> Any:
    """The installed client instance (None before one is)."""
    return _default_client


def caller_mailbox() -> Mailbox:
    """The sending mailbox: the running actor's, else this process's client instance."""
    cx = _current_cx.get()
    if cx is not None:
        return cx.mailbox
    if _default_client is None:
        raise PalatineError(
            "no palatine proc in this process: create one with this_host().spawn_procs(...) "
            "or System(addr).attach()"
        )
    mailbox: Mailbox = _default_client.mailbox
    return mailbox
