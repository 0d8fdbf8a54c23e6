"""The end of a session: drain, stop the workers, detach, stop the worlds.

`DeviceMesh.shutdown` (and leaving a mesh's ``with`` block) ends its session here. A
healthy session waits for what it issued, then tells every worker to exit; every session
then detaches from its controller and asks the system to stop the worker and controller
worlds, and a local mesh's own processes (`LocalRoles`) are stopped last.

A session the program never shut down (``mesh = palatine.connect()`` without ``with``)
ends the same way when the interpreter exits (`shutdown_at_exit`): a script that simply
ends is a clean end, as quiet and as quick as leaving the ``with`` block, not a client
the controller has to find lost. `stop_worlds` is the one way to stop a job's worlds
and wait until they are gone, for a session and for ``palatine launch`` alike.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import weakref
from typing import TYPE_CHECKING, Protocol

from palatine.core import runtime
from palatine.core.proc import StopActor
from palatine.fastpath.blocking import LinkLost
from palatine.ids import WorldId
from palatine.protocol.worker import Exit, RequestStatus, Slice
from palatine.tensor.client.session import Session

if TYPE_CHECKING:
    from palatine.system.service import SystemClient

__all__ = ["LocalRoles", "shutdown_at_exit", "shutdown_session", "stop_worlds"]

log = logging.getLogger("palatine")


class LocalRoles(Protocol):
    """The processes a mesh's program started, which the end of its session stops: a
    local mesh's system, hosts and controller (`palatine.tensor.client.local.LocalCluster`),
    or the controller of a tensor engine on an actor proc mesh (`palatine.job.engine`),
    whose system and worker procs belong to the proc mesh (``owns_worlds`` False: the
    session stops only the controller's world)."""

    owns_worlds: bool

    def stop(self, grace_s: float = 5.0, *, clean: bool = True) -> None:
        """Stop every role; keep the logs unless ``clean``."""


def shutdown_session(
    session: Session, local: LocalRoles | None, timeout: float, error: BaseException | None = None
) -> None:
    """Drain, Exit, Detach, stop the worlds (and a local mesh's processes).

    Leaving on an interrupt (``error`` a KeyboardInterrupt or SystemExit) drains nothing
    and waits less: the user asked to stop now, so everything is torn down within about
    two seconds whatever is still running."""
    if session.closed:
        return
    interrupted = error is not None and not isinstance(error, Exception)
    kind = getattr(session.failure, "kind", None)
    # The system is gone, or the scheduler ended the job (its launcher stops what is
    # left): there is nobody to ask to stop the worlds.
    system_gone = kind == "system_lost" or getattr(session.failure, "ended_by", None) is not None
    healthy = session.failure is None and not interrupted
    # Interrupted, or with no system or controller to leave: nothing stops gracefully
    # (what is left of the job is stopped, not drained), so no long waits.
    stop_s, gone_s = (
        (0.5, 0.5) if interrupted or system_gone or kind == "controller_lost" else (5.0, 10.0)
    )
    whole = Slice(offset=0, sizes=[session.world_size], strides=[1])
    try:
        if healthy:
            session.outbox.flush_drops()
            with session.lock:
                pending = session.results.pending
                last = max(pending) if pending else None
            if last is not None:
                session.send_commands([(whole, RequestStatus(seq=last, controller=False))])
                left = session.wait_drained(timeout)
                if left:
                    log.warning(
                        "shutdown: %d operations still pending after %g s; stopping anyway",
                        left,
                        timeout,
                    )
            session.send_commands([(whole, Exit(error=str(error) if error is not None else None))])
        session.detach()
        client = session.system_client
        client.client.quiet_returns = True

        async def end_worlds() -> None:
            worlds = [session.worker_world, session.controller.proc.world.name]
            if local is not None and not local.owns_worlds:
                worlds = worlds[1:]
            direct = session.direct
            if direct is not None:  # Detach and all before it are written: let it go
                try:
                    await direct.aclose(2.0)
                except LinkLost as e:
                    log.warning("shutdown: %s", e.reason)
            if system_gone:  # nobody is left to ask: the hosts stop their procs themselves
                try:
                    async with asyncio.timeout(stop_s):
                        await client.close()
                except Exception as e:  # noqa: BLE001 - the system is gone: nothing to close
                    log.debug("closing the system client: %s", e)
                return
            if local is not None and not local.owns_worlds:
                await _stop_workers(session, client, stop_s)
            await stop_worlds(client, worlds, stop_s, gone_s)
            if local is not None and local.owns_worlds:  # the local system: stopped below
                try:
                    async with asyncio.timeout(min(2.0, stop_s) + 1.0):
                        await client.stop(None, min(2.0, stop_s))
                except Exception as e:  # noqa: BLE001 - local.stop ends the system either way
                    log.debug("stopping the local system: %s", e)
            try:
                async with asyncio.timeout(stop_s):  # (a system stopped meanwhile answers nothing)
                    await client.close()
            except Exception as e:  # noqa: BLE001 - a system that stopped has closed the link
                log.debug("closing the system client: %s", e)

        try:
            runtime.submit(end_worlds).get(30)
        except Exception as e:  # noqa: BLE001 - best effort: the session ends either way
            log.debug("shutdown: %s", e)
    finally:
        session.closed = True
        session.results.shutdown()
        session.results.warn_unfetched()
        if local is not None:
            local.stop(stop_s, clean=healthy and error is None)


async def stop_worlds(
    client: SystemClient, worlds: list[str], stop_s: float, gone_s: float
) -> bool:
    """Ask the system to stop ``worlds`` (each proc given ``stop_s``) and wait, at most
    ``gone_s``, until none of their procs is left; whether they are gone. Best effort: a
    system that does not answer within ``stop_s`` + 1 s (it acknowledges at once) is
    logged at DEBUG (the caller stops what is left)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(stop_s + 1.0):
            await client.stop(worlds, stop_s)
        end = loop.time() + gone_s
        while loop.time() < end:
            snap = await client.snapshot(worlds=worlds)
            if not any(w in snap.worlds and snap.worlds[w].procs for w in worlds):
                return True
            await asyncio.sleep(0.05)
    except TimeoutError:
        log.debug("stopping worlds %s: no answer within %g s", worlds, stop_s + 1.0)
    except Exception as e:  # noqa: BLE001 - best effort: the caller stops what is left
        log.debug("stopping worlds %s: %s", worlds, e)
    return False


# The sessions `shutdown_at_exit` ends at interpreter exit, if their program did not.
_open_at_exit: weakref.WeakKeyDictionary[Session, LocalRoles | None] = weakref.WeakKeyDictionary()
_registered = False


def shutdown_at_exit(session: Session, local: LocalRoles | None) -> None:
    """End ``session`` (and stop ``local``) when the interpreter exits, unless the
    program shut it down first. Registered after the palatine loop started, so it runs
    before the loop stops (``atexit`` runs newest first). An uncaught exception that
    ends the script is its error, as leaving a ``with`` block on it would be."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_shutdown_open_sessions)
    _open_at_exit[session] = local


def _shutdown_open_sessions() -> None:
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    for session, local in list(_open_at_exit.items()):
        if not session.closed:
            try:
                shutdown_session(session, local, 30.0, error)
            except Exception as e:  # noqa: BLE001 - at exit: nothing left to report to
                log.debug("shutdown at exit: %s", e)
    _open_at_exit.clear()


async def _stop_workers(session: Session, client: SystemClient, stop_s: float) -> None:
    """A tensor engine's workers live in procs its session does not own (an actor proc
    mesh's): stop the worker actors there, so that their tensors are freed. Bounded by
    ``stop_s``."""
    msg = StopActor(name=session.worker_name, timeout_s=stop_s, reason="its tensor engine ended")
    world = WorldId(session.worker_world)
    replies = await asyncio.gather(
        *(
            client.mailbox.ask(world.proc(r).actor("proc"), msg, stop_s + 1.0)
            for r in range(session.world_size)
        ),
        return_exceptions=True,
    )
    for r, reply in enumerate(replies):
        if isinstance(reply, BaseException):
            log.debug("stopping %s on %s: %s", session.worker_name, world.proc(r), reply)
