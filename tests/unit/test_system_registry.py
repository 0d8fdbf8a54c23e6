"""Tests of the system's sans-IO core, `SystemRegistry`.

Everything runs against a fake clock that only moves when a test advances it, with the
small settings (update timeout 1 s, eviction 1 s, tick 0.25 s). The `Harness`
plays the actor shell: it feeds stimuli, keeps every instruction, and can answer the
registry's `Ask`s the way proc agents would. Acceptance items are cited as ``A<n>``.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Iterable
from typing import Any, get_args
from unittest.mock import ANY

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from palatine.channel.addr import ChannelAddr
from palatine.errors import SystemRequestError
from palatine.ids import PortId, ProcId, WorldId
from palatine.protocol.agent import (
    KillProcs,
    ProcStop,
    ProcStopResult,
    SpawnProc,
    SpawnProcResult,
)
from palatine.protocol.supervision import ActorFailure, ProcSupervisionState
from palatine.protocol.system import (
    AddressChanged,
    Exec,
    FailedProc,
    Join,
    Joined,
    Leave,
    Local,
    Ok,
    PeerGone,
    ProcExited,
    ProcFailed,
    Rejected,
    Resolve,
    Resolved,
    Snapshot,
    SnapshotFilter,
    StartedProc,
    Stimuli,
    StimulusEntry,
    StimulusLog,
    Stop,
    StopAck,
    Subscribe,
    Subscribed,
    SupervisionUpdate,
    SystemSnapshot,
    SystemStopping,
    Unsubscribe,
    UpsertWorld,
    WorldGone,
    WorldState,
    WorldStateReply,
    WorldStatusChanged,
    WorldUpserted,
)
from palatine.system.instructions import (
    Ask,
    Bind,
    ExitReportGrace,
    Instruction,
    JoinProbeNeeded,
    Log,
    Probe,
    ProbeAgain,
    Send,
    StopFallback,
    StopSystem,
    Timer,
    Unbind,
)
from palatine.system.registry import PROBE_AGAIN_S, SystemRegistry, agent_of
from palatine.system.worlds import execution_id_from_env, host_ranks

# --------------------------------------------------------------------------- plumbing


class FakeClock:
    """Monotonic time that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def pid(text: str) -> ProcId:
    return ProcId.parse(text)


def wid(name: str) -> WorldId:
    return WorldId(name)


class Harness:
    """Plays the SystemActor shell around one registry, keeping every instruction."""

    def __init__(self, **overrides: Any) -> None:
        self.clock = FakeClock()
        settings: dict[str, Any] = {
            "supervision_update_timeout_s": 1.0,
            "world_eviction_timeout_s": 1.0,
            "execution_id": "alice-20240101-000000-abcd",
            "liveness_probe_timeout_s": 1.0,
            "exit_report_grace_s": 0.5,
            "proc_stop_timeout_s": 1.0,
            "stop_fallback_margin_s": 3.0,
            "rpc_timeout_s": 1.0,
            "wall_clock": lambda: 1_700_000_000.0,
            # no restart: a fresh registry tells unknown procs at once (tests of the
            # rejoin window set one)
            "rejoin_window_s": 0.0,
        }
        settings.update(overrides)
        self.reg = SystemRegistry(self.clock, **settings)
        self.log: list[Any] = []
        self.incarnations: dict[ProcId, int] = {}
        self._next_incarnation = 1

    # -- feeding stimuli

    def run(self, result: tuple[Any, list[Any]]) -> tuple[Any, list[Any]]:
        reply, instrs = result
        assert isinstance(instrs, list)
        self.log.extend(instrs)
        return reply, instrs

    def send(self, msg: Any, requester: ProcId | None = None) -> tuple[Any, list[Any]]:
        return self.run(self.reg.handle(msg, requester=requester))

    def ok(self, msg: Any, requester: ProcId | None = None) -> Any:
        """Send ``msg``, expect a non-rejected reply and return it."""
        reply, _ = self.send(msg, requester)
        assert not isinstance(reply, Rejected), reply
        return reply

    def rejected(self, msg: Any, code: str) -> Rejected:
        reply, instrs = self.send(msg)
        assert isinstance(reply, Rejected), reply
        assert reply.code == code, reply
        assert any(isinstance(i, Log) and i.level == logging.WARNING for i in instrs)
        return reply

    def join(
        self,
        proc: str | ProcId,
        *,
        addr: str | None = None,
        mode: str = "ManagedBySystem",
        labels: dict[str, str] | None = None,
        pid_: int = 4242,
        host: str = "node1",
        host_proc: str | None = None,
        incarnation: int | None = None,
    ) -> tuple[Any, list[Any]]:
        p = pid(proc) if isinstance(proc, str) else proc
        if incarnation is None:
            incarnation = self._next_incarnation
            self._next_incarnation += 1
        msg = Join(
            proc_id=p,
            addr=addr if addr is not None else f"unix:/run/{p.world.name}_{p.rank}.sock",
            labels=labels or {},
            mode=mode,
            pid=pid_,
            host=host,
            host_proc=pid(host_proc) if host_proc else None,
            incarnation=incarnation,
        )
        reply, instrs = self.send(msg, requester=p)
        if isinstance(reply, Joined):
            self.incarnations[p] = incarnation
        return reply, instrs

    def rejoin(
        self,
        proc: str,
        incarnation: int,
        world: UpsertWorld | None = None,
        execution_id: str = "alice-20240101-000000-abcd",
        pid_: int = 4242,
    ) -> tuple[Any, list[Any]]:
        """The proc of a previous system joins this one again (`Join.rejoin`)."""
        p = pid(proc)
        msg = Join(
            proc_id=p,
            addr=f"unix:/run/{p.world.name}_{p.rank}.sock",
            pid=pid_,
            host="node1",
            incarnation=incarnation,
            rejoin=True,
            execution_id=execution_id,
            world=world,
        )
        reply, instrs = self.send(msg, requester=p)
        if isinstance(reply, Joined):
            self.incarnations[p] = incarnation
        return reply, instrs

    def joined(self, proc: str, **kw: Any) -> list[Any]:
        reply, instrs = self.join(proc, **kw)
        assert isinstance(reply, Joined), reply
        return instrs

    def heartbeat(
        self,
        proc: str | ProcId,
        *,
        failed: Iterable[ActorFailure] = (),
        loop_lag_s: float = 0.0,
        arrived_at: float | None = None,
    ) -> list[Any]:
        p = pid(proc) if isinstance(proc, str) else proc
        state = ProcSupervisionState(
            proc_id=p,
            addr="",
            incarnation=self.incarnations.get(p, 0),
            failed_actors=list(failed),
            loop_lag_s=loop_lag_s,
        )
        reply, instrs = self.run(
            self.reg.handle(SupervisionUpdate(state=state), arrived_at=arrived_at)
        )
        assert reply is None
        return instrs

    def tick(self) -> list[Any]:
        return self.run(self.reg.handle_health_tick())[1]

    def advance(self, seconds: float, *, beat: Iterable[str] = (), step: float = 0.25) -> list[Any]:
        """Advance time in ticks of ``step``; procs in ``beat`` heartbeat every step."""
        out: list[Any] = []
        remaining = seconds
        while remaining > 1e-9:
            dt = min(step, remaining)
            self.clock.advance(dt)
            remaining -= dt
            for p in beat:
                out += self.heartbeat(p)
            out += self.tick()
        return out

    def upsert(
        self,
        name: str,
        shape: list[int],
        nph: int = 1,
        env: Any = None,
        labels: dict[str, str] | None = None,
    ) -> tuple[Any, list[Any]]:
        msg = UpsertWorld(
            world_id=wid(name),
            shape=shape,
            num_procs_per_host=nph,
            env=env if env is not None else Local(),
            labels=labels or {},
        )
        return self.send(msg)

    def snapshot(self, **flt: Any) -> SystemSnapshot:
        if "worlds" in flt:
            flt["worlds"] = [wid(w) for w in flt["worlds"]]
        reply = self.ok(Snapshot(filter=SnapshotFilter(**flt)))
        assert isinstance(reply, SystemSnapshot)
        return reply

    def world_state(self, name: str) -> Any:
        reply = self.ok(WorldState(world_id=wid(name)))
        assert isinstance(reply, WorldStateReply)
        return reply.state

    def health(self, proc: str) -> str:
        rec = self.reg.record(pid(proc))
        assert rec is not None
        return rec.health

    def answer_stops(self, instrs: Iterable[Any], skip: Iterable[str] = ()) -> list[Any]:
        """Answer every `ProcStop` ask in ``instrs`` like an agent (except ``skip``)."""
        skipped = {pid(s) for s in skip}
        out: list[Any] = []
        for ask in asks(instrs, ProcStop):
            p = ask.dest.proc
            if p in skipped:
                continue
            result = ProcStopResult(proc_id=p, stopped=[p.actor("comm")], aborted=[])
            out += self.run(self.reg.handle_reply(ask, result))[1]
        return out


def sends(instrs: Iterable[Any], kind: type | None = None, dest: Any = None) -> list[Send]:
    return [
        i
        for i in instrs
        if isinstance(i, Send)
        and (kind is None or isinstance(i.message, kind))
        and (dest is None or i.dest == dest)
    ]


def asks(instrs: Iterable[Any], kind: type | None = None) -> list[Ask]:
    return [
        i for i in instrs if isinstance(i, Ask) and (kind is None or isinstance(i.message, kind))
    ]


def events(instrs: Iterable[Any], port: PortId) -> list[Any]:
    return [i.message for i in instrs if isinstance(i, Send) and i.dest == port]


def logs(instrs: Iterable[Any], level: int | None = None) -> list[str]:
    return [i.text for i in instrs if isinstance(i, Log) and (level is None or i.level == level)]


def sub_port(proc: str = "controller[0]", port: int = 1025) -> PortId:
    return pid(proc).actor("root").port(port)


def live_world(h: Harness, name: str, size: int, **upsert: Any) -> None:
    """Upsert ``name`` with ``size`` procs and join them all: the world is Live."""
    reply, _ = h.upsert(name, [size], **upsert)
    assert isinstance(reply, WorldUpserted)
    for r in range(size):
        h.joined(f"{name}[{r}]", pid_=1000 + r, host=f"node{r}")
    assert h.reg.world(name).status == "Live"  # type: ignore[union-attr]


# --------------------------------------------------------------------------- messages


def test_messages_round_trip_through_msgpack() -> None:
    msgs = [
        Join(proc_id=pid("w[1]"), addr="tcp:127.0.0.1:5000", labels={"a": "b"}, incarnation=7),
        UpsertWorld(world_id=wid("w"), shape=[2, 3], num_procs_per_host=3, env=Exec(program="x")),
        UpsertWorld(world_id=wid("w"), shape=[1]),
        Stop(worlds=[wid("a")], proc_timeout_s=2.5),
        Stop(),
        PeerGone(proc_id=pid("w[3]"), health="Exited", reason="killed by signal 9 (SIGKILL)"),
        Rejected(code="conflict", message="x"),
        SpawnProcResult(
            started=[StartedProc(proc_id=pid("w[0]"), pid=1)],
            failed=[FailedProc(proc_id=pid("w[1]"), reason="cannot execute 'x'")],
        ),
        Snapshot(),
    ]
    for msg in msgs:
        data = msgspec.msgpack.encode(msg)
        assert msgspec.msgpack.decode(data, type=type(msg)) == msg
    assert Stop().proc_timeout_s == 5.0
    assert ProcStop().timeout_s == 5.0
    err = Rejected(code="not_found", message="proc w[9] is not known to the system").to_error()
    assert isinstance(err, SystemRequestError) and err.code == "not_found"


def test_host_rank_assignment_examples() -> None:
    assert list(host_ranks(0, 8, 12)) == list(range(8))
    assert list(host_ranks(1, 8, 12)) == list(range(8, 12))
    assert list(host_ranks(2, 8, 12)) == []
    assert list(host_ranks(0, 3, 6)) == [0, 1, 2]
    assert list(host_ranks(1, 3, 6)) == [3, 4, 5]


# --------------------------------------------------------------------------- registry and snapshot


def test_a3_fresh_snapshot_and_execution_id() -> None:
    h = Harness()
    snap = h.snapshot()
    assert snap.worlds == {}
    assert snap.execution_id == "alice-20240101-000000-abcd"
    assert execution_id_from_env({"PALATINE_EXECUTION_ID": "given-id"}) == "given-id"
    generated = execution_id_from_env({"USER": "bob"})
    parts = generated.rsplit("-", 3)
    assert len(parts) == 4 and len(parts[1]) == 8 and len(parts[2]) == 6 and len(parts[3]) == 4
    reg = SystemRegistry(FakeClock())
    assert reg.execution_id and reg.handle_snapshot(Snapshot())[0].execution_id == reg.execution_id


