"""Who sends: the mailbox that code running here sends from.

Inside an actor's handler it is the actor's own mailbox (`palatine.core.actor.context`);
anywhere else in the process (a script, a thread) it is the process's client instance,
installed by whoever made this process a palatine proc (`this_host().spawn_procs`,
`System.attach`, a job). Meshes, refs and ports all send through `caller_mailbox`.
"""

from __future__ import annotations

import weakref
from typing import Any

from palatine.core.actor import Context, SupervisionEvent, _current_cx
from palatine.core.mailbox import Mailbox
from palatine.core.supervision_hook import unhandled_fault
from palatine.errors import PalatineError
from palatine.ids import PortId

__all__ = ["set_default_client", "default_client", "caller_mailbox", "caller_supervision_port"]

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


_client_ports: weakref.WeakKeyDictionary[Mailbox, PortId] = weakref.WeakKeyDictionary()


def caller_supervision_port(cx: Context | None) -> PortId:
    """Where the failures of a mesh spawned by ``cx`` (an actor's context, or None for
    this process's client) go: the actor's supervision (``__supervise__``), or the
    unhandled-fault hook (`palatine.set_unhandled_fault_hook`). Call on the loop."""
    if cx is not None:
        return cx.supervision_port()
    mb = caller_mailbox()
    port = _client_ports.get(mb)
    if port is None:
        port = _client_ports[mb] = mb.open_handler_port(
            SupervisionEvent.__palatine_type_id__,
            lambda event, _env: unhandled_fault(event.failure()),
            "SupervisionEvent",
        )
    return port
