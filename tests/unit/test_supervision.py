"""Tests of `palatine.protocol.supervision`: liveness records and the exact failure texts."""

from __future__ import annotations

import msgspec

from palatine.config import format_seconds
from palatine.ids import ProcId
from palatine.protocol.supervision import (
    ActorFailure,
    ProcRecord,
    ProcSupervisionState,
    exit_text,
    expiry_reason,
    signal_text,
)


def rec(**kw: object) -> ProcRecord:
    return ProcRecord(ProcId.parse("W[3]"), "proc", pid=812, host="node3", incarnation=1, **kw)  # type: ignore[arg-type]


def test_texts() -> None:
    assert signal_text(9) == "killed by signal 9 (SIGKILL)"
    assert signal_text(15) == "killed by signal 15 (SIGTERM)"
    assert signal_text(200) == "killed by signal 200"
    assert exit_text(3, None) == "exited with code 3"
    assert exit_text(None, 9, "ignored") == "killed by signal 9 (SIGKILL)"
    assert exit_text(None, None, "cannot execute 'x'") == "cannot execute 'x'"
    assert expiry_reason(20.44, 20.0) == "no heartbeat for 20.4 s (timeout 20 s)"
    assert format_seconds(0.5) == "0.5" and format_seconds(1.0) == "1"


def test_failure_in_words() -> None:
    r = rec()
    assert r.who() == "W[3] (pid 812 on node3)"
    assert not r.failed and r.alive
    r.set_exit(None, 9, "", None)
    assert r.describe() == "W[3] (pid 812 on node3) was killed by signal 9"
    assert r.reason == "killed by signal 9 (SIGKILL)"
    r.set_exit(3, None, "", ["last line"])
    assert r.describe() == "W[3] (pid 812 on node3) exited with code 3"
    assert r.stderr_tail == ["last line"]
    bare = ProcRecord(ProcId.parse("W[4]"), "proc", joined=False)
    bare.set_exit(None, None, "cannot execute 'x': No such file or directory", None)
    assert bare.describe() == "W[4] exited: cannot execute 'x': No such file or directory"
    expired = rec()
    expired.health, expired.reason = "Expired", expiry_reason(1.2, 1.0)
    assert expired.describe() == (
        "W[3] (pid 812 on node3) stopped sending heartbeats: no heartbeat for 1.2 s (timeout 1 s)"
    )


def test_failed_actors_only_grow_and_count_as_failed() -> None:
    r = rec()
    a = ActorFailure(actor_id=ProcId.parse("W[3]").actor("worker"), status="failed: boom")
    b = ActorFailure(actor_id=ProcId.parse("W[3]").actor("other"), status="failed: again")
    assert r.add_failed_actors([a])
    assert not r.add_failed_actors([a])
    assert r.add_failed_actors([a, b])
    assert [f.actor_id.name for f in r.failed_actors] == ["worker", "other"]
    assert r.failed and r.alive
    assert r.describe() == "W[3] (pid 812 on node3): actor W[3].worker[0] failed: boom"


def test_state_round_trips() -> None:
    r = rec(addr="tcp:127.0.0.1:5000", labels={"k": "v"}, now=5.0)
    state = r.to_state()
    assert state.proc_id == ProcId.parse("W[3]") and state.last_heartbeat == 5.0
    data = msgspec.msgpack.encode(state)
    assert msgspec.msgpack.decode(data, type=ProcSupervisionState) == state
    # A heartbeat carries only a few fields; the rest default.
    beat = ProcSupervisionState(proc_id=ProcId.parse("W[3]"), loop_lag_s=0.1)
    assert beat.health == "Alive" and beat.failed_actors == []