def test_a4_upsert_then_labelled_join() -> None:
    h = Harness()
    reply, _ = h.upsert("foo", [2], nph=5)
    assert isinstance(reply, WorldUpserted)
    assert reply.status.status == "Unhealthy"
    assert reply.status.reason == "waiting for procs: 0/2 joined"
    snap = h.snapshot()
    assert snap.worlds["foo"].status == "Unhealthy"
    assert snap.worlds["foo"].procs == {} and snap.worlds["foo"].host_procs == []
    h.joined("foo[1]", labels={"role": "worker", "zone": "a"})
    foo = h.snapshot().worlds["foo"]
    assert foo.status == "Unhealthy"
    assert foo.procs["foo[1]"].labels == {"role": "worker", "zone": "a"}
    assert h.reg.world("foo").reason == "waiting for procs: 1/2 joined"  # type: ignore[union-attr]


def test_a5_snapshot_filters() -> None:
    h = Harness()
    h.upsert("foo", [2], labels={"kind": "train"})
    h.upsert("bar", [1], labels={"kind": "eval"})
    h.joined("foo[0]", labels={"gpu": "1"})
    h.joined("foo[1]", labels={"gpu": "0"})
    h.joined("bar[0]", labels={"gpu": "1"})
    h.joined("user[9223372036854775809]", mode="Detached")
    assert h.snapshot(worlds=["none"]).worlds == {}
    assert list(h.snapshot(world_labels={"kind": "train"}).worlds) == ["foo"]
    assert h.snapshot(world_labels={"kind": "trai"}).worlds == {}
    assert h.snapshot(world_labels={"kind": "train", "x": "y"}).worlds == {}
    by_proc = h.snapshot(proc_labels={"gpu": "0"})
    assert list(by_proc.worlds) == ["bar", "foo"]
    assert by_proc.worlds["bar"].procs == {}
    assert list(by_proc.worlds["foo"].procs) == ["foo[1]"]
    everything = h.snapshot()
    assert list(everything.worlds) == ["bar", "foo"]
    assert list(everything.worlds["foo"].procs) == ["foo[0]", "foo[1]"]
    assert "user" not in everything.worlds
    assert list(h.snapshot(worlds=["foo"]).worlds) == ["foo"]


def test_a6_host_before_world() -> None:
    h = Harness()
    instrs = h.joined("hostworker[1]", labels={"proc.palatine.dev/role": "host"})
    assert (
        Bind(
            pid("hostworker[1]"), ChannelAddr.parse("unix:/run/hostworker_1.sock"), stimulus_id=ANY
        )
        in instrs
    )
    assert not asks(instrs, SpawnProc)
    worker = h.snapshot().worlds["worker"]
    assert worker.status == "AwaitingCreation"
    assert worker.host_procs == ["hostworker[1]"]
    assert worker.procs == {}
    assert "hostworker" not in h.snapshot().worlds
    assert h.world_state("worker") is None


def test_a7_upsert_with_hosts_then_live() -> None:
    h = Harness()
    h.joined("hostworker[1]")
    _, instrs = h.upsert("worker", [3, 4], nph=8, env=Local())
    (spawn1,) = asks(instrs, SpawnProc)
    assert spawn1.dest == agent_of(pid("hostworker[1]"))
    assert [a.rank for a in spawn1.message.procs] == [8, 9, 10, 11]
    for a in spawn1.message.procs:
        h.joined(str(a.proc_id), host_proc="hostworker[1]")
    assert list(h.snapshot().worlds["worker"].procs) == [f"worker[{r}]" for r in range(8, 12)]
    instrs = h.joined("hostworker[0]")
    (spawn0,) = asks(instrs, SpawnProc)
    assert [a.rank for a in spawn0.message.procs] == list(range(8))
    for a in spawn0.message.procs:
        h.joined(str(a.proc_id), host_proc="hostworker[0]")
    worker = h.snapshot().worlds["worker"]
    assert list(worker.procs) == [f"worker[{r}]" for r in range(12)]
    assert worker.status == "Live"
    assert worker.host_procs == ["hostworker[0]", "hostworker[1]"]


def test_a8_hosts_before_and_after_upsert_get_one_spawn_each() -> None:
    h = Harness()
    h.joined("hosttest[0]")
    _, instrs = h.upsert("test", [2, 3], nph=3, env=Local())
    instrs += h.joined("hosttest[1]")
    # More stimuli that must not re-send assignments.
    instrs += h.joined("hosttest[0]", incarnation=h.incarnations[pid("hosttest[0]")])
    instrs += h.advance(0.5, beat=["hosttest[0]", "hosttest[1]"])
    spawns = asks(instrs, SpawnProc)
    assert sorted(str(s.dest) for s in spawns) == ["hosttest[0].proc[0]", "hosttest[1].proc[0]"]
    union: list[ProcId] = []
    for s in spawns:
        msg = s.message
        assert isinstance(msg.env, Local) and msg.world_size == 6 and msg.local_world_size == 3
        assert [a.local_rank for a in msg.procs] == [0, 1, 2]
        union += [a.proc_id for a in msg.procs]
    assert sorted(union) == [pid(f"test[{r}]") for r in range(6)]


def test_a9_host_with_empty_range_gets_nothing() -> None:
    h = Harness()
    for r in range(3):
        h.joined(f"hostw[{r}]")
    _, instrs = h.upsert("w", [12], nph=8, env=Exec(program="palatine worker"))
    spawns = asks(instrs, SpawnProc)
    assert sorted(str(s.dest.proc) for s in spawns) == ["hostw[0]", "hostw[1]"]
    ranks = sorted(a.rank for s in spawns for a in s.message.procs)
    assert ranks == list(range(12))
    assert any("hostw[2] gets no procs" in t for t in logs(instrs, logging.INFO))


def test_a10_snapshot_json_has_exactly_the_documented_keys() -> None:
    h = Harness()
    h.joined("hostw[0]", host="node3")
    h.upsert("w", [2], nph=2, labels={"world.palatine.dev/worker": "1"})
    h.joined("w[0]", labels={"k": "v"}, host_proc="hostw[0]")
    h.run(
        h.reg.handle_proc_exited(
            ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), pid=99, exit_signal=9)
        )
    )
    h.heartbeat(
        "w[0]", failed=[ActorFailure(actor_id=pid("w[0]").actor("worker"), status="failed: boom")]
    )
    doc = msgspec.json.decode(msgspec.json.encode(h.snapshot()))
    assert list(doc) == ["execution_id", "worlds"]
    world = doc["worlds"]["w"]
    assert list(world) == ["status", "labels", "host_procs", "procs"]
    assert world["status"] in ("Live", "Unhealthy", "AwaitingCreation")
    assert world["host_procs"] == ["hostw[0]"]
    fixed = ["labels", "addr", "pid", "host", "health", "exit_code", "exit_signal", "failed_actors"]
    additions = [
        "reason",
        "host_proc",
        "last_heartbeat_age_s",
        "loop_lag_s",
        "activity",
        "counters",
        "resources",
    ]
    for entry in world["procs"].values():
        assert list(entry) == fixed + additions
    w0, w1 = world["procs"]["w[0]"], world["procs"]["w[1]"]
    assert w0["failed_actors"] == [{"actor_id": "w[0].worker[0]", "status": "failed: boom"}]
    assert w0["host_proc"] == "hostw[0]" and w0["health"] == "Alive"
    # A rank that failed before joining: no address, no labels, Exited.
    assert w1["addr"] == "" and w1["labels"] == {} and w1["health"] == "Exited"
    assert w1["exit_signal"] == 9 and w1["pid"] == 99 and w1["host"] == "node3"
    assert w1["last_heartbeat_age_s"] is None
    statuses = set()
    h.joined("hostv[0]")
    statuses.add(h.snapshot().worlds["v"].status)
    live_world(h, "u", 1)
    statuses.add(h.snapshot().worlds["u"].status)
    statuses.add(h.snapshot().worlds["w"].status)
    assert statuses == {"AwaitingCreation", "Live", "Unhealthy"}


def test_snapshot_human_rows() -> None:
    h = Harness()
    live_world(h, "w", 2)
    h.upsert("e", [1])
    rows = h.snapshot().rows()
    assert rows[0] == ("e", "Unhealthy", "", "", "", "", "", "")
    assert rows[1][:4] == ("w", "Live", "w[0]", "Alive") and rows[1][5] == "1000"


# --------------------------------------------------------------------------- errors instead of crashes


def test_a12_bad_upserts_then_snapshot_still_works() -> None:
    h = Harness()
    live_world(h, "w", 1)
    bad = [
        (
            UpsertWorld(world_id=wid("hostx"), shape=[1]),
            "invalid_argument",
            "world name 'hostx' is reserved: names starting with 'host' are host worlds",
        ),
        (UpsertWorld(world_id=wid("host"), shape=[1]), "invalid_argument", None),
        (UpsertWorld(world_id=wid("system"), shape=[1]), "invalid_argument", None),
        (UpsertWorld(world_id=wid("user"), shape=[1]), "invalid_argument", None),
        (UpsertWorld(world_id=wid("unknown"), shape=[1]), "invalid_argument", None),
        (UpsertWorld(world_id=wid("bad-name"), shape=[1]), "invalid_argument", None),
        (
            UpsertWorld(world_id=wid("w"), shape=[1]),
            "already_exists",
            "cannot create world w: already exists (status Live)",
        ),
        (UpsertWorld(world_id=wid("z"), shape=[0]), "invalid_argument", None),
        (UpsertWorld(world_id=wid("z"), shape=[]), "invalid_argument", None),
        (UpsertWorld(world_id=wid("z"), shape=[2], num_procs_per_host=0), "invalid_argument", None),
        (
            UpsertWorld(world_id=wid("z"), shape=[2], num_procs_per_host=10**12),
            "invalid_argument",
            "invalid num_procs_per_host 1000000000000: expected 1 to 4,096",
        ),
        (
            UpsertWorld(world_id=wid("z"), shape=[2] * 2000),
            "invalid_argument",
            "invalid shape: a world has at most 1,048,576 procs",
        ),
        (
            UpsertWorld(world_id=wid("z"), shape=[2], env=Exec(program="  ")),
            "invalid_argument",
            None,
        ),
        (
            UpsertWorld(world_id=wid("z"), shape=[2], env=Exec(program="'unclosed")),
            "invalid_argument",
            None,
        ),
    ]
    for msg, code, text in bad:
        reply = h.rejected(msg, code)
        if text is not None:
            assert reply.message == text
        assert "w" in h.snapshot().worlds
    assert (
        "shape" in h.rejected(UpsertWorld(world_id=wid("z"), shape=[0]), "invalid_argument").message
    )
    assert (
        "num_procs_per_host"
        in h.rejected(
            UpsertWorld(world_id=wid("z"), shape=[1], num_procs_per_host=0), "invalid_argument"
        ).message
    )
    assert "z" not in h.snapshot().worlds


def test_a13_duplicate_live_host_conflict_then_restart() -> None:
    h = Harness()
    h.upsert("w", [2], nph=2)
    first = h.joined("hostw[0]", pid_=812, host="node3", addr="tcp:10.0.0.3:4000")
    assert len(asks(first, SpawnProc)) == 1
    msg = Join(
        proc_id=pid("hostw[0]"), addr="tcp:10.0.0.3:4001", pid=900, host="node3", incarnation=77
    )
    reply, instrs = h.send(msg)
    assert isinstance(reply, JoinProbeNeeded)
    assert reply.probe.addr == ChannelAddr.parse("tcp:10.0.0.3:4000")
    reply, instrs = h.run(h.reg.complete_join(msg, reply.probe, "connected"))
    assert isinstance(reply, Rejected) and reply.code == "conflict"
    assert reply.message == (
        "proc hostw[0] is already joined from tcp:10.0.0.3:4000 (pid 812 on node3); stop it first"
    )
    assert "w" in h.snapshot().worlds
    # The first host is SIGKILLed: its connection closes and its address refuses.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("hostw[0]")))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    h.run(h.reg.handle_probe_result(probe, "refused"))
    assert h.health("hostw[0]") == "ConnectionFailure"
    reply, instrs = h.send(msg)
    assert isinstance(reply, Joined)
    (spawn,) = asks(instrs, SpawnProc)
    assert [a.rank for a in spawn.message.procs] == [0, 1]


def test_duplicate_join_whose_old_process_is_gone_replaces_it() -> None:
    h = Harness()
    h.joined("w[0]", addr="unix:/a", incarnation=1)
    msg = Join(proc_id=pid("w[0]"), addr="unix:/b", incarnation=2)
    reply, _ = h.send(msg)
    assert isinstance(reply, JoinProbeNeeded)
    reply, instrs = h.run(h.reg.complete_join(msg, reply.probe, "timeout"))
    assert isinstance(reply, Joined)
    assert Bind(pid("w[0]"), ChannelAddr.parse("unix:/b"), stimulus_id=ANY) in instrs
    assert h.reg.record(pid("w[0]")).incarnation == 2  # type: ignore[union-attr]
    # A retried join of the same incarnation is answered again without a probe.
    reply, _ = h.send(msg)
    assert isinstance(reply, Joined)


