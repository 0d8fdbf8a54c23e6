"""The tensor worker actor ``palatine.tensor.worker.WorkerActor``.

One per worker proc, spawned by the controller by type name with `WorkerParams`. Its
event loop only **routes**: every command is posted to the queue of the stream it names
(or to every stream, for barriers and deletions) and the handler returns at once, so
`ProgressQuery` and `Exit` are answered even while a stream is stuck. Streams
(`palatine.tensor.worker.stream`) execute; what they produce for the controller lands in the
actor's single **outbox** (`palatine.tensor.worker.outbox`), which goes out in production order.

Failure classes: user errors become ``RemoteFunctionFailed`` (roots only);
dependent errors poison silently; infrastructure errors (`InfrastructureError`) fail this
actor — the proc agent reports the failed actor and the client sees
``DeviceException(actor_failed)``.

What the worker sends, all to ``WorkerParams.controller_actor``: `Status` (barriers),
`RemoteFunctionFailed`, `FetchResult`; and replies to asks: `WorkerProgress`
(`ProgressQuery`), `RefValue` (`GetRefUnitTestsOnly`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from palatine import config
from palatine.core.actor import Actor, handler
from palatine.core.mailbox import HandlerPort
from palatine.core.proc import Proc
from palatine.fastpath.blocking import LinkLost
from palatine.fastpath.direct_tx import open_direct
from palatine.hosting.child_env import Handoff
from palatine.ids import PortId
from palatine.protocol.worker import (
    BackendNetworkInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallFunction,
    CallRecording,
    CommandGroup,
    CreateDeviceMesh,
    CreateProcessGroup,
    CreateStream,
    DefineRecording,
    DeleteRefs,
    DropRecording,
    ExecutingOp,
    Exit,
    GetRefUnitTestsOnly,
    PeersLost,
    ProgressQuery,
    Reduce,
    RefValue,
    RequestStatus,
    SendTensor,
    SendValue,
    SetRefUnitTestsOnly,
    Status,
    StreamProgress,
    WorkerParams,
    WorkerProgress,
    with_seq,
)
from palatine.tensor.worker import local_shard, torch_warmup
from palatine.tensor.worker.outbox import Outbox
from palatine.tensor.worker.prepared import prepare
from palatine.tensor.worker.scheduling import batch_scheduling, gil_switching
from palatine.tensor.worker.state import Borrow, Countdown, WorkerState
from palatine.tensor.worker.stream import InfrastructureError, Stream
from palatine.tensor.worker.transfer import parts
from palatine.tensor.worker.values import import_torch
from palatine.wire.envelope import Envelope

__all__ = ["WorkerActor", "exit_timeout_s"]

log = logging.getLogger(__name__)

_STOP_JOIN_S = 2.0


def exit_timeout_s() -> float:
    """How long `Exit` drains (``worker_exit_timeout_s``, ``PALATINE_WORKER_EXIT_TIMEOUT``)."""
    return config.get().worker_exit_timeout_s


def _device_of_proc(device_index: int, count: int) -> int:
    """The GPU of this proc: ``device_index`` of what it sees, counted from its local rank
    (``LOCAL_RANK``) when it sees several. A local mesh's or a Slurm job's worker sees the
    one GPU its host gave it (``cuda:0``); a tensor engine's worker runs in an actor
    proc, which sees all of its host's, and takes the one of its rank on the host."""
    if count <= 1:
        return device_index
    try:
        local_rank = max(0, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        local_rank = 0
    return (device_index + local_rank) % count


class _CommandPort(HandlerPort):
    """A handler port for a worker command whose decode failure fails the worker.

    The runtime's handler port would return an undecodable message to its sender (the
    controller, which only logs casts that bounce); for a worker that means the client
    and worker disagree on the protocol, so it is an infrastructure error. A
    message of a type the worker has no handler for is refused as on any handler port.
    """

    __slots__ = ("on_bad",)

    def __init__(self, port: HandlerPort, on_bad: Callable[[str], None]) -> None:
        super().__init__(port.mailbox, port.index, port.sink, port.type_name, port.accepts)
        self.on_bad = on_bad

    def undecodable(self, env: Envelope, error: Exception) -> str | None:
        self.on_bad(f"undecodable {self.type_name} command from {env.sender}: {error}")
        return None


async def _raise(exc: BaseException) -> None:
    raise exc


def _torch_installed() -> bool:
    """Whether ``import torch`` can work here, without importing it (a path lookup).

    When it can, the first import will read torch's libraries through before loading
    them, so it does not stall the heartbeat (`palatine.tensor.worker.torch_warmup`).
    """
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None  # None: imports of torch are blocked
    if torch_warmup.install():
        return True
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


class WorkerActor(Actor):
    """The tensor worker: streams, refs, calls, fetches, collectives."""

    __palatine_name__ = "palatine.tensor.worker.WorkerActor"
    Params = WorkerParams

    def __init__(self, params: WorkerParams) -> None:
        if not 0 <= params.rank < params.world_size:
            raise ValueError(
                f"rank {params.rank} is outside the worker world of size {params.world_size}: "
                "need 0 <= rank < world_size"
            )
        self.params = params
        self.streams: dict[int, Stream] = {}
        #: Recordings this session defined: id -> this rank's share.
        self.recordings: dict[int, tuple[DefineRecording, Any]] = {}
        self.state: WorkerState | None = None
        self.outbox = Outbox(params.controller_actor.proc, self._fail)
        self._exiting = False
        self._ignored_logged = False
        self._failed = False

    # ---------------------------------------------------------------- lifecycle
    async def init(self) -> None:
        p = self.params
        batch_scheduling(str(Proc.of(self.cx).proc_id))
        gil_switching(str(Proc.of(self.cx).proc_id))
        device = "cpu"
        torch: Any = None
        # A CPU worker is ready without torch (~1.6 s of CPU to import): the first
        # command that needs it imports it on its stream thread (tensor values,
        # `torch.*` functions, collectives and reductions all import it themselves).
        torch_available = _torch_installed()
        if p.device_index is not None:
            torch = await asyncio.to_thread(import_torch)  # ~2 s: keep the loop serving
            torch_available = torch is not None
            if torch is not None and torch.cuda.is_available():
                index = _device_of_proc(p.device_index, torch.cuda.device_count())
                torch.cuda.set_device(index)
                device = f"cuda:{index}"
            else:
                log.warning(
                    "device_index %d requested but CUDA is not available; using CPU", p.device_index
                )
        proc = Proc.of(self.cx)
        proc.activity = self.activity  # reported with the proc's heartbeats (`palatine top`)
        addr = proc.addr
        store_host = "127.0.0.1"
        if (
            addr is not None
            and addr.transport in ("tcp", "tls")
            and addr.host not in ("", "0.0.0.0", "::")
        ):
            store_host = addr.host
        torch_local = os.environ.get("LOCAL_RANK", "")
        local_rank = int(torch_local) if torch_local.isdigit() else Handoff.from_env().local_rank
        self.state = WorkerState(
            rank=p.rank,
            world_size=p.world_size,
            world=proc.proc_id.world.name,
            proc_id=str(proc.proc_id),
            host=socket.gethostname(),
            pid=os.getpid(),
            device=device,
            device_index=int(device.split(":")[1]) if device != "cpu" else None,
            local_rank=local_rank if local_rank is not None else p.rank,
            store_host=store_host,
            controller=p.controller_actor,
            emit=self.outbox.emit,
            flush=self.outbox.flush,
            torch_available=torch_available,
        )
        self.outbox.start(
            asyncio.get_running_loop(),
            self.cx.actor_id,
            proc.post,
            await open_direct(proc, p.controller_actor),
        )
        self._install_command_ports()
        local_shard.register(self.state.world, self.streams, Proc.of(self.cx))
        log.debug("worker rank %d ready on %s (%s)", p.rank, proc.proc_id, device)

    def _install_command_ports(self) -> None:
        mb = self.cx.mailbox
        for cls in _COMMAND_TYPES:
            tid = cls.__palatine_type_id__
            port = mb.ports.get(tid)
            if type(port) is not HandlerPort:
                continue
            mb.ports[tid] = _CommandPort(port, self._undecodable)

    def _undecodable(self, text: str) -> None:
        self._fail(InfrastructureError(text))

    async def on_stop(self, reason: str) -> None:
        self._exiting = True
        if self.state is not None:
            local_shard.unregister(self.state.world)
        streams = list(self.streams.values())
        for s in streams:
            s.close(drain=False)
        deadline = time.monotonic() + _STOP_JOIN_S
        while any(s.alive for s in streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for s in streams:
            if s.alive:
                log.warning("stream %s still running at stop: %s", s.name, _op_text(s))
        try:
            await self.outbox.close(_STOP_JOIN_S)
        except LinkLost as e:
            log.warning("worker rank %d: %s", self.params.rank, e.reason)

    # ---------------------------------------------------------------- failure
    def _fail(self, exc: InfrastructureError) -> None:
        """Fail the actor with ``exc`` (once); streams are abandoned."""
        if self._failed:
            return
        self._failed = True
        log.error("worker rank %d failed: %s", self.params.rank, exc)
        self._abandon()
        self.cx.spawn_task(_raise(exc))

    def _abandon(self) -> None:
        for s in self.streams.values():
            s.close(drain=False)

    # ---------------------------------------------------------------- routing
    def _route(self, cmd: Any) -> None:
        if self._failed:
            return
        if self._exiting:
            if not self._ignored_logged:
                self._ignored_logged = True
                log.info("worker rank %d is exiting; ignoring further commands", self.params.rank)
            return
        try:
            _ROUTES[type(cmd)](self, cmd)
        except BaseException:  # any error here fails the actor: stop the streams first
            self._failed = True
            self._abandon()
            raise

    def _stream(self, sid: int, what: Any) -> Stream:
        """The stream ``sid`` named by ``what`` (a command, or its description)."""
        s = self.streams.get(sid)
        if s is None:
            if not isinstance(what, str):
                seq = getattr(what, "seq", None)
                what = type(what).__name__ + (f" s{seq}" if seq is not None else "")
            known = ", ".join(str(k) for k in sorted(self.streams)) or "none"
            raise InfrastructureError(
                f"invalid stream id {sid} in {what} on rank {self.params.rank} (streams: {known})"
            )
        return s

    def _create_stream(self, cmd: CreateStream) -> None:
        old = self.streams.get(cmd.id)
        if old is not None:
            raise InfrastructureError(
                f"duplicate stream id {cmd.id} on rank {self.params.rank} "
                f"(stream {old.name!r} exists; {cmd.name!r} requested)"
            )
        assert self.state is not None
        s = Stream(self.state, cmd.id, cmd.name, cmd.default)
        self.streams[cmd.id] = s
        s.start()

    def _create_device_mesh(self, cmd: CreateDeviceMesh) -> None:
        from palatine.tensor.worker.collectives import DeviceMeshView

        assert self.state is not None
        if cmd.result in self.state.meshes:
            raise InfrastructureError(
                f"duplicate device mesh r{cmd.result} on rank {self.params.rank}"
            )
        try:
            view = DeviceMeshView.create(cmd.result, cmd.names, cmd.ranks, self.params.rank)
        except ValueError as e:
            raise InfrastructureError(str(e)) from None
        self.state.meshes[cmd.result] = view

    def _call(self, cmd: CallFunction) -> None:
        s = self._stream(cmd.stream, cmd)
        s.post(s.run_call, cmd)

    def _send_value(self, cmd: SendValue) -> None:
        s = self._stream(cmd.stream, cmd)
        s.post(s.run_send_value, cmd)

    def _collective(self, cmd: BackendNetworkInit | CreateProcessGroup | Reduce) -> None:
        s = self._stream(cmd.stream, cmd)
        if type(cmd) is BackendNetworkInit:
            # Collectives on other streams wait for this init instead of racing it.
            assert self.state is not None
            self.state.collective_pending = threading.Event()
        s.post(s.run_collective, cmd)

    def _send_tensor(self, cmd: SendTensor) -> None:
        """This rank's parts of a move between meshes, each on its stream (`transfer`)."""
        try:
            todo = parts(cmd, self.params.rank)
        except ValueError as e:  # the client checks all this: a protocol disagreement
            raise InfrastructureError(str(e)) from None
        posts = [(self._stream(sid, cmd), part) for sid, part in todo]
        for s, part in posts:
            s.post(s.run_collective, part)

    def _request_status(self, cmd: RequestStatus) -> None:
        assert self.state is not None
        state = self.state
        status = Status(seq=cmd.seq + 1, rank=self.params.rank, controller=cmd.controller)
        streams = list(self.streams.values())
        if not streams:
            state.send(status)
            return
        cd = Countdown(len(streams), lambda: state.send(status))
        for s in streams:
            s.post(s.run_marker, cd)

    def _delete_refs(self, cmd: DeleteRefs) -> None:
        assert self.state is not None
        state = self.state
        refs = list(cmd.refs)
        streams = list(self.streams.values())
        if not streams:
            state.forget_shared(refs)
            return
        cd = Countdown(len(streams), lambda: state.forget_shared(refs))
        for s in streams:
            s.post(s.run_delete, (refs, cd))

    def _set_ref(self, cmd: SetRefUnitTestsOnly) -> None:
        s = self._stream(cmd.stream, "SetRefUnitTestsOnly")
        s.post(s.run_set_ref, cmd)

    def _borrow(self, bid: int, what: str) -> Borrow:
        assert self.state is not None
        b = self.state.borrows.get(bid)
        if b is None:
            raise InfrastructureError(f"unknown borrow {bid} in {what} on rank {self.params.rank}")
        return b

    def _borrow_create(self, cmd: BorrowCreate) -> None:
        assert self.state is not None
        if cmd.borrow in self.state.borrows:
            raise InfrastructureError(f"duplicate borrow {cmd.borrow} on rank {self.params.rank}")
        src = self._stream(cmd.from_stream, f"BorrowCreate {cmd.borrow}")
        self._stream(cmd.to_stream, f"BorrowCreate {cmd.borrow}")
        b = Borrow(cmd.borrow, cmd.result, cmd.value, cmd.from_stream, cmd.to_stream)
        self.state.borrows[cmd.borrow] = b
        src.post(src.run_borrow_create, b)

    def _borrow_first_use(self, cmd: BorrowFirstUse) -> None:
        b = self._borrow(cmd.borrow, "BorrowFirstUse")
        s = self._stream(b.to_id, f"BorrowFirstUse {b.id}")
        s.post(s.run_borrow_first_use, b)

    def _borrow_last_use(self, cmd: BorrowLastUse) -> None:
        b = self._borrow(cmd.borrow, "BorrowLastUse")
        s = self._stream(b.to_id, f"BorrowLastUse {b.id}")
        s.post(s.run_borrow_last_use, b)

    def _borrow_drop(self, cmd: BorrowDrop) -> None:
        assert self.state is not None
        b = self._borrow(cmd.borrow, "BorrowDrop")
        s = self._stream(b.from_id, f"BorrowDrop {b.id}")
        del self.state.borrows[b.id]
        s.post(s.run_borrow_drop, b)

    def _command_group(self, cmd: CommandGroup) -> None:
        held = list(self.streams.values())
        for s in held:
            s.hold()
        try:
            for c in cmd.commands:
                self._route(c)
        finally:
            for s in held:
                s.release()

    def _define_recording(self, cmd: DefineRecording) -> None:
        self.recordings[cmd.recording] = (cmd, self._stream_plan(cmd))

    def _stream_plan(self, cmd: DefineRecording) -> list[tuple[Stream, list[Any]]] | None:
        """A recording of calls and reduces only, as runs of work items per stream: a
        call posts each run once and its stream thread sets the seq (no per-command
        routing or copies on this loop, which shares the GIL with the streams). None
        for one with borrows or transfers (they go through `_route`, one by one)."""
        plan: list[tuple[Stream, list[Any]]] = []
        item: tuple[Callable[[Any], None], Any]
        for c in cmd.commands:
            if type(c) is CallFunction:
                s = self._stream(c.stream, c)
                pc = prepare(msgspec.structs.replace(c), s.resolve)
                item = (
                    (s.run_call, msgspec.structs.replace(c)) if pc is None else (s.run_prepared, pc)
                )
            elif type(c) is Reduce:
                s = self._stream(c.stream, c)
                item = (s.run_collective, msgspec.structs.replace(c))
            else:
                return None
            if plan and plan[-1][0] is s:
                plan[-1][1].append(item)
            else:
                plan.append((s, [item]))
        return plan

    def _call_recording(self, cmd: CallRecording) -> None:
        """Every recorded command again, under this call's seq, as a `CommandGroup`'s
        are: in order, the streams held until all are posted."""
        found = self.recordings.get(cmd.recording)
        if found is None:
            raise InfrastructureError(
                f"unknown recording {cmd.recording} in CallRecording s{cmd.seq} on rank "
                f"{self.params.rank} (known: {sorted(self.recordings) or 'none'})"
            )
        rec, plan = found
        held = list(self.streams.values())
        for s in held:
            s.hold()
        try:
            if rec.fresh:
                self._route(DeleteRefs(refs=rec.fresh))
            seq = cmd.seq
            if plan is not None:
                for s, items in plan:
                    s.post(s.run_recorded, (items, seq))
            else:
                for c in rec.commands:
                    self._route(with_seq(c, seq))
        finally:
            for s in held:
                s.release()

    def _drop_recording(self, cmd: DropRecording) -> None:
        self.recordings.pop(cmd.recording, None)

    def _exit(self, cmd: Exit) -> None:
        self._exiting = True
        if cmd.error:
            log.error(
                "worker rank %d: the client's session ended with an error: %s",
                self.params.rank,
                cmd.error,
            )
        for s in self.streams.values():
            s.close(drain=True)
        self.cx.spawn_task(self._finish_exit())

    async def _finish_exit(self) -> None:
        streams = list(self.streams.values())
        limit = exit_timeout_s()
        deadline = time.monotonic() + limit
        while any(s.alive for s in streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        busy = [s for s in streams if s.alive]
        for s in busy:
            log.warning(
                "worker rank %d: stream %s still busy %g s after Exit: %s",
                self.params.rank,
                s.name,
                limit,
                _op_text(s),
            )
            s.close(drain=False)
        self.outbox.drain()
        state = self.state
        if not busy and state is not None and state.collective is not None:
            from palatine.tensor.worker.collectives import destroy

            try:
                await asyncio.wait_for(asyncio.to_thread(destroy), timeout=10.0)
            except TimeoutError:
                log.warning(
                    "worker rank %d: destroying the process group timed out", self.params.rank
                )
        self.cx.stop("exit requested by the client")

    # ---------------------------------------------------------------- progress
    def progress(self) -> WorkerProgress:
        """Per-stream state, read without touching the stream threads."""
        now = time.monotonic()
        out = []
        for sid, s in self.streams.items():
            cur = s.current
            executing = (
                ExecutingOp(seq=cur[0], function=cur[1], running_for_s=round(now - cur[2], 3))
                if cur is not None
                else None
            )
            out.append(
                StreamProgress(
                    id=sid,
                    name=s.name,
                    executing=executing,
                    queued=s.queued,
                    last_completed_seq=s.last_completed_seq,
                )
            )
        return WorkerProgress(rank=self.params.rank, pid=os.getpid(), streams=out)

    def activity(self) -> str:
        """The op that has run longest on any stream (``s12 spin on main for 3.2 s``), or
        ``idle``; read from the heartbeat thread without touching the streams."""
        now = time.monotonic()
        longest: tuple[float, str] | None = None
        for s in list(self.streams.values()):
            cur = s.current
            if cur is not None and (longest is None or cur[2] < longest[0]):
                longest = (cur[2], f"s{cur[0]} {cur[1]} on {s.name}")
        if longest is None:
            return "idle"
        return f"{longest[1]} for {now - longest[0]:.1f} s"

    # ---------------------------------------------------------------- handlers
    @handler
    def on_create_stream(self, msg: CreateStream) -> None:
        self._route(msg)

    @handler
    def on_create_device_mesh(self, msg: CreateDeviceMesh) -> None:
        self._route(msg)

    @handler
    def on_call_function(self, msg: CallFunction) -> None:
        self._route(msg)

    @handler
    def on_send_value(self, msg: SendValue) -> None:
        self._route(msg)

    @handler
    def on_delete_refs(self, msg: DeleteRefs) -> None:
        self._route(msg)

    @handler
    def on_request_status(self, msg: RequestStatus) -> None:
        self._route(msg)

    @handler
    def on_command_group(self, msg: CommandGroup) -> None:
        self._route(msg)

    @handler
    def on_backend_network_init(self, msg: BackendNetworkInit) -> None:
        self._route(msg)

    @handler
    def on_create_process_group(self, msg: CreateProcessGroup) -> None:
        self._route(msg)

    @handler
    def on_reduce(self, msg: Reduce) -> None:
        self._route(msg)

    @handler
    def on_send_tensor(self, msg: SendTensor) -> None:
        self._route(msg)

    @handler
    def on_borrow_create(self, msg: BorrowCreate) -> None:
        self._route(msg)

    @handler
    def on_borrow_first_use(self, msg: BorrowFirstUse) -> None:
        self._route(msg)

    @handler
    def on_borrow_last_use(self, msg: BorrowLastUse) -> None:
        self._route(msg)

    @handler
    def on_borrow_drop(self, msg: BorrowDrop) -> None:
        self._route(msg)

    @handler
    def on_define_recording(self, msg: DefineRecording) -> None:
        self._route(msg)

    @handler
    def on_call_recording(self, msg: CallRecording) -> None:
        self._route(msg)

    @handler
    def on_drop_recording(self, msg: DropRecording) -> None:
        self._route(msg)

    @handler
    def on_exit(self, msg: Exit) -> None:
        self._route(msg)

    @handler
    def on_set_ref(self, msg: SetRefUnitTestsOnly) -> None:
        self._route(msg)

    @handler
    def on_get_ref(self, msg: GetRefUnitTestsOnly) -> RefValue | None:
        env = self.cx.env
        if env is None or env.reply_to is None:
            log.warning("GetRefUnitTestsOnly without a reply port; ignored")
            return None
        if self._failed:
            return None
        if self._exiting:  # the streams take no more work: answer instead of never
            return RefValue(found=False, error=f"worker rank {self.params.rank} is exiting")
        s = self._stream(msg.stream, "GetRefUnitTestsOnly")
        port: PortId = env.reply_to
        s.post(s.run_get_ref, (msg, port))
        return None

    @handler
    def on_progress_query(self, msg: ProgressQuery) -> WorkerProgress:
        return self.progress()

    @handler
    def on_peers_lost(self, msg: PeersLost) -> None:
        """Ranks were declared lost: palatine's collectives waiting for them end now
        (here, on the loop: the stream that waits may be the one stuck)."""
        if self.state is not None:
            self.state.peers.declare(msg.ranks, msg.reason, msg.pids)


def _op_text(s: Stream) -> str:
    cur = s.current
    if cur is None:
        return "between ops"
    return f"executing s{cur[0]} {cur[1]} for {time.monotonic() - cur[2]:.1f} s"


_COMMAND_TYPES: tuple[type[Any], ...] = (
    CreateStream,
    CreateDeviceMesh,
    CallFunction,
    SendValue,
    DeleteRefs,
    RequestStatus,
    CommandGroup,
    BackendNetworkInit,
    CreateProcessGroup,
    Reduce,
    SendTensor,
    BorrowCreate,
    BorrowFirstUse,
    BorrowLastUse,
    BorrowDrop,
    Exit,
    SetRefUnitTestsOnly,
    DefineRecording,
    CallRecording,
    DropRecording,
    GetRefUnitTestsOnly,
    ProgressQuery,
    PeersLost,
)

_ROUTES: dict[type[Any], Callable[[WorkerActor, Any], None]] = {
    CreateStream: WorkerActor._create_stream,
    CreateDeviceMesh: WorkerActor._create_device_mesh,
    CallFunction: WorkerActor._call,
    SendValue: WorkerActor._send_value,
    DeleteRefs: WorkerActor._delete_refs,
    RequestStatus: WorkerActor._request_status,
    CommandGroup: WorkerActor._command_group,
    BackendNetworkInit: WorkerActor._collective,
    CreateProcessGroup: WorkerActor._collective,
    Reduce: WorkerActor._collective,
    SendTensor: WorkerActor._send_tensor,
    BorrowCreate: WorkerActor._borrow_create,
    BorrowFirstUse: WorkerActor._borrow_first_use,
    BorrowLastUse: WorkerActor._borrow_last_use,
    BorrowDrop: WorkerActor._borrow_drop,
    Exit: WorkerActor._exit,
    SetRefUnitTestsOnly: WorkerActor._set_ref,
    DefineRecording: WorkerActor._define_recording,
    CallRecording: WorkerActor._call_recording,
    DropRecording: WorkerActor._drop_recording,
}
