"""Cluster token resolution, file checks, caching and propagation.

Every test runs with a clean environment and cache, and
points ``XDG_CONFIG_HOME`` at a temporary directory so the real per-user file is
never read or written.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from palatine.channel import token as token_mod
from palatine.channel.token import (
    default_token_path,
    generate_token,
    reset_token_cache,
    resolve_token,
    set_token,
    token_env,
)
from palatine.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv("PALATINE_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("PALATINE_CLUSTER_TOKEN_FILE", raising=False)
    config_home = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    reset_token_cache()
    yield config_home
    reset_token_cache()


def _write(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_env_token_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", "a" * 32)
    token_file = _write(tmp_path / "t", "b" * 32, 0o600)
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN_FILE", str(token_file))
    assert resolve_token() == b"a" * 32
    assert not default_token_path().exists()


def test_token_file_is_read_and_stripped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = _write(tmp_path / "t", "  secret-secret-secret-1\n\n", 0o600)
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN_FILE", str(token_file))
    assert resolve_token() == b"secret-secret-secret-1"
    assert not default_token_path().exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602])
def test_token_file_open_to_others_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    token_file = _write(tmp_path / "t", "x" * 32, mode)
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN_FILE", str(token_file))
    with pytest.raises(ConfigError) as info:
        resolve_token()
    message = str(info.value)
    assert str(token_file) in message and f"{mode:04o}" in message


def test_owner_only_modes_are_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for mode in (0o600, 0o400, 0o700):
        token_file = _write(tmp_path / f"t{mode:o}", "y" * 32, mode)
        monkeypatch.setenv("PALATINE_CLUSTER_TOKEN_FILE", str(token_file))
        reset_token_cache()
        assert resolve_token() == b"y" * 32


def test_per_user_file_0644_is_refused(_clean: Path) -> None:
    path = default_token_path()
    assert path == _clean / "palatine" / "cluster-token"
    path.parent.mkdir(parents=True)
    _write(path, "z" * 64, 0o644)
    with pytest.raises(ConfigError, match="0644"):
        resolve_token()


def test_missing_token_file_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN_FILE", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="PALATINE_CLUSTER_TOKEN_FILE"):
        resolve_token()


def test_per_user_file_is_created_0600_and_reused(_clean: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        first = resolve_token()
    finally:
        os.umask(old_umask)
    path = _clean / "palatine" / "cluster-token"
    assert _mode(path) == 0o600
    assert len(first) == 64 and bytes.fromhex(first.decode())  # 32 random bytes, hex
    assert path.read_text().strip() == first.decode()
    assert [p.name for p in path.parent.iterdir()] == ["cluster-token"]  # no temp leftovers
    reset_token_cache()
    assert resolve_token() == first


def test_existing_per_user_file_is_not_replaced(_clean: Path) -> None:
    path = default_token_path()
    path.parent.mkdir(parents=True)
    _write(path, "p" * 40 + "\n", 0o600)
    assert resolve_token() == b"p" * 40
    assert path.read_text() == "p" * 40 + "\n"


def test_default_path_without_xdg_config_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (None, "", "relative/dir"):
        if value is None:
            monkeypatch.delenv("XDG_CONFIG_HOME")
        else:
            monkeypatch.setenv("XDG_CONFIG_HOME", value)
        assert default_token_path() == tmp_path / ".config" / "palatine" / "cluster-token"


def test_empty_tokens_are_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", "")
    with pytest.raises(ConfigError, match="empty cluster token"):
        resolve_token()
    monkeypatch.delenv("PALATINE_CLUSTER_TOKEN")
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN_FILE", str(_write(tmp_path / "t", " \n", 0o600)))
    with pytest.raises(ConfigError, match="empty cluster token"):
        resolve_token()
    with pytest.raises(ConfigError, match="empty cluster token"):
        set_token(b"")


def test_short_token_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", "short")
    with caplog.at_level(logging.WARNING, logger=token_mod.__name__):
        assert resolve_token() == b"short"
        assert resolve_token() == b"short"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "5 bytes" in warnings[0].getMessage()


def test_sixteen_bytes_do_not_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", "k" * 16)
    with caplog.at_level(logging.WARNING, logger=token_mod.__name__):
        resolve_token()
    assert not caplog.records


def test_token_is_cached_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", "first-token-0123456789")
    assert resolve_token() == b"first-token-0123456789"
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", "second-token-0123456789")
    assert resolve_token() == b"first-token-0123456789"
    reset_token_cache()
    assert resolve_token() == b"second-token-0123456789"


def test_set_token_installs_a_private_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN", "env-token-0123456789")
    private = generate_token()
    set_token(private)
    assert resolve_token() == private.encode()


def test_generate_token_and_token_env_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = {generate_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(len(t) == 64 and bytes.fromhex(t) for t in tokens)

    token = generate_token()
    env = token_env(token.encode())
    assert env == {"PALATINE_CLUSTER_TOKEN": token} == token_env(token)
    # What a launched child resolves from that environment is the same token.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert resolve_token() == token.encode()


def test_a_client_resolution_never_creates_the_per_user_file_and_says_where_to_look(
    _clean: Path,
) -> None:
    with pytest.raises(ConfigError, match="a client never creates one") as e:
        resolve_token(create=False)
    assert "PALATINE_CLUSTER_TOKEN_FILE=<log dir>/token" in str(e.value)
    assert not default_token_path().exists() and not _clean.exists()
    assert resolve_token() != b""  # a role that serves still creates it
    assert default_token_path().exists()