def test_a14_bad_joins() -> None:
    h = Harness()
    h.upsert("W", [8])
    assert h.rejected(Join(proc_id=pid("W[9]"), addr="unix:/x"), "invalid_argument").message == (
        "rank 9 out of range for world W of size 8"
    )
    for proc, mode in [
        ("system[0]", "ManagedBySystem"),
        ("unknown[0]", "ManagedBySystem"),
        ("user[5]", "ManagedBySystem"),
        ("host[0]", "ManagedBySystem"),
        ("hostsystem[0]", "ManagedBySystem"),
        ("W[1]", "Bogus"),
    ]:
        h.rejected(Join(proc_id=pid(proc), addr="unix:/x", mode=mode), "invalid_argument")
    h.rejected(Join(proc_id=pid("W[1]"), addr=""), "invalid_argument")
    reply = h.rejected(Join(proc_id=pid("W[1]"), addr="not an address"), "invalid_argument")
    assert reply.message.startswith("join of W[1]: invalid address 'not an address': ")
    for any_addr in ("unix:", "tcp:127.0.0.1:0"):  # addresses to serve on, not to dial
        reply = h.rejected(Join(proc_id=pid("W[1]"), addr=any_addr), "invalid_argument")
        assert reply.message.startswith(f"join of W[1]: address '{any_addr}' cannot be dialed")
    assert "W" not in h.snapshot().worlds or not h.snapshot().worlds["W"].procs  # nothing recorded
    assert isinstance(h.join("user[12345]", mode="Detached")[0], Joined)
    reply, out = h.join("user[12346]", mode="Detached", addr="")  # no address: no route to bind
    assert isinstance(reply, Joined) and not [i for i in out if type(i).__name__ == "Bind"]
    live_world(h, "other", 1)
    h.ok(Stop())
    reply = h.rejected(Join(proc_id=pid("W[1]"), addr="unix:/x"), "shutting_down")
    assert reply.message == "system is shutting down"
    h.rejected(UpsertWorld(world_id=wid("new"), shape=[1]), "shutting_down")
    h.snapshot()


def test_join_into_world_being_stopped_or_evicted_is_a_conflict() -> None:
    h = Harness()
    live_world(h, "a", 2)
    h.ok(Stop(worlds=[wid("a")]))
    assert (
        "being stopped"
        in h.rejected(Join(proc_id=pid("a[0]"), addr="unix:/n", incarnation=99), "conflict").message
    )
    assert (
        "being stopped"
        in h.rejected(Join(proc_id=pid("hosta[0]"), addr="unix:/n"), "conflict").message
    )
    live_world(h, "b", 2)
    h.run(h.reg.handle_proc_exited(ProcExited(proc_id=pid("b[0]"), exit_code=1)))
    h.advance(1.25, beat=["b[1]"])
    assert h.reg.world("b").phase == "evicting"  # type: ignore[union-attr]
    assert (
        "being evicted"
        in h.rejected(Join(proc_id=pid("b[0]"), addr="unix:/n", incarnation=5), "conflict").message
    )
    h.rejected(UpsertWorld(world_id=wid("b"), shape=[1]), "conflict")


def test_a15_stop_of_unknown_world_changes_nothing() -> None:
    h = Harness()
    live_world(h, "w", 2)
    before = msgspec.json.encode(h.snapshot())
    reply, instrs = h.send(Stop(worlds=[wid("nope")]))
    assert reply == StopAck(stopping=[], already_stopping=[], unknown=[wid("nope")])
    assert not asks(instrs) and not sends(instrs)
    assert msgspec.json.encode(h.snapshot()) == before


def test_stop_with_an_endless_or_negative_proc_timeout_is_refused() -> None:
    h = Harness()
    live_world(h, "w", 2)
    before = msgspec.json.encode(h.snapshot())
    for bad in (float("inf"), float("nan"), -1.0):
        reply = h.rejected(Stop(worlds=[wid("w")], proc_timeout_s=bad), "invalid_argument")
        assert "expected a finite number >= 0" in reply.message
    assert msgspec.json.encode(h.snapshot()) == before  # nothing is being stopped


def test_a16_heartbeat_from_unknown_proc_is_told_to_stop_rate_limited() -> None:
    h = Harness()
    instrs = h.heartbeat("ghost[3]")
    (stop,) = sends(instrs, ProcStop)
    assert stop.dest == agent_of(pid("ghost[3]"))
    assert stop.message.reason == "unknown to the system"
    h.clock.advance(5)
    assert not sends(h.heartbeat("ghost[3]"), ProcStop)
    h.clock.advance(5)
    assert sends(h.heartbeat("ghost[3]"), ProcStop)
    assert h.snapshot().worlds == {}


def test_other_bad_requests() -> None:
    h = Harness()
    reply, _ = h.send(Resolve(proc_id=pid("W[9]")))
    assert reply == Rejected(code="not_found", message="proc W[9] is not known to the system")
    assert h.world_state("nothing") is None
    h.rejected(Stop(proc_timeout_s=-1), "invalid_argument")
    h.rejected(Subscribe(world_id=wid("bad-name"), port=sub_port()), "invalid_argument")
    reply, _ = h.send(Ok())
    assert isinstance(reply, Rejected) and reply.code == "invalid_argument"
    assert h.ok(Leave(proc_id=pid("never[0]"))) == Ok()
    assert h.ok(Unsubscribe(world_id=wid("w"), port=sub_port())) == Ok()
    assert h.ok(ProcExited(proc_id=pid("never[0]"), exit_code=1)) == Ok()
    h.snapshot()


# --------------------------------------------------------------------------- supervision and detection


def test_a17_world_state_lists_expired_proc_with_its_fields() -> None:
    h = Harness()
    assert h.world_state("w") is None
    live_world(h, "w", 2)
    state = h.world_state("w")
    assert state.procs == {} and state.status.status == "Live"
    h.advance(1.0, beat=["w[0]", "w[1]"])
    # w[1] goes silent; the query itself applies the expiry rule.
    h.advance(0.75, beat=["w[0]"])
    h.clock.advance(0.35)
    h.heartbeat("w[0]")
    state = h.world_state("w")
    assert list(state.procs) == [1]
    st1 = state.procs[1]
    assert st1.health == "Expired"
    assert (st1.proc_id, st1.addr, st1.pid, st1.host) == (
        pid("w[1]"),
        "unix:/run/w_1.sock",
        1001,
        "node1",
    )
    assert st1.reason == "no heartbeat for 1.1 s (timeout 1 s)"
    assert state.status.status == "Unhealthy"


def test_a18_exit_by_signal_reported_exactly_once() -> None:
    h = respawnable_world()
    port = sub_port()
    sub, _ = h.send(Subscribe(world_id=wid("w"), port=port))
    assert isinstance(sub, Subscribed) and sub.state.procs == {}
    h.ok(Resolve(proc_id=pid("w[0]")), requester=pid("w[1]"))
    _, instrs = h.send(
        ProcExited(proc_id=pid("w[0]"), host_proc=pid("hostw[0]"), pid=812, exit_signal=9)
    )
    rec = h.reg.record(pid("w[0]"))
    assert rec.health == "Exited" and rec.exit_signal == 9  # type: ignore[union-attr]
    assert rec.reason == "killed by signal 9 (SIGKILL)"  # type: ignore[union-attr]
    evs = events(instrs, port)
    assert [type(e) for e in evs] == [ProcFailed, WorldStatusChanged]
    assert evs[0].rank == 0 and evs[0].state.exit_signal == 9
    assert evs[1].status == "Unhealthy"
    assert evs[1].reason == "w[0] (pid 812 on node3) was killed by signal 9"
    (gone,) = sends(instrs, PeerGone)
    assert gone.dest == agent_of(pid("w[1]"))
    assert gone.message == PeerGone(
        proc_id=pid("w[0]"),
        health="Exited",
        reason="killed by signal 9 (SIGKILL)",
        exit_code=None,
        exit_signal=9,
        pid=812,
        host="node3",
    )
    # The connection loss that follows and later ticks report nothing more.
    later = h.run(h.reg.handle_connection_lost(pid("w[0]")))[1]
    later += h.advance(0.75, beat=["w[1]", "hostw[0]"])
    assert not [e for e in events(later, port) if isinstance(e, ProcFailed)]
    reply, _ = h.send(Resolve(proc_id=pid("w[0]")))
    assert reply.message == "peer gone: w[0] (pid 812 on node3) was killed by signal 9"


def test_a19_exit_code_and_stderr_tail() -> None:
    h = Harness()
    h.joined("hostw[0]")
    h.upsert("w", [1], env=Exec(program="palatine worker"))
    h.joined("w[0]", pid_=4243, host_proc="hostw[0]")
    h.send(
        ProcExited(proc_id=pid("w[0]"), pid=4243, exit_code=3, stderr_tail=["Traceback", "boom"])
    )
    (entry,) = h.snapshot().worlds["w"].procs.values()
    assert (
        entry.health == "Exited" and entry.exit_code == 3 and entry.reason == "exited with code 3"
    )
    assert h.world_state("w").procs[0].stderr_tail == ["Traceback", "boom"]


def test_stale_exit_report_of_another_pid_is_ignored() -> None:
    h = Harness()
    live_world(h, "w", 1)
    h.send(ProcExited(proc_id=pid("w[0]"), pid=1, exit_code=3))
    assert h.health("w[0]") == "Alive"


def test_a20_connection_loss_of_external_worker_and_probe() -> None:
    h = Harness()
    live_world(h, "w", 2)
    # A transient drop: the address still answers.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[0]")))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    assert probe.timeout_s == 1.0 and probe.addr == ChannelAddr.parse("unix:/run/w_0.sock")
    h.run(h.reg.handle_probe_result(probe, "connected"))
    assert h.health("w[0]") == "Alive"
    # A probe without a verdict leaves it to the silence path.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[0]")))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    h.run(h.reg.handle_probe_result(probe, "timeout"))
    assert h.health("w[0]") == "Alive"
    # SIGKILL: refused.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[0]")))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    assert not [
        i for i in h.run(h.reg.handle_connection_lost(pid("w[0]")))[1] if isinstance(i, Probe)
    ]
    h.run(h.reg.handle_probe_result(probe, "refused"))
    rec = h.reg.record(pid("w[0]"))
    assert rec.health == "ConnectionFailure"  # type: ignore[union-attr]
    assert rec.reason == "connection lost; its address unix:/run/w_0.sock refuses connections"  # type: ignore[union-attr]


def test_a_lost_connection_whose_address_still_answers_is_probed_once_more() -> None:
    h = Harness()
    live_world(h, "w", 2)
    # A dying process may release its connections before its listener.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[0]")))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    _, instrs = h.run(h.reg.handle_probe_result(probe, "connected"))
    (timer,) = [i for i in instrs if isinstance(i, Timer)]
    assert timer.delay_s == PROBE_AGAIN_S and isinstance(timer.token, ProbeAgain)
    assert h.health("w[0]") == "Alive"
    _, instrs = h.run(h.reg.handle_timer(timer.token))
    (again,) = [i for i in instrs if isinstance(i, Probe)]
    assert again.recheck and again.addr == probe.addr
    h.run(h.reg.handle_probe_result(again, "refused"))
    assert h.health("w[0]") == "ConnectionFailure"
    # A proc that answers both times is left to the silence path: no third probe.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[1]")))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    _, instrs = h.run(h.reg.handle_probe_result(probe, "connected"))
    (timer,) = [i for i in instrs if isinstance(i, Timer)]
    _, instrs = h.run(h.reg.handle_timer(timer.token))
    (again,) = [i for i in instrs if isinstance(i, Probe)]
    _, instrs = h.run(h.reg.handle_probe_result(again, "connected"))
    assert not [i for i in instrs if isinstance(i, (Probe, Timer))]
    assert h.health("w[1]") == "Alive"
    # A token outliving its proc's verdict probes nothing.
    stale = ProbeAgain(pid("w[0]"), again.incarnation, again.addr)
    assert not [i for i in h.run(h.reg.handle_timer(stale))[1] if isinstance(i, Probe)]


def test_exit_report_grace_prefers_the_precise_cause() -> None:
    h = Harness()
    h.joined("hostw[0]", host="node3")
    h.upsert("w", [2], nph=2)
    h.joined("w[0]", pid_=812, host="node3", host_proc="hostw[0]")
    h.joined("w[1]", pid_=813, host="node3", host_proc="hostw[0]")
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[0]")))
    (timer,) = [i for i in instrs if isinstance(i, Timer)]
    assert timer.delay_s == 0.5 and isinstance(timer.token, ExitReportGrace)
    assert not [i for i in instrs if isinstance(i, Probe)]
    h.send(ProcExited(proc_id=pid("w[0]"), pid=812, exit_signal=9))
    _, instrs = h.run(h.reg.handle_timer(timer.token))
    assert not [i for i in instrs if isinstance(i, Probe)]
    assert h.reg.record(pid("w[0]")).reason == "killed by signal 9 (SIGKILL)"  # type: ignore[union-attr]
    # Without a report the grace ends in a probe.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[1]")))
    (timer,) = [i for i in instrs if isinstance(i, Timer)]
    h.clock.advance(0.5)
    _, instrs = h.run(h.reg.handle_timer(timer.token))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    h.run(h.reg.handle_probe_result(probe, "refused"))
    assert h.health("w[1]") == "ConnectionFailure"


