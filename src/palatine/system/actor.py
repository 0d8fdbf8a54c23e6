"""The SystemActor ``system[0].root[0]``: the asyncio shell around `SystemRegistry`.

It decodes requests, calls the registry, sends the reply first and then executes the
returned instructions in order (`palatine.system.instructions`): sends, asks whose
outcomes feed back, liveness probes, timers, router (un)binds, logs and the final stop.
It also runs the periodic health tick and feeds the mailbox server's
"connection lost" signal and its own returned messages to the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, assert_never

from palatine import config
from palatine.channel.addr import ChannelAddr
from palatine.core.actor import Actor, handler
from palatine.core.proc import Proc
from palatine.ids import ActorId, ProcId
from palatine.protocol.system import (
    Join,
    Leave,
    ProcExited,
    Rejected,
    Resolve,
    RespawnProcs,
    Snapshot,
    Stimuli,
    Stop,
    Subscribe,
    SupervisionUpdate,
    Unsubscribe,
    UpsertWorld,
    WorldState,
)
from palatine.system.instructions import (
    Ask,
    Bind,
    Instruction,
    JoinProbeNeeded,
    Log,
    Probe,
    ProbeOutcome,
    Send,
    StopSystem,
    Timer,
    Unbind,
)
from palatine.system.registry import SystemRegistry
from palatine.wire.envelope import Envelope

__all__ = ["SystemActor", "probe_addr"]

log = logging.getLogger("palatine.system")

_REFUSAL_FLUSH_S = 2.0  # how long a refused joiner's one-off Tx may take to deliver the refusal


async def probe_addr(a: ChannelAddr, timeout_s: float) -> ProbeOutcome:
    """Try to connect to ``a``: ``connected``, ``refused`` or ``timeout`` (nothing sent)."""
    if a.transport == "local":
        from palatine.channel import local

        return "connected" if a.port in local._served else "refused"
    loop = asyncio.get_running_loop()
    sock = socket.socket(
        a.family if a.family != socket.AF_UNSPEC else socket.AF_INET, socket.SOCK_STREAM
    )
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout_s):
            await loop.sock_connect(sock, a.sockaddr())
        return "connected"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        if e.errno in (errno.ETIMEDOUT,):
            return "timeout"
        return "refused"
    finally:
        sock.close()


async def _close_after_reply(tx: Any) -> None:
    """Close a refused joiner's one-off Tx once its reply is acknowledged (or at once,
    if the system stops first)."""
    try:
        await tx.close(_REFUSAL_FLUSH_S)
    except asyncio.CancelledError:
        await tx.close(0)
        raise


class SystemActor(Actor):
    """The registry of worlds and procs, their supervision, eviction and stop."""

    __palatine_name__ = "palatine.system.SystemActor"

    def __init__(self, registry: SystemRegistry) -> None:
        self.reg = registry
        self.done: asyncio.Future[str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: list[asyncio.TimerHandle] = []
        self._tick: asyncio.Task[None] | None = None

    async def init(self) -> None:
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        Proc.of(self.cx).on_peer_lost = self._peers_lost
        self._tick = loop.create_task(self._health_ticks())

    async def _health_ticks(self) -> None:
        while True:
            await asyncio.sleep(self.reg.health_tick_interval_s)
            self._run(self.reg.handle_health_tick())

    def _peers_lost(self, procs: set[ProcId]) -> None:
        for p in procs:
            self._run(self.reg.handle_connection_lost(p))

    # ------------------------------------------------------------ requests
    def _request(self, msg: Any) -> None:
        env = self.cx.env
        assert env is not None
        result = self.reg.handle(msg, requester=env.sender.proc)
        self._answer(env, msg, result)

    def _answer(self, env: Envelope, msg: Any, result: tuple[Any, list[Instruction]]) -> None:
        reply, out = result
        # Routes first: the reply to a Join must be able to reach the joining proc.
        binds = [i for i in out if type(i) is Bind]
        if binds:
            self._execute(binds)
            out = [i for i in out if type(i) is not Bind]
        if isinstance(reply, JoinProbeNeeded):
            self._spawn(self._probe_then_join(env, msg, reply.probe))
        elif type(reply) is Rejected and type(msg) is Join and env.reply_to is not None:
            self._refuse_joiner(env, msg, reply, self.reg.join_addr)
        elif reply is not None and env.reply_to is not None:
            self.cx.reply(env.reply_to, reply, env)
        self._execute(out)

    def _refuse_joiner(
        self, env: Envelope, msg: Join, reply: Rejected, addr: ChannelAddr | None
    ) -> None:
        """A refused Join has no route back: its proc was not recorded, or its id is
        another (live) proc's. Reach the joiner once at the address it gave (``addr``, as
        the registry parsed it; None: none that can be dialed), so it hears why at once
        instead of waiting out its join timeout."""
        assert env.reply_to is not None
        reply_to = env.reply_to
        if addr is None:
            self.cx.reply(reply_to, reply, env)  # (routed as usual, if at all)
            return
        self._post_at(
            reply_to.actor,
            addr,
            lambda: self.cx.reply(reply_to, reply, env),
            f"tell {msg.proc_id} that its join was refused",
        )

    def _send_at(self, ins: Send, addr: ChannelAddr) -> None:
        """`Send` delivered at ``addr`` alone, whatever its proc is bound to now."""
        mb = self.cx.mailbox
        env = mb.envelope(ins.dest, ins.message)
        proc = Proc.of(self.cx)
        actor = ins.dest if isinstance(ins.dest, ActorId) else ins.dest.actor
        what = f"send {type(ins.message).__name__} to {actor}"
        self._post_at(actor, addr, lambda: proc.post(env), what)

    def _post_at(
        self, actor: ActorId, addr: ChannelAddr, post: Callable[[], None], what: str
    ) -> None:
        """Run ``post`` (which posts one message to ``actor``) with ``actor`` bound to
        ``addr`` for that one message, whatever the routing table says of it otherwise:
        posting picks its Tx at once, so the binding is restored right after. A Tx opened
        for that message alone is closed once it is flushed."""
        router = Proc.of(self.cx).router
        before, dynamic = router.binding(actor), router.is_dynamic(actor)
        had_tx = router.tx_at(addr) is not None
        router.bind(actor, addr)
        try:
            post()
        except Exception as e:  # noqa: BLE001 - the address could not be dialed: nobody hears it
            log.warning("cannot %s at %s: %s", what, addr, e)
        finally:
            if before is None:
                router.unbind(actor)
            else:
                router.bind(actor, before, dynamic=dynamic)
            if not had_tx and not router.serves(addr):  # a Tx opened for this message alone
                tx = router.drop_tx(addr)
                if tx is not None:
                    self._spawn(_close_after_reply(tx))

    async def _probe_then_join(self, env: Envelope, msg: Join, probe: Probe) -> None:
        outcome = await probe_addr(probe.addr, probe.timeout_s)
        self._answer(env, msg, self.reg.complete_join(msg, probe, outcome))

    @handler
    def on_join(self, msg: Join) -> None:
        self._request(msg)

    @handler
    def on_leave(self, msg: Leave) -> None:
        self._request(msg)

    @handler
    def on_upsert_world(self, msg: UpsertWorld) -> None:
        self._request(msg)

    @handler
    def on_respawn_procs(self, msg: RespawnProcs) -> None:
        self._request(msg)

    @handler
    def on_snapshot(self, msg: Snapshot) -> None:
        self._request(msg)

    @handler
    def on_stimuli(self, msg: Stimuli) -> None:
        self._request(msg)

    @handler
    def on_stop_request(self, msg: Stop) -> None:
        self._request(msg)

    @handler
    def on_supervision_update(self, msg: SupervisionUpdate) -> None:
        env = self.cx.env
        assert env is not None
        self._answer(env, msg, self.reg.handle(msg, arrived_at=self.reg._clock()))

    @handler
    def on_world_state(self, msg: WorldState) -> None:
        self._request(msg)

    @handler
    def on_resolve(self, msg: Resolve) -> None:
        self._request(msg)

    @handler
    def on_proc_exited(self, msg: ProcExited) -> None:
        self._request(msg)

    @handler
    def on_subscribe(self, msg: Subscribe) -> None:
        self._request(msg)

    @handler
    def on_unsubscribe(self, msg: Unsubscribe) -> None:
        self._request(msg)

    def handle_undeliverable(self, returned: Envelope) -> None:
        """A message we sent came back: the destination may be gone (never fails us)."""
        dest: Any = returned.dest
        if returned.dest.port < 1 << 63:
            dest = returned.dest  # a subscriber port
        else:
            dest = returned.dest.actor
        at: ChannelAddr | None = None
        text = returned.returned_at()
        if text is not None:
            with contextlib.suppress(ValueError):
                at = ChannelAddr.parse(text)
        self._run(self.reg.handle_returned(dest, returned.errors or (), returned_at=at))

    # ------------------------------------------------------------ instructions
    def _run(self, result: tuple[Any, list[Instruction]]) -> None:
        self._execute(result[1])

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("system task failed: %r", task.exception())

    def _fire(self, token: Any) -> None:
        """A registry timer is due."""
        self._run(self.reg.handle_timer(token))

    def _execute(self, out: Sequence[Instruction]) -> None:
        mb = self.cx.mailbox
        for ins in out:
            match ins:  # the most frequent first; every member of Instruction has a case
                case Send():
                    if ins.addr is None:
                        mb.tell(ins.dest, ins.message)
                    else:
                        self._send_at(ins, ins.addr)
                case Log():
                    if log.isEnabledFor(logging.DEBUG):
                        log.log(ins.level, "[%s] %s", ins.stimulus_id, ins.text)
                    else:
                        log.log(ins.level, "%s", ins.text)
                case Timer():
                    loop = asyncio.get_running_loop()
                    self._timers.append(loop.call_later(ins.delay_s, self._fire, ins.token))
                case Ask():
                    self._spawn(self._ask(ins))
                case Probe():
                    self._spawn(self._probe(ins))
                case Bind():
                    Proc.of(self.cx).router.bind(ins.proc_id, ins.addr)
                case Unbind():
                    Proc.of(self.cx).router.unbind(ins.target)
                case StopSystem():
                    log.info("system stopping: %s", ins.reason)
                    if self.done is not None and not self.done.done():
                        self.done.set_result(ins.reason)
                case _:
                    assert_never(ins)

    async def _ask(self, ask: Ask) -> None:
        try:
            reply = await self.cx.mailbox.ask(ask.dest, ask.message, ask.timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure is fed back
            self._run(self.reg.handle_reply(ask, None, str(e)))
            return
        self._run(self.reg.handle_reply(ask, reply, None))

    async def _probe(self, probe: Probe) -> None:
        outcome = await probe_addr(probe.addr, probe.timeout_s)
        self._run(self.reg.handle_probe_result(probe, outcome))

    async def on_stop(self, reason: str) -> None:
        if self._tick is not None:
            self._tick.cancel()
        for h in self._timers:
            h.cancel()
        for t in list(self._tasks):
            t.cancel()


def registry_from_config(
    supervision_update_timeout_s: float | None = None,
    world_eviction_timeout_s: float | None = None,
) -> SystemRegistry:
    """A `SystemRegistry` with the configured timeouts (explicit arguments win)."""
    cfg = config.get()
    loop = asyncio.get_running_loop()
    return SystemRegistry(
        loop.time,
        cfg.supervision_update_timeout_s
        if supervision_update_timeout_s is None
        else supervision_update_timeout_s,
        cfg.world_eviction_timeout_s
        if world_eviction_timeout_s is None
        else world_eviction_timeout_s,
        liveness_probe_timeout_s=cfg.liveness_probe_timeout_s,
        exit_report_grace_s=cfg.exit_report_grace_s,
        proc_stop_timeout_s=cfg.proc_stop_timeout_s,
        health_tick_interval_s=cfg.health_tick_interval_s,
        stop_fallback_margin_s=cfg.stop_fallback_margin_s,
        rpc_timeout_s=cfg.rpc_timeout_s,
        stimulus_log_size=cfg.stimulus_log_size,
        # as long as a proc may wait for a lost system, and no shorter than the silence
        # after which this system would declare a proc Expired anyway
        rejoin_window_s=max(
            config.system_loss_timeout_s(cfg),
            cfg.supervision_update_timeout_s
            if supervision_update_timeout_s is None
            else supervision_update_timeout_s,
        ),
    )
