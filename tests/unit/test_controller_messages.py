"""Tests of the controller and worker message structs.

Every `Message` subclass of both modules has an example here, and each example survives
the runtime's own path (``encode_message`` → envelope → ``decode_payload`` by type id)
unchanged. Also: the tagged command union, `Serialized` forwarding, `Slice` ranks, and
that a worker's ``FetchResult`` decodes into the History's ``Ok``/``Err``.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import palatine.protocol.controller as cm
import palatine.protocol.worker as wm
from palatine.ids import ActorId, PortId, ProcId, WorldId
from palatine.protocol.controller import Deadline, Error
from palatine.protocol.supervision import ActorFailure, ProcSupervisionState
from palatine.protocol.system import WorldStatus, WorldSupervisionState
from palatine.protocol.worker import Err, Ok
from palatine.tensor.controller.history import History
from palatine.wire.codec import Message, decode_payload, encode_message, message_type
from palatine.wire.envelope import ENC_MSGPACK, Envelope

W = WorldId("worker")
CTRL = ActorId.parse("controller[0].root")
CLIENT = ActorId.parse("client[0].main")

PICKLED = wm.Pickled(b"\x80\x05data", [b"buf1", b""])
WERR = wm.WorkerError(
    seq=5,
    rank=1,
    world="worker",
    proc_id="worker[1]",
    host="node3",
    pid=4243,
    stream="main",
    function="train.step",
    exc_type="builtins.ZeroDivisionError",
    message="division by zero",
    traceback='  File "t.py", line 3, in step\n',
    exception=b"\x80\x05exc",
)
SLICE = wm.Slice(0, [2, 2], [2, 1])
CALL = wm.CallFunction(
    seq=7,
    results=[3, None],
    mutates=[1],
    function=wm.Cloudpickle(b"fn", {"t.py": "def f(): pass\n"}),
    args=PICKLED,
    stream=0,
)
PROGRESS = wm.WorkerProgress(
    rank=1,
    pid=4243,
    streams=[
        wm.StreamProgress(
            id=0,
            name="main",
            executing=wm.ExecutingOp(seq=17, function="train_step", running_for_s=4.1),
            queued=2,
            last_completed_seq=16,
        ),
        wm.StreamProgress(id=1, name="side"),
    ],
)
SUP_STATE = WorldSupervisionState(
    world_id=W,
    status=WorldStatus(status="Unhealthy", since=1.0, reason="worker[1] exited"),
    procs={
        1: ProcSupervisionState(
            proc_id=ProcId(W, 1),
            addr="tcp:10.0.0.3:41235",
            pid=4243,
            host="node3",
            health="Exited",
            exit_signal=9,
            failed_actors=[ActorFailure(actor_id=ActorId.parse("worker[1].worker"), status="x")],
            stderr_tail=["Traceback", "boom"],
        )
    },
)
FAILURE = cm.DeviceFailure(
    kind="stuck",
    message="workers stuck: ranks 0 have operations that have not completed after 3 seconds",
    world="worker",
    ranks=[0],
    expected_seq=1,
    ops={0: "executing s1 f on stream main for 4.0 s"},
    stacks={0: "Thread 0x1 ..."},
)
HSNAP = History(2).snapshot()

EXAMPLES: dict[type[Any], list[Any]] = {
    # worker commands
    wm.CreateStream: [wm.CreateStream(id=0, name="main", default=True)],
    wm.CreateDeviceMesh: [wm.CreateDeviceMesh(result=9, names=["host", "proc"], ranks=SLICE)],
    wm.CallFunction: [
        CALL,
        wm.CallFunction(
            seq=8, results=[], function=wm.FunctionPath("torch.add"), args=PICKLED, stream=1
        ),
    ],
    wm.SendValue: [
        wm.SendValue(seq=9, args=PICKLED, stream=0),
        wm.SendValue(seq=10, mutates=[2], function=wm.FunctionPath("x.y"), args=PICKLED, stream=0),
        wm.SendValue(
            seq=11, args=PICKLED, stream=0, deliver_to=ActorId.parse("user[7].client_actor[0]")
        ),
    ],
    wm.DeleteRefs: [wm.DeleteRefs(refs=[1, 2, 3])],
    wm.RequestStatus: [wm.RequestStatus(seq=4, controller=True), wm.RequestStatus(seq=5)],
    wm.CommandGroup: [
        wm.CommandGroup(commands=[CALL, wm.RequestStatus(seq=7), wm.DeleteRefs(refs=[3])]),
        wm.CommandGroup(commands=[]),
    ],
    wm.BackendNetworkInit: [
        wm.BackendNetworkInit(seq=1, result=2, store_addr="127.0.0.1:29500", stream=0)
    ],
    wm.CreateProcessGroup: [
        wm.CreateProcessGroup(seq=2, result=3, mesh=9, dims=["proc"], stream=0)
    ],
    wm.Reduce: [
        wm.Reduce(seq=3, result=4, value=5, mesh=9, dims=["host"], stream=0),
        wm.Reduce(
            seq=4,
            result=6,
            value=5,
            factory=wm.Factory(size=[2, 3], dtype="torch.float32"),
            mesh=9,
            dims=["host", "proc"],
            op="stack",
            scatter=True,
            in_place=False,
            out=7,
            stream=1,
        ),
    ],
    wm.SendTensor: [
        wm.SendTensor(
            seq=5,
            result=9,
            value=5,
            from_ranks=wm.Slice(0, [2], [2]),
            to_ranks=wm.Slice(1, [2], [2]),
            stream=0,
        ),
        wm.SendTensor(
            seq=6,
            result=10,
            value=5,
            from_ranks=wm.Slice(0, [2], [1]),
            to_ranks=wm.Slice(2, [2], [1]),
            factory=wm.Factory(size=[2, 3], dtype="float32"),
            stream=0,
            to_stream=1,
        ),
    ],
    wm.BorrowCreate: [wm.BorrowCreate(borrow=1, result=8, value=5, from_stream=0, to_stream=1)],
    wm.BorrowFirstUse: [wm.BorrowFirstUse(borrow=1)],
    wm.BorrowLastUse: [wm.BorrowLastUse(borrow=1)],
    wm.BorrowDrop: [wm.BorrowDrop(borrow=1)],
    wm.Exit: [wm.Exit(), wm.Exit(error="ValueError: bad")],
    wm.SetRefUnitTestsOnly: [wm.SetRefUnitTestsOnly(ref=1, value=PICKLED, stream=0)],
    wm.DefineRecording: [
        wm.DefineRecording(
            recording=3,
            commands=[
                wm.CallFunction(
                    seq=0,
                    results=[9],
                    function=wm.FunctionPath("torch.ops.aten.add.Tensor"),
                    args=PICKLED,
                    stream=0,
                ),
                wm.BorrowFirstUse(borrow=1),
            ],
            fresh=[9],
        )
    ],
    wm.CallRecording: [wm.CallRecording(seq=12, recording=3)],
    wm.DropRecording: [wm.DropRecording(recording=3)],
    wm.GetRefUnitTestsOnly: [wm.GetRefUnitTestsOnly(ref=1, stream=0)],
    wm.ProgressQuery: [wm.ProgressQuery()],
    wm.PeersLost: [
        wm.PeersLost(ranks=[2], reason="worker[2] (pid 7) was killed by signal 9", pids=[7])
    ],
    # worker replies
    wm.Status: [wm.Status(seq=5, rank=1), wm.Status(seq=2, rank=0, controller=True)],
    wm.RemoteFunctionFailed: [wm.RemoteFunctionFailed(seq=5, error=WERR)],
    wm.FetchedValue: [wm.FetchedValue(seq=22, value=PICKLED)],
    wm.FetchResult: [
        wm.FetchResult(seq=20, value=Ok(PICKLED)),
        wm.FetchResult(seq=21, value=Err(WERR)),
        wm.FetchResult(seq=23, value=Ok(wm.DIRECT)),
    ],
    wm.WorkerProgress: [PROGRESS, wm.WorkerProgress(rank=0, pid=1)],
    wm.RefValue: [
        wm.RefValue(found=False),
        wm.RefValue(found=True, error="ZeroDivisionError: division by zero"),
        wm.RefValue(found=True, value=PICKLED),
    ],
    wm.DebuggerMessage: [wm.DebuggerMessage(rank=1, payload=b"step")],
    # client -> controller
    cm.Attach: [cm.Attach(client=CLIENT)],
    cm.AttachReply: [
        cm.AttachReply(
            world_size=4,
            num_procs_per_host=2,
            worker_world=W,
            worker_name="worker",
            controller_actor_id=CTRL,
            client_liveness_timeout_s=30.0,
        )
    ],
    cm.AttachRejected: [
        cm.AttachRejected(
            message="controller controller[0].root already has a client attached "
            "(client[0].main); a controller serves one client for its lifetime"
        )
    ],
    cm.Detach: [cm.Detach()],
    cm.KeepAlive: [cm.KeepAlive()],
    cm.Node: [
        cm.Node(seq=1, defs=[2, 3], uses=[1], label="train.step"),
        cm.Node(seq=0),
    ],
    cm.DropRefs: [cm.DropRefs(refs=[1, 2])],
    cm.Send: [
        cm.Send(ranks=[SLICE, wm.Slice(2, [2], [1])], message=cm.Serialized.of(CALL)),
    ],
    cm.Batch: [
        cm.Batch(),
        cm.Batch(
            nodes=[cm.Node(seq=1, defs=[2], label="f"), cm.Node(seq=2, uses=[2])],
            sends=[
                cm.Send(
                    ranks=[SLICE], message=cm.Serialized.of(wm.CommandGroup(commands=[CALL, CALL]))
                )
            ],
            drop_refs=[2],
        ),
    ],
    cm.Introspect: [cm.Introspect()],
    cm.IntrospectReply: [
        cm.IntrospectReply(client_state="waiting", history=HSNAP),
        cm.IntrospectReply(
            client_state="attached",
            client=CLIENT,
            history=msgspec.structs.replace(HSNAP, max_seq=4, deadline=Deadline(3, 12.5, True)),
            reported_procs=[ProcId(W, 1)],
            dead_ranks=[1],
            mesh_failed=True,
            stall_report_in_flight=True,
        ),
    ],
    # self
    cm.CheckSupervision: [cm.CheckSupervision()],
    cm.CheckWorkerProgress: [cm.CheckWorkerProgress()],
    cm.SupervisionResult: [
        cm.SupervisionResult(state=SUP_STATE),
        cm.SupervisionResult(source="subscribe", state=None),
        cm.SupervisionResult(error="call timed out after 30 s"),
    ],
    cm.StallReport: [
        cm.StallReport(report_id=1, expected_seq=3),
        cm.StallReport(
            report_id=2,
            expected_seq=3,
            ranks=[
                cm.RankStallData(
                    rank=0, progress=PROGRESS, stack="Thread ...", stack_method="py-spy"
                ),
                cm.RankStallData(rank=1, progress_error="peer gone", stack_error="timed out"),
            ],
        ),
    ],
    # controller -> client
    cm.Result: [
        cm.Result(seq=0),
        cm.Result(seq=20, result=Ok(PICKLED)),
        cm.Result(seq=1, result=Err(Error(1, 1, WERR))),
        cm.Result(seq=2, result=Err(Error(2, 1, WERR))),
    ],
    cm.Results: [
        cm.Results(results=[cm.Result(seq=1), cm.Result(seq=2, result=Ok(PICKLED))]),
    ],
    cm.Log: [
        cm.Log(level="error", message="Node s5 rejected: seqs must increase (last was s9)"),
        cm.Log(level="warn", message="ranks 0 ...", details={"ranks": [0], "expected_seq": 1}),
    ],
    cm.Failure: [
        cm.Failure(failure=FAILURE),
        cm.Failure(failure=cm.DeviceFailure(kind="system_lost", message="lost contact")),
    ],
}


def _message_classes(module: Any) -> list[type[Any]]:
    return [
        obj
        for name in module.__all__
        if inspect.isclass(obj := getattr(module, name))
        and issubclass(obj, Message)
        and obj.__module__ == module.__name__
    ]


def _roundtrip(msg: Any) -> Any:
    """The runtime's path: encode, wrap in an envelope, decode by the envelope's type id."""
    tid = type(msg).__palatine_type_id__
    env = Envelope(
        sender=CTRL,
        dest=PortId(CLIENT, tid),
        type_id=tid,
        encoding=ENC_MSGPACK,
        data=encode_message(msg),
    )
    return decode_payload(env)


def test_every_message_class_has_an_example() -> None:
    classes = _message_classes(cm) + _message_classes(wm)
    assert len(classes) == len(set(classes))
    missing = [c.__name__ for c in classes if c not in EXAMPLES]
    assert not missing, f"no round-trip example for {missing}"


@pytest.mark.parametrize(
    "msg",
    [m for examples in EXAMPLES.values() for m in examples],
    ids=lambda m: type(m).__name__,
)
def test_msgpack_round_trip(msg: Any) -> None:
    back = _roundtrip(msg)
    assert type(back) is type(msg)
    assert back == msg


def test_type_ids_are_registered_distinct_and_stable() -> None:
    classes = _message_classes(cm) + _message_classes(wm)
    tids = [c.__palatine_type_id__ for c in classes]
    assert len(set(tids)) == len(tids)
    for cls in classes:
        assert message_type(cls.__palatine_type_id__) is cls
        assert cls.__palatine_type_id__ >> 63 == 1
    # The id is a pure function of the qualified name: fixed across processes.
    assert cm.Node.__palatine_type_id__ == msgspec.msgpack.decode(
        msgspec.msgpack.encode(cm.Node.__palatine_type_id__)
    )


def test_messages_are_keyword_only() -> None:
    for cls in _message_classes(cm) + _message_classes(wm):
        fields = msgspec.structs.fields(cls)
        if fields:
            with pytest.raises(TypeError):
                cls(*[None] * len(fields))
    with pytest.raises(TypeError):
        cm.Node(1)  # type: ignore[call-arg]


def test_controller_reexports_the_worker_replies() -> None:
    assert cm.Status is wm.Status
    assert cm.RemoteFunctionFailed is wm.RemoteFunctionFailed
    assert cm.FetchResult is wm.FetchResult


def test_fetch_result_feeds_the_history_types() -> None:
    """A worker's FetchResult decodes into the History's own Ok/Err (set_result accepts it)."""
    h = History(1)
    h.add_invocation(0, [], [])
    h.add_invocation(1, [], [])
    ok = _roundtrip(wm.FetchResult(seq=0, value=Ok(PICKLED)))
    bad = _roundtrip(wm.FetchResult(seq=1, value=Err(WERR)))
    h.set_result(ok.seq, ok.value)
    h.set_result(bad.seq, bad.value)
    reports = h.rank_completed(0, 2)
    assert reports == [(0, Ok(PICKLED)), (1, Err(Error(1, 1, WERR)))]
    # ... and those reports are exactly what a Result carries.
    for seq, outcome in reports:
        assert _roundtrip(cm.Result(seq=seq, result=outcome)).result == outcome


def test_ok_err_wire_form_is_tagged_array() -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Ok(1))) == ["Ok", 1]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Err("e"))) == ["Err", "e"]


def test_command_group_decodes_each_command_under_its_own_type() -> None:
    group = EXAMPLES[wm.CommandGroup][0]
    back = _roundtrip(group)
    assert [type(c) for c in back.commands] == [
        wm.CallFunction,
        wm.RequestStatus,
        wm.DeleteRefs,
    ]
    # A tagged command still decodes alone by its own type id, and by the union.
    data = encode_message(CALL)
    assert msgspec.msgpack.decode(data, type=wm.CallFunction) == CALL
    assert msgspec.msgpack.decode(data, type=wm.WorkerMessage) == CALL


def test_serialized_is_forwarded_without_decoding() -> None:
    ser = cm.Serialized.of(CALL)
    assert ser.type_id == wm.CallFunction.__palatine_type_id__
    assert ser.encoding == ENC_MSGPACK
    assert ser.data == encode_message(CALL)
    send = _roundtrip(cm.Send(ranks=[SLICE], message=ser))
    # The bytes the controller casts are the client's bytes, byte for byte.
    assert send.message.data == ser.data
    assert send.message.decode() == CALL
    with pytest.raises(TypeError):
        cm.Serialized(type_id=1 << 63, data=b"").decode()


def test_slice_ranks() -> None:
    mesh = wm.Slice(0, [2, 2], [2, 1])
    assert mesh.ranks() == [0, 1, 2, 3] and len(mesh) == 4
    assert wm.Slice(2, [2], [1]).ranks() == [2, 3]  # host=1 of a 2x2 mesh
    assert wm.Slice(0, [2], [2]).ranks() == [0, 2]  # proc=0 column
    assert wm.Slice(0, [2, 3], [3, 1]).ranks() == [0, 1, 2, 3, 4, 5]
    assert wm.Slice(5, [], []).ranks() == [5] and len(wm.Slice(5, [], [])) == 1
    with pytest.raises(ValueError):
        wm.Slice(0, [2], [1, 1]).ranks()
    assert wm.Slice(3, [3, 0], [1, 1]).ranks() == []
    assert wm.Slice(1, [2, 2], [0, 1]).ranks() == [1, 2, 1, 2]  # duplicates kept


@given(
    offset=st.integers(0, 50),
    dims=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=4),
)
@settings(deadline=None, max_examples=300)
def test_slice_ranks_are_offset_plus_the_row_major_index_sums(
    offset: int, dims: list[tuple[int, int]]
) -> None:
    sizes = [d[0] for d in dims]
    strides = [d[1] for d in dims]
    want = [
        offset + sum(i * s for i, s in zip(idx, strides, strict=False))
        for idx in itertools.product(*(range(n) for n in sizes))
    ]
    assert wm.Slice(offset, sizes, strides).ranks() == want


def test_device_failure_details_are_the_exception_attributes() -> None:
    d = FAILURE.details()
    assert "kind" not in d and "message" not in d
    assert d["ranks"] == [0] and d["expected_seq"] == 1 and d["pid"] is None
    assert set(d) == {
        "world",
        "rank",
        "proc_id",
        "host",
        "addr",
        "pid",
        "exit_code",
        "exit_signal",
        "reason",
        "actor_id",
        "actor_error",
        "ranks",
        "expected_seq",
        "ops",
        "stacks",
    }


def test_controller_params_round_trip_and_defaults() -> None:
    params = cm.ControllerParams(
        world_size=4,
        worker_world=W,
        system_addr="unix:@sys",
        comm=ActorId.parse("controller[0].comm"),
        worker_procs=[
            cm.WorkerProcRecord(
                rank=0,
                proc_id=ProcId(W, 0),
                pid=812,
                host="node3",
                addr="unix:/run/w0",
                host_proc=ProcId(WorldId("hostworker"), 0),
            )
        ],
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=cm.ControllerParams)
    assert back == params
    # The defaults.
    assert (
        params.num_procs_per_host,
        params.worker_name,
        params.supervision_query_interval_s,
        params.worker_progress_check_interval_s,
        params.operation_timeout_s,
        params.operations_per_worker_progress_request,
        params.fail_on_worker_timeout,
        params.stall_report_timeout_s,
        params.client_liveness_timeout_s,
        params.system_loss_timeout_s,
    ) == (8, "worker", 2.0, 10.0, 120.0, 100, False, 5.0, 30.0, 10.0)
    wp = wm.WorkerParams(world_size=4, rank=2, device_index=None, controller_actor=CTRL)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wp), type=wm.WorkerParams) == wp


def test_bad_payloads_fail_to_decode() -> None:
    """A malformed command is rejected at decode time (the worker's infrastructure error)."""
    bad = msgspec.msgpack.encode({"type": "Reduce", "seq": 1, "op": "median"})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=wm.Reduce)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"seq": "x"}), type=cm.Node)