def test_a21_sigstop_expires_then_zombie_is_told_to_stop() -> None:
    h = Harness(wall_clock=lambda: time.mktime((2024, 1, 1, 12, 3, 4, 0, 0, -1)))
    live_world(h, "w", 2)
    port = sub_port()
    h.send(Subscribe(world_id=wid("w"), port=port))
    h.advance(1.0, beat=["w[0]", "w[1]"])
    # SIGSTOP: silent from now; expired by timeout (1 s) + one tick (0.25 s).
    instrs = h.advance(1.0, beat=["w[0]"])
    assert h.health("w[1]") == "Alive"
    instrs += h.advance(0.25, beat=["w[0]"])
    assert h.health("w[1]") == "Expired"
    assert [type(e) for e in events(instrs, port)] == [ProcFailed, WorldStatusChanged]
    # SIGCONT: heartbeats arrive again, are ignored, and the zombie is told to stop.
    instrs = h.heartbeat("w[1]")
    (stop,) = sends(instrs, ProcStop)
    assert stop.dest == agent_of(pid("w[1]"))
    assert stop.message.reason.startswith("declared Expired at 12:03:04: no heartbeat for ")
    assert h.health("w[1]") == "Expired"
    assert not sends(h.heartbeat("w[1]"), ProcStop)  # rate limited
    assert not [
        e for e in events(h.advance(0.5, beat=["w[0]", "w[1]"]), port) if isinstance(e, ProcFailed)
    ]


def test_expiry_detected_within_timeout_plus_one_tick() -> None:
    h = Harness()
    live_world(h, "w", 1)
    h.heartbeat("w[0]")
    last = h.clock.now
    while h.health("w[0]") == "Alive":
        h.clock.advance(0.05)
        if round((h.clock.now - last) / 0.05) % 5 == 0:  # a tick every 0.25 s
            h.tick()
    assert 1.0 < h.clock.now - last <= 1.25 + 1e-9


def test_a22_busy_proc_keeps_heartbeating_and_reports_loop_lag() -> None:
    h = Harness()
    live_world(h, "w", 1)
    for _ in range(15):  # 3 s at 0.2 s heartbeats from the thread
        h.clock.advance(0.2)
        h.heartbeat("w[0]", loop_lag_s=h.clock.now - 1000.0)
        h.tick()
    assert h.health("w[0]") == "Alive"
    entry = h.snapshot().worlds["w"].procs["w[0]"]
    assert entry.loop_lag_s == pytest.approx(3.0)
    assert entry.last_heartbeat_age_s == 0.0


def test_heartbeat_time_is_arrival_time_not_processing_time() -> None:
    h = Harness()
    live_world(h, "w", 1)
    arrived = h.clock.now + 0.9
    h.clock.advance(1.5)  # the SystemActor was backlogged
    h.heartbeat("w[0]", arrived_at=arrived)
    h.tick()
    assert h.health("w[0]") == "Alive"


def test_a24_failed_actor_reported_at_once_and_only_once() -> None:
    h = Harness()
    live_world(h, "w", 2)
    port = sub_port()
    h.send(Subscribe(world_id=wid("w"), port=port))
    h.ok(Resolve(proc_id=pid("w[1]")), requester=pid("w[0]"))
    failure = ActorFailure(
        actor_id=pid("w[1]").actor("worker"),
        status="failed: serving w[1].worker[0]: processing error: boom",
        message="boom",
    )
    instrs = h.heartbeat("w[1]", failed=[failure])
    evs = events(instrs, port)
    assert [type(e) for e in evs] == [ProcFailed, WorldStatusChanged]
    assert evs[0].state.failed_actors == [failure] and evs[0].state.health == "Alive"
    assert evs[1].reason == (
        "w[1] (pid 1001 on node1): actor w[1].worker[0] failed: serving w[1].worker[0]: "
        "processing error: boom"
    )
    assert not sends(instrs, PeerGone)  # failed actors alone do not make a peer gone
    assert h.snapshot().worlds["w"].status == "Unhealthy"
    second = ActorFailure(actor_id=pid("w[1]").actor("other"), status="failed: again")
    instrs = h.heartbeat("w[1]", failed=[failure, second])
    assert not events(instrs, port)
    assert [f.actor_id.name for f in h.world_state("w").procs[1].failed_actors] == [
        "worker",
        "other",
    ]


def test_a25_silent_managing_system_proc_stops_the_system() -> None:
    h = Harness()
    h.joined("launcher[0]", mode="ManagingSystem")
    live_world(h, "w", 1)
    port = sub_port("w[0]")
    h.send(Subscribe(world_id=wid("w"), port=port))
    instrs = h.advance(1.5, beat=["w[0]"])
    assert h.reg.shutting_down
    assert SystemStopping in [type(e) for e in events(instrs, port)]
    stops = asks(instrs, ProcStop)
    assert [s.dest.proc for s in stops] == [pid("w[0]")]
    # The silent launcher is told to stop too (it may be frozen), but nobody waits for it.
    assert [s.dest.proc for s in sends(instrs, ProcStop)] == [pid("launcher[0]")]
    instrs = h.answer_stops(stops)
    assert [i for i in instrs if isinstance(i, StopSystem)]
    assert h.reg.stopped


def test_a26_subscription_events_in_order() -> None:
    h = Harness()
    live_world(h, "w", 2)
    port = sub_port()
    sub, _ = h.send(Subscribe(world_id=wid("w"), port=port))
    assert sub.state.status.status == "Live" and sub.state.procs == {}
    instrs = h.send(ProcExited(proc_id=pid("w[1]"), exit_signal=9))[1]
    instrs += h.advance(2.0, beat=["w[0]"])
    stops = asks(instrs, ProcStop)
    instrs += h.answer_stops(stops)
    evs = events(instrs, port)
    assert [type(e) for e in evs] == [ProcFailed, WorldStatusChanged, WorldGone]
    assert evs[1].status == "Unhealthy"
    assert evs[2].reason.startswith("evicted: unhealthy for ")
    assert h.reg.subscribers("w") == []
    assert h.ok(Unsubscribe(world_id=wid("w"), port=port)) == Ok()


def test_unsubscribe_and_returned_push_end_a_subscription() -> None:
    h = Harness()
    live_world(h, "w", 2)
    p1, p2 = sub_port("user[99]", 1025), sub_port("user[98]", 1026)
    h.send(Subscribe(world_id=wid("w"), port=p1))
    h.send(Subscribe(world_id=wid("w"), port=p2))
    h.ok(Unsubscribe(world_id=wid("w"), port=p1))
    h.run(h.reg.handle_returned(p2, ["mailbox error: port not bound"]))
    assert h.reg.subscribers("w") == []
    instrs = h.send(ProcExited(proc_id=pid("w[1]"), exit_code=1))[1]
    assert not events(instrs, p1) and not events(instrs, p2)


def test_a27_rejoin_after_failure_replaces_record_and_world_is_live_again() -> None:
    h = Harness()
    live_world(h, "w", 2)
    port = sub_port()
    h.send(Subscribe(world_id=wid("w"), port=port))
    h.send(ProcExited(proc_id=pid("w[1]"), exit_code=1))
    assert h.snapshot().worlds["w"].status == "Unhealthy"
    instrs = h.joined("w[1]", pid_=5555, addr="unix:/run/new.sock")
    assert h.health("w[1]") == "Alive"
    assert h.snapshot().worlds["w"].status == "Live"
    assert h.reg.world("w").failing_since is None  # type: ignore[union-attr]
    changes = [e for e in events(instrs, port) if isinstance(e, WorldStatusChanged)]
    assert [c.status for c in changes] == ["Live"]
    # The new incarnation fails: it is reported again (once per incarnation).
    instrs = h.send(ProcExited(proc_id=pid("w[1]"), pid=5555, exit_code=2))[1]
    assert len([e for e in events(instrs, port) if isinstance(e, ProcFailed)]) == 1


def test_a44_host_killed_reasons_name_the_host() -> None:
    h = Harness()
    h.joined("hostworker[0]", host="node3")
    h.upsert("worker", [2], nph=2, env=Exec(program="palatine worker"))
    for r in range(2):
        h.joined(f"worker[{r}]", pid_=900 + r, host="node3", host_proc="hostworker[0]")
    port = sub_port()
    host_port = sub_port(port=1030)
    h.send(Subscribe(world_id=wid("worker"), port=port))
    h.send(Subscribe(world_id=wid("hostworker"), port=host_port))
    instrs: list[Any] = []
    for p in ["hostworker[0]", "worker[0]", "worker[1]"]:
        instrs += h.run(h.reg.handle_connection_lost(pid(p)))[1]
    (host_probe,) = [i for i in instrs if isinstance(i, Probe)]
    assert host_probe.proc_id == pid("hostworker[0]")
    timers = [i for i in instrs if isinstance(i, Timer)]
    assert len(timers) == 2
    out = h.run(h.reg.handle_probe_result(host_probe, "refused"))[1]
    assert [type(e) for e in events(out, host_port)] == [ProcFailed]
    assert h.world_state("hostworker").procs[0].health == "ConnectionFailure"
    h.clock.advance(0.5)
    for t in timers:
        (probe,) = [i for i in h.run(h.reg.handle_timer(t.token))[1] if isinstance(i, Probe)]
        out += h.run(h.reg.handle_probe_result(probe, "refused"))[1]
    for r in range(2):
        assert h.reg.record(pid(f"worker[{r}]")).reason == (  # type: ignore[union-attr]
            "connection lost (its host hostworker[0] on node3 was lost at the same time)"
        )
    assert len([e for e in events(out, port) if isinstance(e, ProcFailed)]) == 2


def test_returned_message_marks_connection_failure() -> None:
    h = Harness()
    live_world(h, "w", 2)
    h.run(h.reg.handle_returned(agent_of(pid("w[0]")), ["mailbox error: no actor"]))
    assert h.health("w[0]") == "Alive"
    h.run(h.reg.handle_returned(agent_of(pid("w[0]")), ["broken link: delivery timeout after 1 s"]))
    assert h.health("w[0]") == "ConnectionFailure"
    assert "broken link: delivery timeout" in h.reg.record(pid("w[0]")).reason  # type: ignore[union-attr]


def test_leave_while_live_is_exited_and_connection_loss_after_is_ignored() -> None:
    h = Harness()
    live_world(h, "w", 2)
    h.ok(Leave(proc_id=pid("w[0]"), reason="SIGTERM"))
    rec = h.reg.record(pid("w[0]"))
    assert rec.health == "Exited" and rec.reason == "left: SIGTERM"  # type: ignore[union-attr]
    _, instrs = h.run(h.reg.handle_connection_lost(pid("w[0]")))
    assert instrs == []
    # A detached client's leave forgets it.
    h.joined("user[77]", mode="Detached")
    h.ok(Resolve(proc_id=pid("user[77]")), requester=pid("w[1]"))
    _, instrs = h.send(Leave(proc_id=pid("user[77]")))
    assert sends(instrs, PeerGone) and Unbind(pid("user[77]"), stimulus_id=ANY) in instrs
    assert h.reg.record(pid("user[77]")) is None


# --------------------------------------------------------------------------- eviction and stop


def test_a28_eviction_of_a_failed_world() -> None:
    h = Harness()
    h.joined("hostw[0]", host="node3")
    h.upsert("w", [3], nph=3, env=Exec(program="palatine worker"))
    for r in range(3):
        h.joined(f"w[{r}]", pid_=810 + r, host="node3", host_proc="hostw[0]")
    port = sub_port()
    h.send(Subscribe(world_id=wid("w"), port=port))
    h.ok(Resolve(proc_id=pid("w[1]")), requester=pid("user[5]"))
    h.send(ProcExited(proc_id=pid("w[2]"), pid=812, exit_signal=9))
    failed_at = h.clock.now
    instrs = h.advance(0.75, beat=["w[0]", "w[1]", "hostw[0]"])
    assert not asks(instrs, ProcStop)
    instrs = h.advance(0.5, beat=["w[0]", "w[1]", "hostw[0]"])
    assert 1.0 <= h.clock.now - failed_at <= 1.25 + 1e-9
    warnings = logs(instrs, logging.WARNING)
    assert (
        "evicting world w: unhealthy for 1.0 s (w[2] (pid 812 on node3) was killed by signal 9)"
        in warnings
    )
    stops = asks(instrs, ProcStop)
    assert sorted(s.dest.proc for s in stops) == [pid("w[0]"), pid("w[1]")]
    assert all(s.message.reason.startswith("world w evicted: ") for s in stops)
    (kill,) = asks(instrs, KillProcs)
    assert kill.dest == agent_of(pid("hostw[0]")) and kill.message.world_id == wid("w")
    # Exits of evicted procs are expected, not failures.
    out = h.send(ProcExited(proc_id=pid("w[0]"), pid=810, exit_signal=15))[1]
    assert not events(out, port)
    out = h.answer_stops(stops)
    assert Unbind(wid("w"), stimulus_id=ANY) in out
    assert [type(e) for e in events(out, port)] == [WorldGone]
    assert events(out, port)[0].reason.startswith("evicted: unhealthy for 1.0 s")
    assert [s.dest for s in sends(out, PeerGone)] == [agent_of(pid("user[5]"))]
    assert h.world_state("w") is None
    w = h.snapshot().worlds["w"]
    assert w.status == "AwaitingCreation" and w.host_procs == ["hostw[0]"] and w.procs == {}
    # Re-upserting re-creates it and the host gets its assignment again.
    _, instrs = h.upsert("w", [3], nph=3, env=Exec(program="palatine worker"))
    assert len(asks(instrs, SpawnProc)) == 1


