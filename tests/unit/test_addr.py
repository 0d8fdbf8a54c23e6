"""Channel addresses: parse/print, errors, any_addr and the private unix directory.

Covers parsing, `any_addr` and binding real sockets ourselves (serve and dial belong to
the net channel's tests).
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palatine import config
from palatine.channel import addr as addr_mod
from palatine.channel.addr import (
    ChannelAddr,
    any_addr,
    parse,
    random_abstract_name,
    remove_socket_file,
    secure_socket_file,
    unix_socket_dir,
)
from palatine.errors import AddrParseError, ConfigError


@pytest.fixture(autouse=True)
def _no_host_ip() -> Iterator[None]:
    """Ignore a PALATINE_HOST_IP of the machine running the tests."""
    with config.override(host_ip=None):
        yield


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short private directory (pytest's tmp_path can exceed the 107-byte sun_path)."""
    path = Path(tempfile.mkdtemp(prefix="pl-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def runtime_dir(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point XDG_RUNTIME_DIR at a fresh directory."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    return short_dir


# -- parse and print -------------------------------------------------------------------

CANONICAL = [
    "tcp:127.0.0.1:80",
    "tcp:127.0.0.1:0",
    "tcp:[::1]:8080",
    "tcp:[2401:db00::1]:1234",
    "tcp:localhost:65535",
    "tcp:host.example:1",
    "tls:127.0.0.1:443",
    "tls:[::1]:0",
    "tls:host.example:443",
    "unix:/tmp/palatine.sock",
    "unix:relative/dir/sock",
    "unix:/tmp/with!bang",
    "unix:@abstract-name",
    "unix:",
    "local:0",
    "local:1",
    "local:12345",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_forms_round_trip(text: str) -> None:
    a = parse(text)
    assert str(a) == text
    assert parse(str(a)) == a
    assert ChannelAddr.parse(text) == a
    assert a.transport == text.split(":", 1)[0]


def test_legacy_bang_separator_equals_colon_form() -> None:
    a = parse("tcp!127.0.0.1:80")
    assert a == parse("tcp:127.0.0.1:80")
    assert str(a) == "tcp:127.0.0.1:80"
    assert parse("unix!@x") == parse("unix:@x")
    assert parse("local!3") == ChannelAddr.local(3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1", "no channel type specified: '127.0.0.1'"),
        ("xxx:foo", "no such channel type: xxx"),
        ("tcp:abcdef..123124", "invalid socket address syntax: 'abcdef..123124'"),
        ("local:abc", "invalid local port: 'abc'"),
        ("unix:/" + "p" * 107, "unix socket path too long"),
        ("unix:@" + "n" * 107, "unix socket path too long"),
    ],
)
def test_error_table_messages_are_exact(text: str, message: str) -> None:
    with pytest.raises(AddrParseError) as info:
        parse(text)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_unix_path_at_the_limit_is_accepted() -> None:
    path = "/" + "p" * 106  # 107 bytes: sun_path is 108 with the terminating NUL
    assert parse("unix:" + path).path == path


@pytest.mark.parametrize(
    "rest",
    [
        "",
        "127.0.0.1",
        "127.0.0.1:",
        ":80",
        "127.0.0.1:65536",
        "127.0.0.1:-1",
        "127.0.0.1:8a",
        "1.2.3:80",
        "256.1.1.1:80",
        "[1.2.3.4]:80",
        "[::1]",
        "[::1]80",
        "[::g]:80",
        "bad host:80",
        "-leading.example:80",
        "a..b:80",
        "2401:db00::zz:80",
        "host\n:80",
        "127.0.0.1:80\n",
    ],
)
def test_invalid_tcp_addresses(rest: str) -> None:
    for kind in ("tcp", "tls"):
        with pytest.raises(AddrParseError) as info:
            parse(f"{kind}:{rest}")
        assert str(info.value) == f"invalid socket address syntax: {rest!r}"


@pytest.mark.parametrize("rest", ["", "-1", "+1", " 1", "1\n", "1.0", "0x10", "\u0661"])
def test_invalid_local_ports(rest: str) -> None:
    with pytest.raises(AddrParseError, match="invalid local port"):
        parse(f"local:{rest}")


def test_tls_raw_ipv6_splits_at_last_colon_and_prints_bracketed() -> None:
    a = parse("tls:2401:db00::1:1234")
    assert (a.transport, a.host, a.port) == ("tls", "2401:db00::1", 1234)
    assert str(a) == "tls:[2401:db00::1]:1234"
    assert parse("tcp:2401:db00::1:1234") == ChannelAddr.tcp("2401:db00::1", 1234)


def test_ipv6_hosts_are_canonicalized() -> None:
    a = parse("tcp:[2401:DB00:0:0::0001]:7")
    assert a.host == "2401:db00::1"
    assert a == parse("tcp:[2401:db00::1]:7")


def test_unix_forms() -> None:
    random_ = parse("unix:")
    assert random_.is_abstract and random_.name == "" and random_.is_any
    assert parse("unix:@") == random_
    named = parse("unix:@svc")
    assert named.is_abstract and named.name == "svc" and not named.is_any
    path = parse("unix:/run/x.sock")
    assert path.path == "/run/x.sock" and not path.is_abstract and not path.is_any


def test_parse_takes_text_only() -> None:
    a = parse("tcp:127.0.0.1:5")
    with pytest.raises(TypeError):
        parse(a)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse(5)  # type: ignore[arg-type]


@settings(deadline=None)
@given(
    ip=st.ip_addresses(),
    port=st.integers(min_value=0, max_value=65535),
    kind=st.sampled_from(["tcp", "tls"]),
)
def test_ip_addresses_round_trip(ip: object, port: int, kind: str) -> None:
    a = ChannelAddr.tcp(str(ip), port) if kind == "tcp" else ChannelAddr.tls(str(ip), port)
    assert parse(str(a)) == a
    assert a.host == str(ip)


@settings(deadline=None)
@given(
    name=st.text(
        st.characters(blacklist_characters="\0", blacklist_categories=["Cs"]),
        min_size=1,
        max_size=40,
    )
)
def test_abstract_names_and_paths_round_trip(name: str) -> None:
    a = ChannelAddr.abstract(name)
    assert parse(str(a)) == a
    p = ChannelAddr.unix("/" + name)
    assert parse(str(p)) == p


# -- value semantics -------------------------------------------------------------------


def test_addresses_are_immutable_hashable_values() -> None:
    a = parse("tcp:127.0.0.1:80")
    b = parse("tcp!127.0.0.1:80")
    assert a == b and hash(a) == hash(b)
    assert len({a, b, parse("tcp:127.0.0.1:81")}) == 2
    with pytest.raises(AttributeError):
        a.port = 81  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(a)) == a
    for text in CANONICAL:
        x = parse(text)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(x), type=ChannelAddr) == x
    assert repr(a) == "<ChannelAddr tcp:127.0.0.1:80>"


