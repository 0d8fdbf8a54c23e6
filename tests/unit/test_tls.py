"""Mutual TLS contexts exercised by real handshakes on 127.0.0.1.

The server thread and the client use blocking sockets with timeouts; every failure
closes the server's end, so a refused client sees an alert or EOF, never a hang.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from palatine.channel.tls import client_context, server_context, tls_files
from palatine.errors import ConfigError
from palatine.testing.certs import TestPki, make_test_pki, tls_env

MISSING = "tls transport requires PALATINE_TLS_CERT, PALATINE_TLS_KEY and PALATINE_TLS_CA"
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def _no_tls_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("PALATINE_TLS_CERT", "PALATINE_TLS_KEY", "PALATINE_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    yield


def _context(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], server: bool) -> ssl.SSLContext:
    """Build a context the way a process would: from its environment, at call time."""
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        return server_context() if server else client_context()


Outcome = bytes | BaseException


def _exchange(
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    server_hostname: str = "127.0.0.1",
    host: str = "127.0.0.1",
) -> tuple[Outcome, Outcome]:
    """Handshake, then one echo; return what each side got (bytes or the exception)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    outcome: dict[str, Outcome] = {}
    with socket.create_server((host, 0), family=family) as listener:
        listener.settimeout(TIMEOUT_S)
        port = listener.getsockname()[1]

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(TIMEOUT_S)
                    with server_ctx.wrap_socket(conn, server_side=True) as tls:
                        data = tls.recv(5)
                        tls.sendall(data.upper())
                        outcome["server"] = data
            except (ssl.SSLError, OSError) as exc:
                outcome["server"] = exc

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with (
                socket.create_connection((host, port), timeout=TIMEOUT_S) as raw,
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls,
            ):
                tls.sendall(b"hello")
                outcome["client"] = tls.recv(5)
        except (ssl.SSLError, OSError) as exc:
            outcome["client"] = exc
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()
    return outcome["server"], outcome["client"]


def test_mutual_tls_handshake_succeeds(pki: TestPki, monkeypatch: pytest.MonkeyPatch) -> None:
    server_ctx = _context(monkeypatch, tls_env(pki, "server"), server=True)
    client_ctx = _context(monkeypatch, tls_env(pki, "client"), server=False)
    assert server_ctx.verify_mode == ssl.CERT_REQUIRED
    assert client_ctx.verify_mode == ssl.CERT_REQUIRED and client_ctx.check_hostname
    assert _exchange(server_ctx, client_ctx) == (b"hello", b"HELLO")
    # The server certificate also carries the name and the IPv6 loopback.
    assert _exchange(server_ctx, client_ctx, server_hostname="localhost") == (b"hello", b"HELLO")
    if socket.has_ipv6:
        try:
            result = _exchange(server_ctx, client_ctx, server_hostname="::1", host="::1")
        except OSError:
            pass  # no IPv6 loopback on this machine
        else:
            assert result == (b"hello", b"HELLO")


def test_asyncio_streams_with_the_contexts(pki: TestPki, monkeypatch: pytest.MonkeyPatch) -> None:
    server_ctx = _context(monkeypatch, tls_env(pki, "server"), server=True)
    client_ctx = _context(monkeypatch, tls_env(pki, "client"), server=False)
    peer_subjects: list[object] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_subjects.append(writer.get_extra_info("peercert")["subject"])
        writer.write((await reader.readexactly(4))[::-1])
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def main() -> bytes:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        async with server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname="127.0.0.1"
            )
            writer.write(b"ping")
            reply = await reader.readexactly(4)
            writer.close()
            await writer.wait_closed()
            return reply

    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT_S)) == b"gnip"
    assert "palatine test client" in repr(peer_subjects)


def _assert_refused(server: Outcome, client: Outcome) -> None:
    assert isinstance(server, ssl.SSLError), server
    # With TLS 1.3 the client may finish its half of the handshake and only then read
    # the server's alert (or EOF): either way it never gets an answer.
    assert client != b"HELLO"
    assert isinstance(client, OSError) or client == b"", client


def test_client_without_certificate_is_refused(
    pki: TestPki, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_ctx = _context(monkeypatch, tls_env(pki, "server"), server=True)
    bare_client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare_client.load_verify_locations(cafile=str(pki.ca))
    server, client = _exchange(server_ctx, bare_client)
    _assert_refused(server, client)
    assert "certificate" in str(server).lower()


def test_client_certificate_from_another_ca_is_refused(
    pki: TestPki, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_ctx = _context(monkeypatch, tls_env(pki, "server"), server=True)
    other_client = _context(monkeypatch, tls_env(pki, "other_client"), server=False)
    server, client = _exchange(server_ctx, other_client)
    _assert_refused(server, client)


def test_client_refuses_a_server_from_another_ca(
    pki: TestPki, monkeypatch: pytest.MonkeyPatch
) -> None:
    other_server = _context(monkeypatch, tls_env(pki, "other_server"), server=True)
    client_ctx = _context(monkeypatch, tls_env(pki, "client"), server=False)
    server, client = _exchange(other_server, client_ctx)
    assert isinstance(client, ssl.SSLCertVerificationError), client
    assert isinstance(server, OSError)


def test_client_checks_the_server_name(pki: TestPki, monkeypatch: pytest.MonkeyPatch) -> None:
    server_ctx = _context(monkeypatch, tls_env(pki, "server"), server=True)
    client_ctx = _context(monkeypatch, tls_env(pki, "client"), server=False)
    server, client = _exchange(server_ctx, client_ctx, server_hostname="10.9.9.9")
    assert isinstance(client, ssl.SSLCertVerificationError), client
    assert "10.9.9.9" in str(client)
    assert isinstance(server, OSError)


@pytest.mark.parametrize(
    "present", [(), ("PALATINE_TLS_CERT",), ("PALATINE_TLS_CERT", "PALATINE_TLS_KEY")]
)
def test_missing_variables_are_a_config_error(
    pki: TestPki, monkeypatch: pytest.MonkeyPatch, present: tuple[str, ...]
) -> None:
    env = tls_env(pki, "server")
    for var in present:
        monkeypatch.setenv(var, env[var])
    for build in (server_context, client_context, tls_files):
        with pytest.raises(ConfigError) as info:
            build()
        assert str(info.value) == MISSING


def test_unreadable_files_name_the_variable(
    pki: TestPki, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = tls_env(pki, "server")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PALATINE_TLS_CA", str(tmp_path / "missing-ca.pem"))
    with pytest.raises(ConfigError, match="PALATINE_TLS_CA"):
        server_context()
    monkeypatch.setenv("PALATINE_TLS_CA", env["PALATINE_TLS_CA"])
    monkeypatch.setenv("PALATINE_TLS_KEY", str(pki.client_key))  # does not match the cert
    with pytest.raises(ConfigError, match="PALATINE_TLS_CERT/PALATINE_TLS_KEY"):
        client_context()


def test_pki_files_and_roles(pki: TestPki) -> None:
    for key_file in (pki.server_key, pki.client_key, pki.other_client_key, pki.other_server_key):
        assert key_file.stat().st_mode & 0o777 == 0o600
    assert tls_env(pki, "client") == {
        "PALATINE_TLS_CERT": str(pki.client_cert),
        "PALATINE_TLS_KEY": str(pki.client_key),
        "PALATINE_TLS_CA": str(pki.ca),
    }
    with pytest.raises(ValueError, match="unknown TLS role"):
        tls_env(pki, "admin")