def test_a29_world_waiting_for_joins_is_never_evicted() -> None:
    h = Harness()
    h.upsert("w", [4])
    h.joined("w[0]")
    instrs = h.advance(5.0, beat=["w[0]"])
    assert not asks(instrs, ProcStop)
    assert h.reg.world("w").phase == "active"  # type: ignore[union-attr]
    assert h.snapshot().worlds["w"].status == "Unhealthy"


def test_eviction_fallback_removes_world_when_stops_go_unanswered() -> None:
    h = Harness()
    live_world(h, "w", 2)
    h.send(ProcExited(proc_id=pid("w[1]"), exit_code=1))
    instrs = h.advance(1.25, beat=["w[0]"])
    (timer,) = [i for i in instrs if isinstance(i, Timer) and isinstance(i.token, StopFallback)]
    assert timer.delay_s == 1.0 + 3.0
    h.clock.advance(timer.delay_s)
    out = h.run(h.reg.handle_timer(timer.token))[1]
    assert any("no answer from w[0]" in t for t in logs(out, logging.WARNING))
    assert "w" not in h.snapshot().worlds


def test_a30_stop_everything_on_an_empty_system() -> None:
    h = Harness()
    reply, instrs = h.send(Stop())
    assert reply == StopAck()
    assert [i for i in instrs if isinstance(i, StopSystem)]
    assert h.reg.stopped


def test_a31_stop_one_world_leaves_the_others() -> None:
    h = Harness()
    h.joined("hostworker[0]")
    h.joined("hostworker[1]")
    live_world(h, "worker", 2)
    live_world(h, "foo", 2)
    reply, instrs = h.send(Stop(worlds=[wid("foo")], proc_timeout_s=1.0))
    assert reply == StopAck(stopping=[wid("foo")])
    stops = asks(instrs, ProcStop)
    assert sorted(s.dest.proc for s in stops) == [pid("foo[0]"), pid("foo[1]")]
    timer = next(i for i in instrs if isinstance(i, Timer))
    assert timer.delay_s == 4.0
    assert stops[0].timeout_s == 1.0 + 1.0
    out = h.answer_stops(stops)
    assert "foo" not in h.snapshot().worlds
    assert {"worker"} == set(h.snapshot().worlds)
    assert h.snapshot().worlds["worker"].host_procs == ["hostworker[0]", "hostworker[1]"]
    assert not [i for i in out if isinstance(i, StopSystem)] and not h.reg.stopped
    # Unknown to the system after the stop: the stopped procs' late heartbeats get ProcStop.
    assert sends(h.heartbeat("foo[0]"), ProcStop)


def test_a32_stop_world_with_hosts_completes_through_results() -> None:
    h = Harness()
    h.joined("hostworker[0]")
    h.joined("hostworker[1]")
    h.upsert("worker", [4], nph=2, env=Exec(program="palatine worker"))
    for r in range(4):
        h.joined(f"worker[{r}]", host_proc=f"hostworker[{r // 2}]")
    port = sub_port()
    h.send(Subscribe(world_id=wid("hostworker"), port=port))
    reply, instrs = h.send(Stop(worlds=[wid("worker")], proc_timeout_s=5))
    assert reply.stopping == [wid("worker")]
    stops = asks(instrs, ProcStop)
    assert sorted(str(s.dest.proc) for s in stops) == [
        "hostworker[0]",
        "hostworker[1]",
        "worker[0]",
        "worker[1]",
        "worker[2]",
        "worker[3]",
    ]
    # The hosts kill their children (expected exits), then everyone answers.
    for r in range(4):
        assert not events(h.send(ProcExited(proc_id=pid(f"worker[{r}]"), exit_signal=15))[1], port)
    out = h.answer_stops(stops)
    assert "worker" not in h.snapshot().worlds
    assert h.reg.record(pid("hostworker[0]")) is None
    assert (
        Unbind(wid("hostworker"), stimulus_id=ANY) in out
        and Unbind(wid("worker"), stimulus_id=ANY) in out
    )
    assert [type(e) for e in events(out, port)] == [WorldGone]
    assert h.clock.now < 1000.0 + 8  # no fallback timer was needed


def test_a33_stop_everything_replies_first_then_stops_all_then_the_system() -> None:
    h = Harness()
    h.joined("hostworker[0]")
    h.upsert("worker", [2], nph=2)
    for r in range(2):
        h.joined(f"worker[{r}]", host_proc="hostworker[0]")
    h.joined("controller[0]", labels={"proc.palatine.dev/role": "controller"})
    h.upsert("controller", [1])
    h.joined("mgr[0]", mode="ManagingSystem")
    h.joined("user[123]", mode="Detached")
    port = sub_port()
    h.send(Subscribe(world_id=wid("worker"), port=port))
    reply, instrs = h.send(Stop())
    assert isinstance(reply, StopAck)
    assert reply.stopping == [wid("controller"), wid("worker")]
    assert events(instrs, port)[0] == SystemStopping(reason="stop requested")
    stops = asks(instrs, ProcStop)
    assert sorted(str(s.dest.proc) for s in stops) == [
        "controller[0]",
        "hostworker[0]",
        "mgr[0]",
        "worker[0]",
        "worker[1]",
    ]
    assert not [i for i in instrs if isinstance(i, StopSystem)]
    out = h.answer_stops(stops)
    infos = logs(out, logging.INFO)
    assert "worker[0]: proc stopped" in infos and "worker[1]: proc stopped" in infos
    stop_system = [i for i in out if isinstance(i, StopSystem)]
    assert len(stop_system) == 1 and out.index(stop_system[0]) == len(out) - 1
    assert h.snapshot().worlds == {}
    # Detached clients are not stopped.
    assert h.reg.record(pid("user[123]")) is not None


def test_a34_unresponsive_proc_removed_by_fallback_timer() -> None:
    h = Harness()
    live_world(h, "w", 3)
    h.advance(2.0, beat=["w[0]", "w[1]"])  # w[2] is SIGSTOPped: Expired
    assert h.health("w[2]") == "Expired"
    _, instrs = h.send(Stop(worlds=[wid("w")], proc_timeout_s=1.0))
    stops = asks(instrs, ProcStop)
    assert pid("w[2]") in [s.dest.proc for s in stops]
    (timer,) = [i for i in instrs if isinstance(i, Timer)]
    h.answer_stops(stops, skip=["w[2]"])
    assert "w" in h.snapshot().worlds
    h.clock.advance(timer.delay_s)
    out = h.run(h.reg.handle_timer(timer.token))[1]
    (warning,) = [t for t in logs(out, logging.WARNING) if "no answer" in t]
    assert "w[2]" in warning and "w[0]" not in warning
    assert "w" not in h.snapshot().worlds


def test_stop_results_from_failed_asks_count_as_done() -> None:
    h = Harness()
    live_world(h, "w", 2)
    _, instrs = h.send(Stop(worlds=[wid("w")]))
    a0, a1 = asks(instrs, ProcStop)
    h.run(h.reg.handle_reply(a0, None, "broken link: connection refused"))
    assert "w" in h.snapshot().worlds
    h.run(h.reg.handle_connection_lost(a1.dest.proc))
    assert "w" not in h.snapshot().worlds


def test_a35_world_recreated_after_stop_is_fresh_and_stoppable() -> None:
    h = Harness()
    live_world(h, "foo", 1)
    _, instrs = h.send(Stop(worlds=[wid("foo")]))
    old_stops = asks(instrs, ProcStop)
    (old_timer,) = [i for i in instrs if isinstance(i, Timer)]
    h.answer_stops(old_stops)
    assert "foo" not in h.snapshot().worlds
    reply, _ = h.upsert("foo", [1])
    assert isinstance(reply, WorldUpserted) and reply.status.status == "Unhealthy"
    h.joined("foo[0]")
    assert h.snapshot().worlds["foo"].status == "Live"
    # Leftovers of the first stop do not touch the new world.
    h.run(h.reg.handle_timer(old_timer.token))
    h.answer_stops(old_stops)
    assert h.snapshot().worlds["foo"].status == "Live"
    reply, instrs = h.send(Stop(worlds=[wid("foo")]))
    assert reply.stopping == [wid("foo")]
    h.answer_stops(asks(instrs, ProcStop))
    assert "foo" not in h.snapshot().worlds


def test_stop_of_a_world_already_stopping() -> None:
    h = Harness()
    live_world(h, "a", 1)
    h.send(Stop(worlds=[wid("a")]))
    reply, instrs = h.send(Stop(worlds=[wid("a"), wid("a"), wid("b")]))
    assert reply == StopAck(already_stopping=[wid("a")], unknown=[wid("b")])
    assert not asks(instrs)


# --------------------------------------------------------------------------- hosts and spawn results


def test_a42_spawn_failures_mark_ranks_exited() -> None:
    h = Harness()
    h.joined("hostw[0]", host="node3")
    _, instrs = h.upsert("w", [2], nph=2, env=Exec(program="/no/such/program"))
    (ask,) = asks(instrs, SpawnProc)
    result = SpawnProcResult(
        started=[StartedProc(proc_id=pid("w[0]"), pid=31)],
        failed=[
            FailedProc(
                proc_id=pid("w[1]"),
                reason="cannot execute '/no/such/program': No such file or directory",
            )
        ],
    )
    h.run(h.reg.handle_reply(ask, result))
    # The matching exit report (sent too by the host) does not report twice.
    port = sub_port()
    h.send(Subscribe(world_id=wid("w"), port=port))
    instrs = h.send(
        ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), reason="cannot execute")
    )[1]
    assert not events(instrs, port)
    entry = h.snapshot().worlds["w"].procs["w[1]"]
    assert entry.health == "Exited" and entry.reason.startswith("cannot execute '/no/such/program'")
    assert entry.addr == "" and entry.host == "node3"
    assert list(h.world_state("w").procs) == [1]


def test_refused_spawn_marks_ranks_exited_and_proc_exits_before_join_count() -> None:
    h = Harness()
    h.joined("hostw[0]", host="node3")
    h.joined("hostw[1]", host="node4")
    _, instrs = h.upsert("w", [4], nph=2)
    a0, a1 = asks(instrs, SpawnProc)
    h.run(h.reg.handle_reply(a0, Rejected(code="invalid_argument", message="bad")))
    assert h.reg.record(pid("w[0]")).reason == "host hostw[0] refused to spawn: bad"  # type: ignore[union-attr]
    assert h.reg.record(pid("w[1]")).health == "Exited"  # type: ignore[union-attr]
    h.run(h.reg.handle_reply(a1, None, "deadline passed"))  # transport trouble: logged only
    assert h.reg.record(pid("w[2]")) is None
    h.send(ProcExited(proc_id=pid("w[3]"), host_proc=pid("hostw[1]"), pid=77, exit_code=1))
    assert h.world_state("w").procs[3].reason == "exited with code 1"
    # A proc that finally joins replaces its failed-before-join record.
    h.joined("w[3]")
    assert 3 not in h.world_state("w").procs


def test_host_rejoin_as_new_incarnation_gets_assignment_again() -> None:
    h = Harness()
    h.joined("hostw[0]")
    _, instrs = h.upsert("w", [2], nph=2)
    assert len(asks(instrs, SpawnProc)) == 1
    h.send(Leave(proc_id=pid("hostw[0]"), reason="SIGTERM"))
    instrs = h.joined("hostw[0]")
    assert len(asks(instrs, SpawnProc)) == 1


def test_upsert_of_world_created_by_joins_drops_out_of_range_ranks() -> None:
    h = Harness()
    port = sub_port()
    h.send(Subscribe(world_id=wid("x"), port=port))
    instrs = h.joined("x[0]")
    instrs += h.joined("x[5]")
    assert h.snapshot().worlds["x"].status == "AwaitingCreation"
    assert h.world_state("x").status.status == "AwaitingCreation"
    assert [e.status for e in events(instrs, port)] == ["AwaitingCreation"]
    reply, instrs = h.upsert("x", [1], labels={"a": "b"})
    assert reply.status.status == "Live"
    (stop,) = sends(instrs, ProcStop)
    assert stop.dest == agent_of(pid("x[5]")) and stop.message.reason == "rank out of range"
    assert any("dropping x[5]" in t for t in logs(instrs, logging.WARNING))
    assert list(h.snapshot().worlds["x"].procs) == ["x[0]"]
    assert h.snapshot().worlds["x"].labels == {"a": "b"}