def test_direct_construction_checks_the_shape() -> None:
    with pytest.raises(AddrParseError, match="no such channel type: udp"):
        ChannelAddr("udp", host="x", port=1)
    with pytest.raises(AddrParseError):
        ChannelAddr("unix")
    with pytest.raises(AddrParseError):
        ChannelAddr("tcp", host="x", port=1, path="/p")
    with pytest.raises(AddrParseError):
        ChannelAddr.unix("@looks-abstract")


def test_properties() -> None:
    assert parse("tcp:127.0.0.1:1").family == socket.AF_INET
    assert parse("tls:[::1]:1").family == socket.AF_INET6
    assert parse("tcp:host.example:1").family == socket.AF_UNSPEC
    assert parse("unix:@x").family == socket.AF_UNIX
    with pytest.raises(ValueError):
        _ = parse("local:1").family

    assert parse("tcp:127.0.0.5:1").is_loopback
    assert parse("tcp:[::1]:1").is_loopback
    assert parse("tcp:localhost:1").is_loopback
    assert not parse("tcp:10.0.0.1:1").is_loopback
    assert not parse("tcp:host.example:1").is_loopback
    assert parse("unix:/x").is_loopback and parse("local:1").is_loopback

    assert parse("tcp:1.2.3.4:0").is_any and not parse("tcp:1.2.3.4:1").is_any
    assert parse("local:0").is_any and not parse("local:2").is_any
    assert parse("tcp:1.2.3.4:1").is_net and not parse("local:1").is_net

    assert parse("tcp:1.2.3.4:5").sockaddr() == ("1.2.3.4", 5)
    assert parse("tls:[::1]:5").sockaddr() == ("::1", 5)
    assert parse("unix:/x/y").sockaddr() == "/x/y"
    assert parse("unix:@svc").sockaddr() == "\0svc"
    with pytest.raises(ValueError):
        parse("unix:").sockaddr()
    with pytest.raises(ValueError):
        parse("local:1").sockaddr()

    assert parse("tcp:1.2.3.4:0").with_port(9) == parse("tcp:1.2.3.4:9")
    assert parse("local:0").with_port(4) == parse("local:4")
    assert parse("unix:").with_name("n") == parse("unix:@n")


