"""The HMAC challenge/response state machines, sans-IO."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palatine.wire.frames import Ack, Auth, AuthOk, FrameParser, Hello, Reject, encode_frame
from palatine.wire.handshake import (
    AUTH_FAILED,
    SERVER_AUTH_FAILED,
    ClientHandshake,
    HandshakeError,
    ServerHandshake,
    client_mac,
    server_mac,
)

TOKEN = b"t" * 32


def run(server: ServerHandshake, client: ClientHandshake) -> AuthOk | Reject:
    auth = client.receive(server.hello())
    assert isinstance(auth, Auth)
    return server.receive(auth)


def test_mutual_authentication_succeeds() -> None:
    server, client = ServerHandshake(TOKEN), ClientHandshake(TOKEN)
    reply = run(server, client)
    assert isinstance(reply, AuthOk) and server.done
    assert client.receive(reply) is None
    assert client.done


def test_macs_follow_the_spec_formula() -> None:
    ns, nc = b"s" * 32, b"c" * 32
    assert (
        client_mac(TOKEN, ns, nc)
        == hmac.new(TOKEN, b"palatine/1 client" + ns + nc, hashlib.sha256).digest()
    )
    assert (
        server_mac(TOKEN, nc, ns)
        == hmac.new(TOKEN, b"palatine/1 server" + nc + ns, hashlib.sha256).digest()
    )
    server = ServerHandshake(TOKEN, nonce=ns)
    client = ClientHandshake(TOKEN, nonce=nc)
    auth = client.receive(server.hello())
    assert auth == Auth(1, nc, client_mac(TOKEN, ns, nc))
    assert server.receive(auth) == AuthOk(server_mac(TOKEN, nc, ns))


def test_nonces_are_fresh_32_bytes() -> None:
    a, b = ServerHandshake(TOKEN), ServerHandshake(TOKEN)
    assert len(a.nonce) == 32 and a.nonce != b.nonce
    assert a.hello() == Hello(1, a.nonce)


def test_wrong_token_is_rejected_with_the_exact_text() -> None:
    server, client = ServerHandshake(TOKEN), ClientHandshake(b"w" * 32)
    reply = run(server, client)
    assert reply == Reject("authentication failed")
    assert server.state == "failed" and server.failure == AUTH_FAILED
    with pytest.raises(HandshakeError) as info:
        client.receive(reply)
    assert info.value.fatal
    assert info.value.reason.startswith("server rejected connection: authentication failed")
    assert "PALATINE_CLUSTER_TOKEN" in info.value.reason


def test_version_mismatch_text() -> None:
    server = ServerHandshake(TOKEN)
    auth = ClientHandshake(TOKEN).receive(server.hello())
    assert auth is not None
    reply = server.receive(Auth(7, auth.nonce, auth.mac))
    assert reply == Reject("protocol version mismatch: server 1, client 7")


def test_forged_auth_ok_fails_the_client() -> None:
    server, client = ServerHandshake(b"x" * 32), ClientHandshake(TOKEN)
    client.receive(server.hello())
    with pytest.raises(HandshakeError) as info:
        client.receive(AuthOk(b"\0" * 32))
    assert (
        info.value.reason
        == SERVER_AUTH_FAILED
        == ("server authentication failed (cluster token mismatch?)")
    )
    assert info.value.fatal


def test_replayed_auth_fails_on_a_new_nonce() -> None:
    first = ServerHandshake(TOKEN)
    auth = ClientHandshake(TOKEN).receive(first.hello())
    assert auth is not None
    assert isinstance(first.receive(auth), AuthOk)
    assert ServerHandshake(TOKEN).receive(auth) == Reject(AUTH_FAILED)


def test_server_refuses_anything_but_one_auth() -> None:
    server = ServerHandshake(TOKEN)
    assert isinstance(server.receive(Ack(0)), Reject)
    assert server.state == "failed"
    done = ServerHandshake(TOKEN)
    auth = ClientHandshake(TOKEN).receive(done.hello())
    assert auth is not None
    done.receive(auth)
    assert isinstance(done.receive(auth), Reject)


def test_client_protocol_confusion_is_not_fatal() -> None:
    with pytest.raises(HandshakeError) as info:
        ClientHandshake(TOKEN).receive(Ack(3))
    assert not info.value.fatal
    assert "unexpected Ack" in info.value.reason


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError):
        ServerHandshake(b"")
    with pytest.raises(ValueError):
        ClientHandshake(b"")


def test_frames_of_the_handshake_fit_the_preauth_limit() -> None:
    server, client = ServerHandshake(TOKEN), ClientHandshake(TOKEN)
    hello = encode_frame(server.hello())
    auth = client.receive(FrameParser().feed(hello)[0])
    assert auth is not None
    (got,) = FrameParser().feed(encode_frame(auth))
    assert isinstance(server.receive(got), AuthOk)


@settings(max_examples=200, deadline=None)
@given(version=st.integers(0, 3), nonce=st.binary(max_size=40), mac=st.binary(max_size=40))
def test_fuzz_random_auth_never_passes(version: int, nonce: bytes, mac: bytes) -> None:
    server = ServerHandshake(TOKEN)
    reply = server.receive(Auth(version, nonce, mac))
    assert isinstance(reply, Reject)
    assert not server.done


@settings(max_examples=100, deadline=None)
@given(mac=st.binary(min_size=0, max_size=40))
def test_fuzz_random_auth_ok_never_passes(mac: bytes) -> None:
    server, client = ServerHandshake(TOKEN), ClientHandshake(TOKEN)
    client.receive(server.hello())
    with pytest.raises(HandshakeError):
        client.receive(AuthOk(mac))