# --------------------------------------------------------------------------- addresses


def test_a48_a49_resolve_and_address_changed() -> None:
    h = Harness()
    live_world(h, "w", 2)
    reply, _ = h.send(Resolve(proc_id=pid("w[9]")))
    assert reply.message == "proc w[9] is not known to the system"
    resolved = h.ok(Resolve(proc_id=pid("w[1]")), requester=pid("w[0]"))
    assert resolved == Resolved(addr="unix:/run/w_1.sock", incarnation=h.incarnations[pid("w[1]")])
    # w[1] restarts elsewhere; its old record still looks alive, so the join probes it.
    msg = Join(proc_id=pid("w[1]"), addr="unix:/run/w_1b.sock", incarnation=999)
    probe_needed, _ = h.send(msg)
    assert isinstance(probe_needed, JoinProbeNeeded)
    reply, instrs = h.run(h.reg.complete_join(msg, probe_needed.probe, "refused"))
    assert isinstance(reply, Joined)
    (changed,) = sends(instrs, AddressChanged)
    assert changed.dest == agent_of(pid("w[0]"))
    assert changed.message == AddressChanged(
        proc_id=pid("w[1]"), addr="unix:/run/w_1b.sock", incarnation=999
    )
    assert Bind(pid("w[1]"), ChannelAddr.parse("unix:/run/w_1b.sock"), stimulus_id=ANY) in instrs
    # Resolvers carry over to the new incarnation.
    instrs = h.send(ProcExited(proc_id=pid("w[1]"), exit_signal=9))[1]
    assert [s.dest for s in sends(instrs, PeerGone)] == [agent_of(pid("w[0]"))]


def test_complete_join_with_stale_probe_asks_again() -> None:
    h = Harness()
    h.joined("w[0]", addr="unix:/a", incarnation=1)
    msg = Join(proc_id=pid("w[0]"), addr="unix:/b", incarnation=2)
    stale = Probe(pid("w[0]"), ChannelAddr.parse("unix:/elsewhere"), 1, 1.0, stimulus_id="test")
    reply, _ = h.run(h.reg.complete_join(msg, stale, "refused"))
    assert isinstance(reply, JoinProbeNeeded)


def test_failed_proc_subscriptions_end() -> None:
    h = Harness()
    live_world(h, "w", 1)
    live_world(h, "c", 1)
    port = sub_port("c[0]")
    h.send(Subscribe(world_id=wid("w"), port=port))
    h.send(ProcExited(proc_id=pid("c[0]"), exit_code=1))
    assert h.reg.subscribers("w") == []


# --------------------------------------------------------------------------- robustness


_PROCS = [f"w[{r}]" for r in range(4)] + ["hostw[0]", "hostw[1]", "m[0]", "user[7]"]

_ops = st.one_of(
    st.tuples(st.just("join"), st.sampled_from(_PROCS), st.integers(1, 3)),
    st.tuples(st.just("upsert"), st.sampled_from(["w", "m", "hostw"]), st.integers(0, 5)),
    st.tuples(st.just("beat"), st.sampled_from(_PROCS), st.booleans()),
    st.tuples(st.just("exit"), st.sampled_from(_PROCS), st.integers(0, 9)),
    st.tuples(
        st.just("lost"),
        st.sampled_from(_PROCS),
        st.sampled_from(["connected", "refused", "timeout"]),
    ),
    st.tuples(st.just("leave"), st.sampled_from(_PROCS), st.none()),
    st.tuples(st.just("stop"), st.sampled_from([None, "w", "m", "zz"]), st.floats(0, 2)),
    st.tuples(st.just("advance"), st.floats(0, 2), st.none()),
    st.tuples(st.just("answer"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("timer"), st.integers(0, 5), st.none()),
    st.tuples(st.just("query"), st.sampled_from(["w", "m", "hostw", "zz"]), st.none()),
    st.tuples(st.just("resolve"), st.sampled_from(_PROCS), st.none()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ops, max_size=40))
def test_random_stimuli_never_crash_and_keep_invariants(ops: list[tuple[Any, Any, Any]]) -> None:
    h = Harness()
    pending_asks: list[Ask] = []
    timers: list[Timer] = []

    def collect(instrs: list[Any]) -> None:
        pending_asks.extend(asks(instrs))
        timers.extend(i for i in instrs if isinstance(i, Timer))
        for probe in [i for i in instrs if isinstance(i, Probe)]:
            collect(h.run(h.reg.handle_probe_result(probe, "refused"))[1])

    h.send(Subscribe(world_id=wid("w"), port=sub_port()))
    for op, a, b in ops:
        if op == "join":
            mode = (
                "Detached"
                if a.startswith("user")
                else ("ManagingSystem" if a == "m[0]" else "ManagedBySystem")
            )
            reply, instrs = h.join(a, incarnation=b, mode=mode)
            if isinstance(reply, JoinProbeNeeded):
                reply, more = h.run(
                    h.reg.complete_join(
                        Join(proc_id=pid(a), addr=f"unix:/{a}", mode=mode, incarnation=b),
                        reply.probe,
                        "refused",
                    )
                )
                instrs += more
            collect(instrs)
        elif op == "upsert":
            collect(h.upsert(a, [b] if b else [], nph=2)[1])
        elif op == "beat":
            failed = [ActorFailure(actor_id=pid(a).actor("x"), status="failed: x")] if b else []
            collect(h.heartbeat(a, failed=failed))
        elif op == "exit":
            collect(
                h.send(
                    ProcExited(proc_id=pid(a), exit_signal=b or None, exit_code=None if b else 0)
                )[1]
            )
        elif op == "lost":
            collect(h.run(h.reg.handle_connection_lost(pid(a)))[1])
        elif op == "leave":
            collect(h.send(Leave(proc_id=pid(a)))[1])
        elif op == "stop":
            collect(h.send(Stop(worlds=None if a is None else [wid(a)], proc_timeout_s=b))[1])
        elif op == "advance":
            collect(h.advance(a))
        elif op == "answer" and pending_asks:
            ask = pending_asks.pop(a % len(pending_asks))
            if isinstance(ask.message, ProcStop) and b:
                reply = ProcStopResult(proc_id=ask.dest.proc)
                collect(h.run(h.reg.handle_reply(ask, reply))[1])
            elif isinstance(ask.message, SpawnProc) and b:
                collect(h.run(h.reg.handle_reply(ask, SpawnProcResult()))[1])
            else:
                collect(h.run(h.reg.handle_reply(ask, None, "broken link: gone"))[1])
        elif op == "timer" and timers:
            collect(h.run(h.reg.handle_timer(timers.pop(a % len(timers)).token))[1])
        elif op == "query":
            h.world_state(a)
        elif op == "resolve":
            h.send(Resolve(proc_id=pid(a)), requester=pid("user[7]"))
        # Invariants after every stimulus.
        snap = h.snapshot()
        msgspec.json.encode(snap)
        for name, world in snap.worlds.items():
            assert not name.startswith("host")
            rec = h.reg.world(name)
            assert rec is not None
            for r in rec.failed:
                assert rec.procs[r].failed
            for r, p in rec.procs.items():
                assert h.reg.record(p.proc_id) is p and p.proc_id.rank == r
                if rec.size is not None:
                    assert r < rec.size
            if world.status == "Live":
                assert not rec.failed and len(rec.procs) == rec.size
    # Whatever happened, a full stop with every answer and timer ends the system.
    collect(h.send(Stop())[1])
    for ask in pending_asks:
        h.run(h.reg.handle_reply(ask, None, "broken link: gone"))
    for t in timers:
        h.run(h.reg.handle_timer(t.token))
    assert h.reg.stopped
    assert h.snapshot().worlds == {}


# --------------------------------------------------------------------------- micro-benchmarks (printed)


def _bench_world(n: int) -> Harness:
    h = Harness(supervision_update_timeout_s=20.0, world_eviction_timeout_s=10.0)
    h.upsert("bench", [n], nph=8)
    for r in range(n):
        h.joined(
            f"bench[{r}]", labels={"parity": str(r % 2), "role": "worker"}, host=f"node{r // 8}"
        )
    return h


def test_a11_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    """1,000 procs heartbeating at 1 Hz, and a labelled snapshot of 1,000 procs (printed)."""
    n = 1000
    h = _bench_world(n)
    procs = [pid(f"bench[{r}]") for r in range(n)]
    updates = [
        SupervisionUpdate(state=ProcSupervisionState(proc_id=p, incarnation=h.incarnations[p]))
        for p in procs
    ]
    reg = h.reg
    seconds = 10
    gc.collect()
    cpu0 = time.process_time()
    for _ in range(seconds):
        for quarter in range(4):
            h.clock.advance(0.25)
            for u in updates[quarter * n // 4 : (quarter + 1) * n // 4]:
                reg.handle_supervision_update(u)
            reg.handle_health_tick()
    cpu = time.process_time() - cpu0
    assert reg.world("bench").status == "Live"  # type: ignore[union-attr]

    flt = Snapshot(filter=SnapshotFilter(proc_labels={"role": "worker"}))
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        snap, _ = reg.handle_snapshot(flt)
        msgspec.msgpack.encode(snap)
        times.append(time.perf_counter() - t0)
    assert len(snap.worlds["bench"].procs) == n
    with capsys.disabled():
        print(
            f"\n[bench] {n} procs heartbeating at 1 Hz: {100 * cpu / seconds:.2f} % of one core "
            f"(target <= 10 %); labelled snapshot of {n} procs incl. encoding: "
            f"median {1000 * statistics.median(times):.2f} ms (target <= 20 ms)"
        )


def test_lost_host_gets_its_children_probed_and_a_silent_child_declared() -> None:
    """A host and its children die together: each child is decided even when its own
    connection-lost signal comes late or its probe gets no answer (children die with
    their host through the parent-death signal)."""
    h = Harness()
    h.upsert("w", [2], nph=2)
    h.joined("hostw[0]", pid_=900)
    for r in range(2):
        h.joined(f"w[{r}]", pid_=1000 + r, host_proc="hostw[0]")
    # The host's connection closes: it is probed at once and refuses.
    _, instrs = h.run(h.reg.handle_connection_lost(pid("hostw[0]")))
    (probe,) = [i for i in instrs if isinstance(i, Probe)]
    _, instrs = h.run(h.reg.handle_probe_result(probe, "refused"))
    assert h.health("hostw[0]") == "ConnectionFailure"
    child_probes = {i.proc_id: i for i in instrs if isinstance(i, Probe)}
    assert set(child_probes) == {pid("w[0]"), pid("w[1]")}
    h.run(h.reg.handle_probe_result(child_probes[pid("w[0]")], "refused"))
    h.run(h.reg.handle_probe_result(child_probes[pid("w[1]")], "timeout"))
    for r in range(2):
        rec = h.reg.record(pid(f"w[{r}]"))
        assert rec is not None and rec.health == "ConnectionFailure"
        assert (
            rec.reason == "connection lost (its host hostw[0] on node1 was lost at the same time)"
        )


def respawnable_world() -> Harness:
    """World ``w`` of 2 procs (pids 812, 813) started by host ``hostw[0]`` on node3."""
    h = Harness()
    h.joined("hostw[0]", host="node3")
    h.upsert("w", [2], nph=2, env=Exec(program="palatine worker"))
    h.joined("w[0]", pid_=812, host="node3", host_proc="hostw[0]")
    h.joined("w[1]", pid_=813, host="node3", host_proc="hostw[0]")
    return h


def test_respawn_of_a_killed_proc_asks_its_host_and_the_world_waits_instead_of_evicting() -> None:
    from palatine.protocol.system import RespawnProcs

    h = respawnable_world()
    h.send(ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), pid=813, exit_signal=9))
    assert h.snapshot().worlds["w"].status == "Unhealthy"
    # refused: an alive rank, a rank out of range, an unknown world
    for bad, code in (
        (RespawnProcs(world_id=wid("w"), ranks=[0]), "conflict"),
        (RespawnProcs(world_id=wid("w"), ranks=[2]), "invalid_argument"),
        (RespawnProcs(world_id=wid("nope"), ranks=[0]), "not_found"),
    ):
        reply, _ = h.send(bad)
        assert isinstance(reply, Rejected) and reply.code == code, reply
    reply, instrs = h.send(RespawnProcs(world_id=wid("w"), ranks=[1]))
    assert isinstance(reply, Ok)
    (spawn,) = asks(instrs, SpawnProc)
    assert spawn.dest == agent_of(pid("hostw[0]"))
    assert [(a.rank, a.local_rank) for a in spawn.message.procs] == [(1, 1)]
    assert spawn.message.world_size == 2 and spawn.message.local_world_size == 2
    w = h.snapshot().worlds["w"]
    assert w.status == "Unhealthy" and list(w.procs) == ["w[0]"]  # waiting for w[1]
    # long past the eviction timeout: waiting for a proc is not failing
    h.advance(3.0, beat=["w[0]", "hostw[0]"])
    assert h.snapshot().worlds["w"].status == "Unhealthy"
    h.joined("w[1]", pid_=900, host="node3", host_proc="hostw[0]")
    w = h.snapshot().worlds["w"]
    assert w.status == "Live" and w.procs["w[1]"].pid == 900