def test_random_abstract_names_are_unique() -> None:
    names = {random_abstract_name() for _ in range(1000)}
    assert len(names) == 1000
    assert all(str(os.getpid()) in n for n in names)


# -- real sockets: from_bound ----------------------------------------------------------


def test_tcp_bound_port_is_reported_and_dialable() -> None:
    a = any_addr("tcp", peer=parse("tcp:127.0.0.1:9"))
    with socket.socket(a.family, socket.SOCK_STREAM) as server:
        server.bind(a.sockaddr())
        server.listen()
        bound = ChannelAddr.from_bound("tcp", server)
        assert bound.host == a.host and bound.port != 0 and not bound.is_any
        assert parse(str(bound)) == bound
        with socket.create_connection((bound.host, bound.port), timeout=5):
            conn, _ = server.accept()
            conn.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        tls = ChannelAddr.from_bound("tls", other)
        assert tls.transport == "tls" and tls.port == other.getsockname()[1]


def test_from_bound_host_override_and_transport_mismatch() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        bound = ChannelAddr.from_bound("tcp", s, host="10.1.2.3")
        assert bound.host == "10.1.2.3" and bound.port == s.getsockname()[1]
        with pytest.raises(ValueError):
            ChannelAddr.from_bound("unix", s)


def test_abstract_socket_bind_and_connect() -> None:
    a = parse("unix:").with_name(random_abstract_name())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(a.sockaddr())
        server.listen()
        bound = ChannelAddr.from_bound("unix", server)
        assert bound == a
        assert parse(str(bound)) == bound
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(5)
            client.connect(bound.sockaddr())
            conn, _ = server.accept()
            conn.close()
        with pytest.raises(ValueError):
            ChannelAddr.from_bound("tcp", server)


# -- any_addr: tcp/tls -----------------------------------------------------------------


def test_any_addr_loopback_peer_gives_loopback() -> None:
    a = any_addr("tcp", peer=parse("tcp:127.0.0.1:9"))
    assert a == parse("tcp:127.0.0.1:0")
    assert any_addr("tls", peer=parse("tls:[::1]:9")) == parse("tls:[::1]:0")
    assert any_addr("tcp", peer=parse("tcp:localhost:9")) == parse("tcp:127.0.0.1:0")


def test_host_ip_forces_the_host() -> None:
    with config.override(host_ip="10.1.2.3"):
        assert any_addr("tcp", peer=parse("tcp:127.0.0.1:9")) == parse("tcp:10.1.2.3:0")
        assert any_addr("tls") == parse("tls:10.1.2.3:0")
    with config.override(host_ip="[2401:db00::1]"):
        assert str(any_addr("tcp")) == "tcp:[2401:db00::1]:0"


def test_host_ip_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALATINE_HOST_IP", "10.1.2.3")
    with config.override(host_ip=config.from_env().host_ip):
        assert any_addr("tcp", peer=parse("tcp:127.0.0.1:9")).host == "10.1.2.3"


def test_bad_host_ip_is_a_config_error() -> None:
    with (
        config.override(host_ip="not a host"),
        pytest.raises(ConfigError, match="PALATINE_HOST_IP"),
    ):
        any_addr("tcp")


