"""Config keys from ``PALATINE_*`` variables: the boolean ones (``fork_server``) and the
microsecond ones (``idle_spin_us``)."""

from __future__ import annotations

import pytest

from palatine import config
from palatine.config import Config
from palatine.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("NO", False),
        ("off", False),
    ],
)
def test_fork_server_switch_reads_the_usual_spellings(text: str, value: bool) -> None:
    assert config.from_env({"PALATINE_FORK_SERVER": text}).fork_server is value


def test_fork_server_is_on_by_default_and_a_bad_switch_is_a_config_error() -> None:
    assert config.from_env({}).fork_server is True
    with pytest.raises(ConfigError, match="PALATINE_FORK_SERVER"):
        config.from_env({"PALATINE_FORK_SERVER": "maybe"})
    assert config.from_env({}, fork_server="0").fork_server is False


def test_idle_spin_reads_microseconds_and_zero_turns_it_off() -> None:
    assert config.from_env({}).idle_spin_us == 100
    assert config.from_env({"PALATINE_IDLE_SPIN_US": "250"}).idle_spin_us == 250
    assert config.from_env({"PALATINE_IDLE_SPIN_US": "0"}).idle_spin_us == 0
    for bad in ("-1", "1.5", "soon"):
        with pytest.raises(ConfigError, match="PALATINE_IDLE_SPIN_US: expected microseconds >= 0"):
            config.from_env({"PALATINE_IDLE_SPIN_US": bad})


def test_health_tick_and_stop_fallback_margin_have_their_variables() -> None:
    c = config.from_env(
        {"PALATINE_HEALTH_TICK_INTERVAL": "0.25", "PALATINE_STOP_FALLBACK_MARGIN": "7"}
    )
    assert (c.health_tick_interval_s, c.stop_fallback_margin_s) == (0.25, 7.0)
    d = config.from_env({})
    assert (d.health_tick_interval_s, d.stop_fallback_margin_s) == (
        None,
        3.0,
    )  # None: min(1, timeout/4)


def test_a_period_must_be_finite_while_a_timeout_may_be_endless() -> None:
    for var in ("PALATINE_SUPERVISION_UPDATE_INTERVAL", "PALATINE_HEALTH_TICK_INTERVAL"):
        with pytest.raises(ConfigError, match=f"{var}: expected a finite number of seconds > 0"):
            config.from_env({var: "inf"})
    assert config.from_env({"PALATINE_CALL_TIMEOUT": "inf"}).call_timeout_s == float("inf")


def test_describe_says_where_each_value_came_from() -> None:
    from palatine.config import describe

    rows = {s.key: s for s in describe({"PALATINE_KEEP_LOGS": "3", "PALATINE_RPC_TIMEOUT": ""})}
    assert set(rows) == set(Config.__struct_fields__)
    assert (rows["keep_logs"].value, rows["keep_logs"].source) == (3, "PALATINE_KEEP_LOGS")
    assert (rows["rpc_timeout_s"].value, rows["rpc_timeout_s"].source) == (30.0, "default")
    assert rows["collective_timeout_s"].variable == "PALATINE_COLLECTIVE_TIMEOUT"


def test_palatine_config_prints_every_key_and_refuses_a_bad_value() -> None:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PALATINE_WORKER_EXIT_TIMEOUT": "7"}
    out = subprocess.run(
        [sys.executable, "-m", "palatine", "config", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    doc = json.loads(out)
    assert doc["worker_exit_timeout_s"] == {
        "variable": "PALATINE_WORKER_EXIT_TIMEOUT",
        "value": 7.0,
        "source": "PALATINE_WORKER_EXIT_TIMEOUT",
    }
    assert len(doc) == len(Config.__struct_fields__)
    bad = subprocess.run(
        [sys.executable, "-m", "palatine", "config"],
        env={**os.environ, "PALATINE_COLLECTIVE_TIMEOUT": "soon"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        == "palatine config: PALATINE_COLLECTIVE_TIMEOUT: expected seconds > 0, got 'soon'"
    )


def test_system_restarts_zero_means_never_restart_and_a_negative_count_is_refused() -> None:
    assert config.from_env({"PALATINE_SYSTEM_RESTARTS": "0"}).system_restarts == 0
    assert config.from_env({"PALATINE_SYSTEM_RESTARTS": "2"}).system_restarts == 2
    for bad in ("-1", "often"):
        with pytest.raises(ConfigError, match="PALATINE_SYSTEM_RESTARTS: expected an integer >= 0"):
            config.from_env({"PALATINE_SYSTEM_RESTARTS": bad})