def test_a_late_exit_report_of_a_replaced_incarnation_does_not_fail_the_new_one() -> None:
    from palatine.protocol.system import RespawnProcs

    h = respawnable_world()
    # Known dead by its connection before its host's exit report arrives.
    h.send(ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), pid=813, exit_signal=9))
    reply, _ = h.send(RespawnProcs(world_id=wid("w"), ranks=[1]))
    assert isinstance(reply, Ok)
    # The old pid's report, late (before the new incarnation joined): ignored.
    h.send(ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), pid=813, exit_signal=9))
    assert "w[1]" not in h.snapshot().worlds["w"].procs
    h.joined("w[1]", pid_=900, host="node3", host_proc="hostw[0]")
    assert h.snapshot().worlds["w"].status == "Live"


def test_the_ranks_of_a_lost_host_are_respawned_on_the_least_loaded_live_host() -> None:
    from palatine.protocol.system import RespawnProcs

    h = Harness()
    h.joined("hostw[0]", host="node1")
    h.joined("hostw[1]", host="node2")
    h.joined("hostw[2]", host="node3")
    h.upsert("w", [6], nph=2, env=Exec(program="palatine worker"))
    for r in range(6):
        h.joined(f"w[{r}]", pid_=800 + r, host=f"node{r // 2 + 1}", host_proc=f"hostw[{r // 2}]")
    h.send(ProcExited(proc_id=pid("w[0]"), host_proc=pid("hostw[0]"), pid=800, exit_signal=9))
    h.send(ProcExited(proc_id=pid("w[2]"), host_proc=pid("hostw[1]"), pid=802, exit_signal=9))
    h.send(ProcExited(proc_id=pid("w[3]"), host_proc=pid("hostw[1]"), pid=803, exit_signal=9))
    h.send(ProcExited(proc_id=pid("w[4]"), host_proc=pid("hostw[2]"), pid=804, exit_signal=9))
    h.reg.record(pid("hostw[1]")).health = "ConnectionFailure"  # type: ignore[union-attr]
    reply, instrs = h.send(RespawnProcs(world_id=wid("w"), ranks=[2, 3]))
    assert isinstance(reply, Ok)
    spawns = {
        s.dest: [(a.rank, a.local_rank) for a in s.message.procs] for s in asks(instrs, SpawnProc)
    }
    # hosts 0 and 2 run one proc each: the lower host first, then the less loaded
    assert spawns == {agent_of(pid("hostw[0]")): [(2, 0)], agent_of(pid("hostw[2]")): [(3, 1)]}
    h.joined("w[2]", pid_=902, host="node1", host_proc="hostw[0]")
    h.joined("w[3]", pid_=903, host="node3", host_proc="hostw[2]")
    # The lost host comes back: its ranks run elsewhere now, so it is asked for none.
    instrs = h.joined("hostw[1]", host="node2", incarnation=77)
    assert asks(instrs, SpawnProc) == []


def test_procs_told_a_peer_was_gone_hear_when_a_respawn_brings_it_back() -> None:
    from palatine.protocol.system import RespawnProcs

    h = respawnable_world()
    h.ok(Resolve(proc_id=pid("w[1]")), requester=pid("w[0]"))  # w[0] routes to w[1]
    instrs = h.send(ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), pid=813))[1]
    assert [s.dest for s in sends(instrs, PeerGone)] == [agent_of(pid("w[0]"))]
    assert isinstance(h.send(RespawnProcs(world_id=wid("w"), ranks=[1]))[0], Ok)
    instrs = h.joined("w[1]", pid_=900, host="node3", host_proc="hostw[0]", addr="unix:/w1b")
    (back,) = sends(instrs, AddressChanged)
    assert back.dest == agent_of(pid("w[0]")) and back.message.addr == "unix:/w1b"
    # and it is a resolver of the new incarnation: told when that one goes too
    instrs = h.send(ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), pid=900))[1]
    assert [s.dest for s in sends(instrs, PeerGone)] == [agent_of(pid("w[0]"))]


# --------------------------------------------------------------------------- a restarted system


def _spec(name: str = "W", shape: list[int] | None = None, nph: int = 2) -> UpsertWorld:
    return UpsertWorld(
        world_id=wid(name),
        shape=shape or [2],
        num_procs_per_host=nph,
        env=Exec(program="python -m palatine worker"),
        labels={"world.palatine.dev/worker": "1"},
    )


def test_a_restarted_system_rebuilds_a_world_from_its_rejoining_host_and_procs_without_spawning() -> (
    None
):
    h = Harness(rejoin_window_s=10.0)
    reply, instrs = h.rejoin("hostW[0]", 77, world=_spec())
    assert isinstance(reply, Joined)
    assert not asks(instrs, SpawnProc)  # its procs run already
    assert "world W rebuilt from the rejoin of hostW[0]" in " ".join(logs(instrs))
    for r in (0, 1):
        reply, instrs = h.rejoin(f"W[{r}]", 100 + r, pid_=500 + r)
        assert isinstance(reply, Joined)
        assert not asks(instrs, SpawnProc)
    snap = h.snapshot(worlds=["W"])
    world = snap.worlds["W"]
    assert world.status == "Live"
    assert world.labels == {"world.palatine.dev/worker": "1"}
    assert {p: e.pid for p, e in world.procs.items()} == {"W[0]": 500, "W[1]": 501}
    assert h.reg.rejoins == 3
    # the window ends with every rank back: nothing is declared
    assert not logs(h.advance(11.0, beat=["W[0]", "W[1]", "hostW[0]"]), logging.WARNING)
    assert h.world_state("W").status.status == "Live"


def test_a_host_rejoining_a_world_already_rebuilt_is_not_asked_to_spawn() -> None:
    h = Harness(rejoin_window_s=10.0)
    h.rejoin("hostW[0]", 7, world=_spec(shape=[4]))
    reply, instrs = h.rejoin("hostW[1]", 8, world=_spec(shape=[4]))
    assert isinstance(reply, Joined)
    assert not asks(instrs, SpawnProc)


def test_during_the_rejoin_window_unknown_procs_are_not_told_to_stop_and_queries_say_unavailable() -> (
    None
):
    h = Harness(rejoin_window_s=10.0)
    assert not sends(h.heartbeat("W[3]"), ProcStop)  # its rejoin is on the way
    for msg in (
        WorldState(world_id=wid("W")),
        Subscribe(world_id=wid("W"), port=sub_port()),
        Resolve(proc_id=pid("W[3]")),
    ):
        reply, _ = h.send(msg)
        assert isinstance(reply, Rejected) and reply.code == "unavailable", reply
        assert "has not rejoined the system yet" in reply.message
    assert h.reg.subscribers("W") == []  # an unavailable subscription is not kept
    reply, _ = h.send(ProcExited(proc_id=pid("W[3]"), exit_signal=9))  # its host reports again
    assert isinstance(reply, Rejected) and reply.code == "unavailable", reply
    h.advance(10.5)
    (stop,) = sends(h.heartbeat("W[3]"), ProcStop)
    assert stop.message.reason == "unknown to the system"
    assert h.world_state("W") is None
    reply, _ = h.send(Resolve(proc_id=pid("W[3]")))
    assert isinstance(reply, Rejected) and reply.code == "not_found"


def test_a_rank_that_does_not_rejoin_is_expired_when_the_window_ends_and_subscribers_hear_it() -> (
    None
):
    h = Harness(rejoin_window_s=10.0)
    h.rejoin("hostW[0]", 7, world=_spec())
    h.rejoin("W[0]", 100)
    h.ok(Subscribe(world_id=wid("W"), port=sub_port()))
    instrs = h.advance(10.5, beat=["W[0]", "hostW[0]"])
    (event,) = [e for e in events(instrs, sub_port()) if isinstance(e, ProcFailed)]
    assert event.rank == 1 and event.state.health == "Expired"
    assert h.health("W[1]") == "Expired"
    rec = h.reg.record(pid("W[1]"))
    assert rec is not None and rec.reason == "did not rejoin within 10 s of the system's restart"
    assert h.world_state("W").status.status == "Unhealthy"


def test_an_exit_reported_after_the_hosts_rejoin_names_its_signal() -> None:
    h = Harness(rejoin_window_s=10.0)
    h.rejoin("hostW[0]", 7, world=_spec())
    h.rejoin("W[0]", 100)
    h.ok(Subscribe(world_id=wid("W"), port=sub_port()))
    _, instrs = h.send(ProcExited(proc_id=pid("W[1]"), host_proc=pid("hostW[0]"), exit_signal=9))
    (event,) = [e for e in events(instrs, sub_port()) if isinstance(e, ProcFailed)]
    assert event.rank == 1 and event.state.exit_signal == 9


def test_a_rejoin_adopts_the_execution_id_only_when_this_system_was_given_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(rejoin_window_s=10.0)  # given one
    reply, _ = h.rejoin("W[0]", 1, execution_id="bob-20240101-000000-0000")
    assert isinstance(reply, Rejected) and reply.code == "conflict"
    assert "this system runs execution alice-20240101-000000-abcd" in reply.message
    monkeypatch.delenv("PALATINE_EXECUTION_ID", raising=False)
    h = Harness(rejoin_window_s=10.0, execution_id=None)  # started by hand, without one
    reply, _ = h.rejoin("W[0]", 1, execution_id="bob-20240101-000000-0000")
    assert isinstance(reply, Joined)
    assert reply.execution_id == h.reg.execution_id == "bob-20240101-000000-0000"
    reply, _ = h.rejoin("W[1]", 2, execution_id="carol-20240101-000000-0000")
    assert isinstance(reply, Rejected) and reply.code == "conflict"


def test_a_rejoin_to_a_system_that_never_went_away_changes_nothing_and_a_dead_proc_is_refused() -> (
    None
):
    h = Harness(rejoin_window_s=10.0)
    live_world(h, "W", 2)
    inc = h.incarnations[pid("W[0]")]
    reply, instrs = h.rejoin("W[0]", inc)
    assert isinstance(reply, Joined)
    assert not sends(instrs) and not asks(instrs)
    assert h.reg.rejoins == 0
    h.ok(ProcExited(proc_id=pid("W[1]"), exit_code=3))
    reply, _ = h.rejoin("W[1]", h.incarnations[pid("W[1]")])
    assert isinstance(reply, Rejected) and reply.code == "conflict"
    assert "already declared Exited" in reply.message


# --------------------------------------------------------------------------- stimulus ids and log


def test_every_instruction_a_stimulus_produces_carries_that_stimulus_id() -> None:
    h = Harness()
    ids: list[str] = []
    feed = h.run

    def checked(result: tuple[Any, list[Any]]) -> tuple[Any, list[Any]]:
        reply, instrs = feed(result)
        carried = {i.stimulus_id for i in instrs}
        assert len(carried) <= 1, carried
        if carried:
            (sid,) = carried
            ids.append(sid)
            assert h.reg.stimuli().entries[-1].stimulus_id == sid  # its log entry
        return reply, instrs

    h.run = checked  # type: ignore[method-assign]
    h.joined("hostw[0]", host="node3")
    h.upsert("w", [2], nph=2, env=Exec(program="palatine worker"))
    for r in range(2):
        h.joined(f"w[{r}]", pid_=900 + r, host="node3", host_proc="hostw[0]")
    h.send(Subscribe(world_id=wid("w"), port=sub_port()))
    h.ok(Resolve(proc_id=pid("w[1]")), requester=pid("user[5]"))
    # a lost connection: the exit-report grace, then a probe that is refused
    (grace,) = [
        i for i in h.run(h.reg.handle_connection_lost(pid("w[1]")))[1] if isinstance(i, Timer)
    ]
    (probe,) = [i for i in h.run(h.reg.handle_timer(grace.token))[1] if isinstance(i, Probe)]
    h.run(h.reg.handle_probe_result(probe, "refused"))
    assert h.health("w[1]") == "ConnectionFailure"
    evicting = h.advance(1.25, beat=["w[0]", "hostw[0]"])  # health ticks: eviction
    h.answer_stops(evicting)  # replies
    h.send(Ok())  # not a request: rejected
    stopping = h.send(Stop(proc_timeout_s=1.0))[1]
    assert any(isinstance(i, StopSystem) for i in h.answer_stops(stopping))
    kinds = [sid.rpartition("-")[0] for sid in ids]
    numbers = [int(sid.rpartition("-")[2]) for sid in ids]
    assert {
        "join",
        "upsert-world",
        "connection-lost",
        "timer",
        "probe-result",
        "health-tick",
        "reply",
        "unexpected",
        "stop",
    } <= set(kinds)
    assert numbers == sorted(set(numbers))  # one id per stimulus, counting up