def test_any_addr_routes_towards_a_remote_peer_and_is_bindable() -> None:
    # Whatever this machine's routing, the chosen host must be one of our own addresses.
    a = any_addr("tcp", peer=parse("tcp:192.0.2.1:9"))  # TEST-NET-1: nothing is sent
    assert a.port == 0 and a.family in (socket.AF_INET, socket.AF_INET6)
    with socket.socket(a.family, socket.SOCK_STREAM) as s:
        s.bind(a.sockaddr())


def test_any_addr_fallback_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addr_mod, "_route_ip", lambda peer: "10.9.8.7")
    monkeypatch.setattr(addr_mod, "_hostname_ip", lambda: "10.5.5.5")
    assert any_addr("tcp", peer=parse("tcp:192.0.2.1:9")).host == "10.9.8.7"
    assert any_addr("tcp").host == "10.5.5.5"
    assert any_addr("tcp", peer=parse("unix:@x")).host == "10.5.5.5"
    monkeypatch.setattr(addr_mod, "_route_ip", lambda peer: None)
    assert any_addr("tcp", peer=parse("tcp:192.0.2.1:9")).host == "10.5.5.5"
    monkeypatch.setattr(addr_mod, "_hostname_ip", lambda: None)
    assert any_addr("tcp", peer=parse("tcp:192.0.2.1:9")) == parse("tcp:127.0.0.1:0")


def test_any_addr_local_and_unknown() -> None:
    assert any_addr("local") == parse("local:0")
    with pytest.raises(AddrParseError, match="no such channel type: udp"):
        any_addr("udp")


# -- any_addr: unix and its private directory -------------------------------------------


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_any_addr_unix_is_a_private_path_socket(runtime_dir: Path) -> None:
    a = any_addr("unix")
    assert a.transport == "unix" and a.path is not None and not a.is_abstract
    directory = Path(a.path).parent
    assert directory == runtime_dir / "palatine" == unix_socket_dir()
    assert _mode(directory) == 0o700
    assert Path(a.path).name.startswith(f"{os.getpid()}-")
    assert len(os.fsencode(a.path)) <= 107
    assert any_addr("unix") != a  # unique per call

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(a.sockaddr())
        secure_socket_file(a)
        server.listen()
        assert ChannelAddr.from_bound("unix", server) == a
        assert stat.S_ISSOCK(os.lstat(a.path).st_mode)
        assert _mode(a.path) == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(5)
            client.connect(a.sockaddr())
            conn, _ = server.accept()
            conn.close()
    remove_socket_file(a)
    assert not os.path.exists(a.path)
    remove_socket_file(a)  # already gone: fine


def test_remove_socket_file_leaves_other_files_alone(short_dir: Path) -> None:
    regular = short_dir / "not-a-socket"
    regular.write_text("x")
    remove_socket_file(ChannelAddr.unix(str(regular)))
    assert regular.exists()


def test_unix_dir_falls_back_to_temp_dir(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(short_dir))
    a = any_addr("unix")
    assert a.path is not None
    assert Path(a.path).parent == short_dir / f"palatine-{os.getuid()}"
    assert _mode(Path(a.path).parent) == 0o700


def test_too_long_runtime_dir_falls_back_to_temp_dir(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = short_dir / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", str(short_dir))
    a = any_addr("unix")
    assert a.path is not None and Path(a.path).parent == short_dir / f"palatine-{os.getuid()}"


def test_loose_existing_directory_is_tightened(runtime_dir: Path) -> None:
    private = runtime_dir / "palatine"
    private.mkdir()
    os.chmod(private, 0o755)
    any_addr("unix")
    assert _mode(private) == 0o700


def test_foreign_directory_is_refused(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (runtime_dir / "palatine").mkdir(mode=0o700)
    owner = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(ConfigError, match=f"owned by uid {owner}, not {owner + 1}"):
        any_addr("unix")


def test_symlinked_directory_is_refused(runtime_dir: Path, short_dir: Path) -> None:
    target = short_dir / "elsewhere"
    target.mkdir(mode=0o700)
    (runtime_dir / "palatine").symlink_to(target)
    with pytest.raises(ConfigError, match="not a directory"):
        any_addr("unix")
