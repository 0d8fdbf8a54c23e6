"""Controller command validation, labels and env bounds, sans-IO."""

from __future__ import annotations

import pytest

from palatine.errors import ConfigError
from palatine.tensor.controller.startup import (
    ControllerCommand,
    ControllerTimeouts,
    parse_key_val,
    proc_labels,
    validate_command,
    world_labels,
)


def cmd(**kw: object) -> ControllerCommand:
    base: dict[str, object] = {
        "worker_world": "worker",
        "system_addr": "unix:@sys",
        "world_size": 4,
    }
    base.update(kw)
    return ControllerCommand(**base)  # type: ignore[arg-type]


def test_defaults_are_the_seeds() -> None:
    c = cmd()
    assert c.controller_actor_id == "controller[0].root"
    assert c.num_procs_per_host == 8
    assert c.worker_name == "worker"
    assert c.program is None
    assert (c.supervision_query_interval_s, c.supervision_update_interval_s) == (2, 2)
    assert c.worker_progress_check_interval_s == 10
    assert c.operation_timeout_s == 120
    assert c.operations_per_worker_progress_request == 100
    assert not c.fail_on_worker_timeout and not c.is_cpu_worker
    assert c.extra_proc_labels is None
    validate_command(c)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("k=v", ("k", "v")), ("k=v=3", ("k", "v=3")), ("k=", ("k", "")), ("=v", ("", "v"))],
)
def test_key_val_splits_at_the_first_equals(text: str, expected: tuple[str, str]) -> None:
    assert parse_key_val(text) == expected


def test_key_val_without_equals_has_the_seed_message() -> None:
    with pytest.raises(ValueError, match=r"^invalid KEY=value: no '=' found in 'foo'$"):
        parse_key_val("foo")


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"system_addr": "bogus:1"}, "--system-addr"),
        ({"worker_world": "9w"}, "--worker-world"),
        ({"worker_world": "hostw"}, "reserved"),
        ({"worker_world": "system"}, "reserved"),
        ({"controller_actor_id": "controller[1].root"}, "rank 0"),
        ({"controller_actor_id": "controller[0].root[2]"}, "pid 0"),
        ({"controller_actor_id": "hostc[0].root"}, "reserved"),
        ({"controller_actor_id": "user[0].root"}, "reserved"),
        ({"controller_actor_id": "controller[0].comm"}, "reserved"),
        ({"controller_actor_id": "controller[0].proc"}, "reserved"),
        ({"controller_actor_id": "worker[0].root"}, "differ from the worker world"),
        ({"controller_actor_id": "controller"}, "--controller-actor-id"),
        ({"world_size": 0}, "--world-size"),
        ({"num_procs_per_host": 0}, "--num-procs-per-host"),
        ({"worker_name": "comm"}, "--worker-name"),
        ({"worker_name": "1x"}, "--worker-name"),
        ({"operations_per_worker_progress_request": 0}, "operations-per-worker-progress-request"),
        ({"operation_timeout_s": 0.0}, "--operation-timeout-in-sec"),
        ({"supervision_query_interval_s": -1.0}, "--supervision-query-interval-in-sec"),
        ({"program": "   "}, "--program"),
        ({"program": "python 'unclosed"}, "--program"),
        ({"extra_proc_labels": [("proc.palatine.dev/role", "x")]}, "reserved"),
        ({"extra_proc_labels": [("", "x")]}, "empty key"),
    ],
)
def test_invalid_inputs_are_usage_errors(kw: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_command(cmd(**kw))
    assert fragment in str(info.value)


def test_valid_custom_ids_and_labels() -> None:
    c = cmd(
        controller_actor_id="ctl[0].boss",
        worker_name="trainer",
        program="palatine worker",
        extra_proc_labels=[("k", "v=3"), ("team", "ml")],
    )
    validate_command(c)
    assert proc_labels(c) == {
        "proc.palatine.dev/role": "controller",
        "proc.palatine.dev/workerWorld": "worker",
        "k": "v=3",
        "team": "ml",
    }
    assert world_labels(c) == {
        "world.palatine.dev/worker": "1",
        "world.palatine.dev/controllerActorId": "ctl[0].boss",
    }


def test_world_label_names_the_actor_without_pid() -> None:
    assert world_labels(cmd())["world.palatine.dev/controllerActorId"] == "controller[0].root"
    c = cmd(controller_actor_id="controller[0].root[0]")
    validate_command(c)
    assert world_labels(c)["world.palatine.dev/controllerActorId"] == "controller[0].root"


def test_timeouts_from_env() -> None:
    t = ControllerTimeouts.from_env({})
    assert (t.world_ready_s, t.spawn_s, t.stall_report_s, t.client_liveness_s) == (300, 120, 5, 30)
    t = ControllerTimeouts.from_env(
        {
            "PALATINE_CONTROLLER_WORLD_READY_TIMEOUT": "2",
            "PALATINE_CONTROLLER_SPAWN_TIMEOUT": "0.5",
            "PALATINE_STALL_REPORT_TIMEOUT": "1.5",
            "PALATINE_CLIENT_LIVENESS_TIMEOUT": "3",
        }
    )
    assert (t.world_ready_s, t.spawn_s, t.stall_report_s, t.client_liveness_s) == (2, 0.5, 1.5, 3)
    with pytest.raises(ConfigError, match="PALATINE_CONTROLLER_SPAWN_TIMEOUT"):
        ControllerTimeouts.from_env({"PALATINE_CONTROLLER_SPAWN_TIMEOUT": "soon"})
