"""Where address text may enter and where it may not.

Public entry points (`palatine.System`, `palatine.connect`, the CLI's ``--system-addr``)
take text and parse it once; internal APIs (`palatine.channel.serve` / `dial`,
`any_addr(peer=)`, `HeartbeatThread`) take a `ChannelAddr` only and say so at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import palatine
from palatine import channel
from palatine.channel.addr import ChannelAddr, any_addr
from palatine.cli import main
from palatine.hosting.heartbeat import HeartbeatThread
from palatine.ids import ActorId
from palatine.tensor.client import local

TEXT = "tcp:127.0.0.1:1"


def test_palatine_system_parses_address_text_once() -> None:
    assert palatine.System(TEXT).addr == ChannelAddr.tcp("127.0.0.1", 1)
    addr = ChannelAddr.abstract("s")
    assert palatine.System(addr).addr is addr


def test_palatine_system_given_bad_text_raises_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="System: invalid address 'bogus'"):
        palatine.System("bogus")


def test_palatine_system_given_neither_text_nor_address_raises_type_error() -> None:
    with pytest.raises(TypeError, match="System takes a ChannelAddr"):
        palatine.System(42)  # type: ignore[arg-type]


def test_channel_dial_given_text_raises_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"channel\.dial takes a ChannelAddr") as got:
        channel.dial(TEXT)  # type: ignore[arg-type]
    assert "parse text with ChannelAddr.parse" in str(got.value)


def test_channel_serve_given_text_raises_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"channel\.serve takes a ChannelAddr"):
        asyncio.run(channel.serve("local:0"))  # type: ignore[arg-type]


def test_any_addr_given_a_text_peer_raises_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"any_addr\(peer=\) takes a ChannelAddr"):
        any_addr("tcp", peer=TEXT)  # type: ignore[arg-type]


def test_heartbeat_thread_given_text_raises_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match="HeartbeatThread takes a ChannelAddr"):
        HeartbeatThread(
            TEXT,  # type: ignore[arg-type]
            sender=ActorId.parse("user[0].agent[0]"),
            make_update=lambda: None,  # type: ignore[arg-type,return-value]
        )


def test_the_guard_message_says_how_to_parse_text() -> None:
    with pytest.raises(TypeError) as got:
        channel.dial(TEXT)  # type: ignore[arg-type]
    text = str(got.value)
    assert text.startswith("channel.dial takes a ChannelAddr, not str 'tcp:127.0.0.1:1'")
    assert text.endswith("parse text with ChannelAddr.parse")


class _Reached(Exception):
    pass


@pytest.mark.parametrize(
    "given", [ChannelAddr.tcp("127.0.0.1", 7), "tcp:127.0.0.1:7"], ids=["ChannelAddr", "text"]
)
def test_connect_accepts_a_channel_addr_or_its_text(
    given: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    async def fake_connect(addr: Any, worker_world: Any, timeout: float) -> Any:
        seen.append(addr)
        raise _Reached

    monkeypatch.setattr(local, "_connect", fake_connect)
    with pytest.raises(_Reached):
        local.connect(given, "w", timeout_s=1)
    assert seen == [ChannelAddr.tcp("127.0.0.1", 7)]


@pytest.mark.parametrize("command", ["stop", "snapshot", "stacks", "top"])
def test_a_malformed_system_addr_is_a_usage_error_naming_it(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as got:
        main([command, "--system-addr", "foo"])
    assert got.value.code == 2
    err = capsys.readouterr().err
    assert f"palatine {command}: error: argument --system-addr: invalid address 'foo': " in err
    assert "no channel type specified" in err
