"""Decoding ``palatine serve`` request lines, sans-IO."""

from __future__ import annotations

import json

import pytest

from palatine.cli.serving import (
    ExitRequest,
    HostCommand,
    InvalidRequest,
    RunRequest,
    SystemCommand,
    finished_line,
    parse_request,
)
from palatine.tensor.controller.startup import ControllerCommand


def line(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_exit_forms() -> None:
    assert parse_request(line({"Exit": []})) == ExitRequest()
    assert parse_request(line({"Exit": None})) == ExitRequest()
    assert parse_request(line("Exit")) == ExitRequest()
    with pytest.raises(InvalidRequest, match="Exit takes no fields"):
        parse_request(line({"Exit": [1]}))


def test_run_system_with_defaults() -> None:
    req = parse_request(line({"Run": {"System": {"system_addr": "unix:"}}}))
    assert isinstance(req, RunRequest) and req.role == "System"
    assert req.command == SystemCommand(system_addr="unix:")
    # Omitted: the configuration decides (PALATINE_* variables, else 20 and 10 s), as
    # for `palatine system` without the flags.
    assert (
        req.command.supervision_update_timeout_s,
        req.command.world_eviction_timeout_s,
    ) == (None, None)


def test_run_host_accepts_floats_and_ints() -> None:
    req = parse_request(
        line(
            {
                "Run": {
                    "Host": {
                        "system_addr": "tcp:127.0.0.1:5000",
                        "host_world": "hostw",
                        "host_rank": 1,
                        "supervision_update_interval_in_sec": 0.5,
                    }
                }
            }
        )
    )
    assert isinstance(req, RunRequest)
    assert req.command == HostCommand(
        system_addr="tcp:127.0.0.1:5000",
        host_world="hostw",
        host_rank=1,
        supervision_update_interval_s=0.5,
    )


def test_run_controller_full_shape_of_the_interface_doc() -> None:
    fields = {
        "worker_world": "worker",
        "system_addr": "unix:@s",
        "controller_actor_id": "controller[0].root",
        "world_size": 4,
        "num_procs_per_host": 8,
        "worker_name": "worker",
        "program": None,
        "supervision_query_interval_in_sec": 2,
        "supervision_update_interval_in_sec": 2,
        "worker_progress_check_interval_in_sec": 10,
        "operation_timeout_in_sec": 120,
        "operations_per_worker_progress_request": 100,
        "fail_on_worker_timeout": False,
        "is_cpu_worker": False,
        "extra_proc_labels": [["k", "v"]],
    }
    req = parse_request(line({"Run": {"Controller": fields}}))
    assert isinstance(req, RunRequest) and isinstance(req.command, ControllerCommand)
    assert req.command.extra_proc_labels == [("k", "v")]
    minimal = parse_request(
        line(
            {
                "Run": {
                    "Controller": {"worker_world": "w", "system_addr": "unix:@s", "world_size": 2}
                }
            }
        )
    )
    assert isinstance(minimal, RunRequest)
    assert minimal.command == ControllerCommand(
        worker_world="w", system_addr="unix:@s", world_size=2
    )


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "expected"),
        (line({"Run": {}, "Exit": []}), "expected"),
        (line({"Start": {}}), "unknown variant 'Start'"),
        (line({"Run": "System"}), "Run expects"),
        (line({"Run": {"Worker": {}}}), "unknown role 'Worker'"),
        (line({"Run": {"System": []}}), "expects an object"),
        (line({"Run": {"System": {}}}), "missing required field `system_addr`"),
        (line({"Run": {"System": {"system_addr": "unix:", "x": 1}}}), "unknown field `x`"),
        (line({"Run": {"System": {"system_addr": 5}}}), "$.system_addr"),
        (line({"Run": {"System": {"system_addr": "carrier-pigeon:1"}}}), "carrier-pigeon"),
        (
            line({"Run": {"System": {"system_addr": "unix:", "world_eviction_timeout_in_sec": 0}}}),
            "> 0",
        ),
        (
            line({"Run": {"Host": {"system_addr": "unix:@s", "host_world": "w", "host_rank": 0}}}),
            "must start with 'host'",
        ),
        (
            line(
                {
                    "Run": {
                        "Host": {"system_addr": "unix:@s", "host_world": "hostw", "host_rank": -1}
                    }
                }
            ),
            "host_rank",
        ),
        (
            line(
                {
                    "Run": {
                        "Controller": {
                            "worker_world": "w",
                            "system_addr": "unix:@s",
                            "world_size": 0,
                        }
                    }
                }
            ),
            "--world-size",
        ),
        (
            line(
                {
                    "Run": {
                        "Controller": {
                            "worker_world": "w",
                            "system_addr": "unix:@s",
                            "world_size": 2,
                            "fail_on_worker_timeout": 1,
                        }
                    }
                }
            ),
            "fail_on_worker_timeout",
        ),
        (
            line(
                {
                    "Run": {
                        "Controller": {
                            "worker_world": "w",
                            "system_addr": "unix:@s",
                            "world_size": 2,
                            "extra_proc_labels": [["k"]],
                        }
                    }
                }
            ),
            "extra_proc_labels",
        ),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (
            b'{"Run": {"System": {"system_addr": "unix:", "supervision_update_timeout_in_sec": NaN}}}',
            "not valid JSON",
        ),
        (
            line(
                {
                    "Run": {
                        "Host": {
                            "system_addr": "unix:@s",
                            "host_world": "hostw",
                            "host_rank": 2**64,
                        }
                    }
                }
            ),
            "Run.Host.host_rank must be in [0, 2**64)",
        ),
        (
            line(
                {
                    "Run": {
                        "Host": {"system_addr": "unix:@s", "host_world": "host w", "host_rank": 0}
                    }
                }
            ),
            "Run.Host.host_world 'host w'",
        ),
    ],
)
def test_invalid_requests_say_what_and_where(raw: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw)
    assert fragment in str(info.value)


def test_finished_line() -> None:
    assert finished_line(None) == b'{"Finished":{"error":null}}\n'
    assert json.loads(finished_line("boom")) == {"Finished": {"error": "boom"}}