def test_every_instruction_type_has_a_required_stimulus_id() -> None:
    for cls in get_args(Instruction):
        assert "stimulus_id" in cls.__struct_fields__, cls
    with pytest.raises(TypeError, match="stimulus_id"):
        Unbind(wid("w"))  # type: ignore[call-arg]


def test_a_join_binds_its_address_parsed_once_and_a_bad_one_is_rejected_clearly() -> None:
    h = Harness()
    instrs = h.joined("w[0]", addr="tcp:127.0.0.1:5000")
    (bind,) = [i for i in instrs if isinstance(i, Bind)]
    assert bind.addr == ChannelAddr.parse("tcp:127.0.0.1:5000")
    reply, _ = h.join("w[1]", addr="tcp:nowhere")
    assert isinstance(reply, Rejected) and reply.code == "invalid_argument"
    assert reply.message.startswith("join of w[1]: invalid address 'tcp:nowhere': ")
    entry = h.reg.stimuli().entries[-1]
    assert entry.kind == "join" and entry.reply.startswith("Rejected invalid_argument: join of")


def test_a_refused_join_leaves_its_parsed_address_for_the_shell_to_reach_the_joiner() -> None:
    h = Harness()
    h.joined("w[0]", addr="tcp:10.0.0.3:4000")
    # refused after validation (a live proc answers at its address): parsed all the same
    msg = Join(proc_id=pid("w[0]"), addr="tcp:10.0.0.3:4001", pid=900, incarnation=77)
    reply, _ = h.send(msg)
    assert isinstance(reply, JoinProbeNeeded)
    reply, _ = h.run(h.reg.complete_join(msg, reply.probe, "connected"))
    assert isinstance(reply, Rejected) and reply.code == "conflict"
    assert h.reg.join_addr == ChannelAddr.parse("tcp:10.0.0.3:4001")
    # refused by validation before its address is looked at: parsed as well
    h.rejected(Join(proc_id=pid("system[0]"), addr="unix:/run/s.sock"), "invalid_argument")
    assert h.reg.join_addr == ChannelAddr.parse("unix:/run/s.sock")
    # no address the shell could dial
    for bad in ("tcp:nowhere", "tcp:0.0.0.0:0"):
        h.rejected(Join(proc_id=pid("w[1]"), addr=bad), "invalid_argument")
        assert h.reg.join_addr is None


def test_a_detached_client_without_an_address_is_replaced_without_a_probe() -> None:
    h = Harness()
    h.joined("user[1]", mode="Detached", addr="")
    again = Join(proc_id=pid("user[1]"), addr="", mode="Detached", incarnation=99)
    reply, instrs = h.send(again, requester=pid("user[1]"))
    assert isinstance(reply, Joined)  # nothing to probe: nothing answers there
    assert not [i for i in instrs if isinstance(i, Probe)]


def test_the_stimulus_log_keeps_only_the_newest_entries_up_to_its_size() -> None:
    h = Harness(stimulus_log_size=5)
    for r in range(12):
        h.joined(f"user[{r}]", mode="Detached")
    log = h.reg.stimuli()
    assert log.size == 5 and log.handled == 12
    assert [e.stimulus_id for e in log.entries] == [f"join-{n}" for n in range(8, 13)]
    assert [e.subject for e in log.entries] == [f"user[{r}]" for r in range(7, 12)]


def test_heartbeats_ticks_and_queries_that_decide_nothing_stay_out_of_the_log() -> None:
    h = Harness()
    live_world(h, "w", 1)
    before = h.reg.stimuli()
    h.heartbeat("w[0]")
    h.tick()
    h.snapshot()
    h.ok(Resolve(proc_id=pid("w[0]")), requester=pid("user[1]"))
    h.ok(Stimuli())
    after = h.reg.stimuli()
    assert after.handled == before.handled + 5  # each got an id
    assert after.entries == before.entries
    # a heartbeat that decides something is logged: an unknown proc is told to stop
    instrs = h.heartbeat("z[0]")
    entry = h.reg.stimuli().entries[-1]
    assert entry.stimulus_id == instrs[0].stimulus_id == f"heartbeat-{after.handled + 1}"
    assert (entry.kind, entry.subject, entry.reply) == ("heartbeat", "z[0]", "")
    assert entry.instructions == [
        "Log WARNING: heartbeat from z[0], which is unknown to the system; telling it to stop",
        "Send ProcStop to z[0].proc[0]",
    ]


def test_a_quiet_stimulus_rejected_without_instructions_enters_the_log() -> None:
    h = Harness(rejoin_window_s=10.0)
    for msg in (Resolve(proc_id=pid("W[3]")), WorldState(world_id=wid("W"))):
        reply, instrs = h.send(msg)  # W[3] may still rejoin: unavailable, nothing else
        assert isinstance(reply, Rejected) and reply.code == "unavailable" and instrs == []
        entry = h.reg.stimuli().entries[-1]
        assert entry.stimulus_id == f"{entry.kind}-{h.reg.stimuli().handled}"
        assert entry.kind in ("resolve", "world-state")
        assert entry.reply.startswith("Rejected unavailable: ") and entry.instructions == []
    assert [e.kind for e in h.reg.stimuli().entries] == ["resolve", "world-state"]


def test_the_stimuli_request_returns_the_log_oldest_first() -> None:
    h = Harness()
    live_world(h, "w", 2)
    log = h.ok(Stimuli())
    assert isinstance(log, StimulusLog)
    assert log.execution_id == "alice-20240101-000000-abcd" and log.size == 1000
    assert [(e.stimulus_id, e.kind, e.subject) for e in log.entries] == [
        ("upsert-world-1", "upsert-world", "w"),
        ("join-2", "join", "w[0]"),
        ("join-3", "join", "w[1]"),
    ]
    joined = log.entries[1]
    assert joined.time == 1_700_000_000.0  # wall clock (the fake clock has not moved)
    assert joined.reply == "Joined"
    assert joined.instructions[0] == "Bind w[0] to unix:/run/w_0.sock"
    last = h.ok(Stimuli(limit=2))
    assert [e.stimulus_id for e in last.entries] == ["join-2", "join-3"]
    # it travels and prints as the CLI shows it
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(last), type=StimulusLog)
    assert back == last
    (line,) = [ln for ln in back.lines() if " join-3 " in ln]
    assert " join-3 w[1]: Joined; Bind w[1] to unix:/run/w_1.sock; " in line


def test_a_malformed_stimuli_request_is_rejected_and_the_system_serves_on() -> None:
    h = Harness()
    for bad in (0, -3):
        reply = h.rejected(Stimuli(limit=bad), "invalid_argument")
        assert reply.message == (
            f"invalid limit {bad}: expected a whole number >= 1, or none for all"
        )
    log = h.ok(Stimuli())
    assert [e.kind for e in log.entries] == ["stimuli", "stimuli"]  # the rejections
    assert log.entries[0].reply.startswith("Rejected invalid_argument: invalid limit 0")


def test_a_stimulus_log_line_says_when_what_and_what_it_decided() -> None:
    log = StimulusLog(
        execution_id="x",
        size=10,
        handled=3,
        entries=[
            StimulusEntry(stimulus_id="health-tick-3", time=0.25, kind="health-tick"),
            StimulusEntry(
                stimulus_id="leave-2",
                time=1.5,
                kind="leave",
                subject="w[0]",
                reply="Ok",
                instructions=["Unbind w[0]"],
            ),
        ],
    )
    first, second = log.lines()
    assert first.endswith(".250 health-tick-3")
    assert second.endswith(".500 leave-2 w[0]: Ok; Unbind w[0]")


# ------------------------------------------------------------ replaced incarnations (a healed partition)


def _replaced(h: Harness) -> None:
    """w[0] joined at unix:/old as incarnation 1, then was replaced by incarnation 2 at
    unix:/new (a recovery after its node was cut off)."""
    h.joined("w[0]", addr="unix:/old", incarnation=1)
    msg = Join(proc_id=pid("w[0]"), addr="unix:/new", incarnation=2)
    reply, _ = h.send(msg)
    assert isinstance(reply, JoinProbeNeeded)
    reply, _ = h.run(h.reg.complete_join(msg, reply.probe, "timeout"))
    assert isinstance(reply, Joined)


def test_a_heartbeat_of_a_replaced_incarnation_is_answered_by_a_stop_at_its_own_address() -> None:
    h = Harness()
    _replaced(h)
    state = ProcSupervisionState(proc_id=pid("w[0]"), addr="unix:/old", incarnation=1)
    _, instrs = h.run(h.reg.handle(SupervisionUpdate(state=state)))
    (stop,) = sends(instrs, ProcStop)
    # to the old incarnation's address, naming it: never through w[0]'s binding (unix:/new)
    assert stop.addr == ChannelAddr.parse("unix:/old")
    assert stop.message.incarnation == 1
    assert "has joined again since" in stop.message.reason
    assert h.reg.record(pid("w[0]")).alive  # type: ignore[union-attr]


def test_a_late_leave_of_a_replaced_incarnation_leaves_the_replacement_alive() -> None:
    h = Harness()
    _replaced(h)
    assert h.ok(Leave(proc_id=pid("w[0]"), reason="stopped by signal", incarnation=1)) == Ok()
    rec = h.reg.record(pid("w[0]"))
    assert rec is not None and rec.alive and not rec.left
    h.ok(Leave(proc_id=pid("w[0]"), reason="done", incarnation=2))
    assert not rec.alive and rec.left


def test_a_message_returned_from_a_replaced_incarnations_address_does_not_fail_the_replacement() -> (
    None
):
    h = Harness()
    _replaced(h)
    lost = ["broken link: delivery timeout: not acknowledged within 30 s of posting"]
    old = ChannelAddr.parse("unix:/old")
    h.run(h.reg.handle_returned(agent_of(pid("w[0]")), lost, returned_at=old))
    rec = h.reg.record(pid("w[0]"))
    assert rec is not None and rec.alive
    h.run(
        h.reg.handle_returned(
            agent_of(pid("w[0]")), lost, returned_at=ChannelAddr.parse("unix:/new")
        )
    )
    assert not rec.alive and "returned" in rec.reason


def test_a_respawn_asked_of_a_host_lost_before_it_answers_moves_to_another_live_host() -> None:
    from palatine.protocol.system import RespawnProcs

    h = Harness()
    h.joined("hostw[0]", host="node1")
    h.joined("hostw[1]", host="node2")
    h.upsert("w", [4], nph=2, env=Exec(program="palatine worker"))
    for r in range(4):
        h.joined(f"w[{r}]", pid_=800 + r, host=f"node{r // 2 + 1}", host_proc=f"hostw[{r // 2}]")
    # rank 3 is declared first; its host, still alive then, is asked to start it again
    h.send(ProcExited(proc_id=pid("w[3]"), host_proc=pid("hostw[1]"), pid=803, exit_signal=9))
    _, instrs = h.send(RespawnProcs(world_id=wid("w"), ranks=[3]))
    (first,) = asks(instrs, SpawnProc)
    assert first.dest == agent_of(pid("hostw[1]"))
    # ... and is lost before it answers: the rank is asked of the other host at once
    h.clock.advance(10.0)
    instrs = h.advance(0.25, beat=["w[0]", "w[1]", "hostw[0]"])
    assert h.health("hostw[1]") == "Expired"
    (moved,) = asks(instrs, SpawnProc)
    assert moved.dest == agent_of(pid("hostw[0]"))
    assert [a.rank for a in moved.message.procs] == [3]
    # the lost host's late failure to answer changes nothing more
    _, instrs = h.run(h.reg.handle_reply(first, None, "peer gone: hostw[1]"))
    assert asks(instrs, SpawnProc) == []
    h.joined("w[3]", pid_=903, host="node1", host_proc="hostw[0]")
    assert h.reg.record(pid("w[3]")).alive  # type: ignore[union-attr]


def test_a_respawn_whose_host_is_lost_with_no_other_host_left_fails_the_rank_at_once() -> None:
    from palatine.protocol.system import RespawnProcs

    h = respawnable_world()
    h.send(ProcExited(proc_id=pid("w[1]"), host_proc=pid("hostw[0]"), pid=813, exit_signal=9))
    h.send(RespawnProcs(world_id=wid("w"), ranks=[1]))
    h.clock.advance(10.0)
    h.advance(0.25, beat=["w[0]"])
    rec = h.reg.record(pid("w[1]"))
    assert rec is not None and not rec.alive and not rec.joined
    assert "was lost before it started" in rec.reason and "no other live host" in rec.reason


def test_a_beat_that_arrives_after_an_observer_left_leaves_no_trace() -> None:
    h = Harness()
    h.joined("user[55]", mode="Detached")
    h.ok(Leave(proc_id=pid("user[55]"), reason="done", incarnation=h.incarnations[pid("user[55]")]))
    instrs = h.heartbeat("user[55]")  # on its own connection, sent before the Leave
    assert not sends(instrs, ProcStop)
    assert not [i for i in instrs if isinstance(i, Log) and i.level >= logging.WARNING]
