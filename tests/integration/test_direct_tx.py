"""`DirectTx` over real unix sockets against a real `NetRx`: any thread writes, in order,
never blocking; what the peer never acknowledged comes back when the session ends."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from test_channel import Raw, server_handshake

from palatine import config
from palatine.channel import any_addr, serve
from palatine.channel.addr import ChannelAddr
from palatine.fastpath.blocking import LinkLost
from palatine.fastpath.direct_tx import DirectTx
from palatine.ids import ActorId
from palatine.wire.envelope import Envelope
from palatine.wire.frames import Init, encode_message

TOKEN = "direct-tx-test-token-0123456789abcdef"
SENDER = ActorId.parse("src[0].actor[0]")
DEST = ActorId.parse("dst[0].actor[0]").port(1025)
WAIT_S = 10.0

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _token(module_token: str) -> None:
    """Every test here runs with this module's cluster token."""


def mk(data: bytes, buffers: list[bytes] | None = None) -> Envelope:
    return Envelope(SENDER, DEST, 7, 1, data, buffers=buffers or [])


class Returns:
    def __init__(self) -> None:
        self.items: list[tuple[Envelope, str]] = []

    def __call__(self, env: Envelope, reason: str) -> None:
        self.items.append((env, reason))


async def wait_for(cond, timeout: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def open_pair(returns: Returns):  # type: ignore[no-untyped-def]
    addr, rx = await serve(any_addr("unix"))
    loop = asyncio.get_running_loop()
    tx = await asyncio.to_thread(DirectTx.open, addr, loop, returns)
    return addr, rx, tx


async def test_threads_sending_at_once_deliver_everything_once_in_each_threads_order() -> None:
    returns = Returns()
    _, rx, tx = await open_pair(returns)
    n_threads, per = 4, 2000

    def sender(t: int) -> None:
        for i in range(0, per, 4):  # a few messages per send, as a flush sends them
            tx.send([mk(b"%d:%d" % (t, j)) for j in range(i, i + 4)])

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    got: list[Envelope] = []
    async with asyncio.timeout(WAIT_S):
        while len(got) < n_threads * per:
            got.append(await rx.recv())
    for th in threads:
        th.join(WAIT_S)
    seen: dict[int, list[int]] = {t: [] for t in range(n_threads)}
    for env in got:
        t, i = env.data.split(b":")
        seen[int(t)].append(int(i))
    assert all(seen[t] == list(range(per)) for t in range(n_threads))
    assert returns.items == []
    await tx.aclose(1.0)
    await rx.stop()


async def test_a_message_larger_than_the_socket_takes_is_finished_by_the_loop_in_order() -> None:
    returns = Returns()
    _, rx, tx = await open_pair(returns)
    big = bytes(range(256)) * (more_than_the_socket_holds(tx) // 256)
    tx.send([mk(b"first", [big])])
    # The loop thread (this one) has not run: the rest of the frame waits in the backlog,
    # and the next send queues behind it instead of blocking or overtaking it.
    assert tx._backlog
    tx.send([mk(b"second")])
    async with asyncio.timeout(WAIT_S):
        first = await rx.recv()
        second = await rx.recv()
    assert first.data == b"first" and bytes(first.buffers[0]) == big
    assert second.data == b"second"
    await wait_for(lambda: not tx._backlog)
    assert returns.items == []
    await tx.aclose(1.0)
    await rx.stop()


async def test_a_message_over_the_frame_limit_comes_back_and_the_session_goes_on() -> None:
    limit = 1 << 20
    returns = Returns()
    with config.override(max_frame_bytes=limit):
        _, rx, tx = await open_pair(returns)
    over = mk(b"x" * limit)
    size = encode_message(0, False, over)[2]
    tx.send([mk(b"before"), over, mk(b"after")])
    async with asyncio.timeout(WAIT_S):
        got = [await rx.recv(), await rx.recv()]
    assert [e.data for e in got] == [b"before", b"after"]
    await wait_for(lambda: len(returns.items) == 1)
    env, reason = returns.items[0]
    assert env is over
    assert reason == f"broken link: message of {size} bytes exceeds max frame size {limit}"
    assert tx.closed is None
    await tx.aclose(1.0)
    await rx.stop()


async def test_when_the_peer_ends_what_it_did_not_acknowledge_comes_back() -> None:
    returns = Returns()
    _, rx, tx = await open_pair(returns)
    sent = [mk(b"%d" % i) for i in range(3)]
    tx.send(sent)
    async with asyncio.timeout(WAIT_S):
        for _ in sent:
            await rx.recv()
    await rx.stop()  # acks are lazy: at most a final one went out before the close
    await wait_for(lambda: tx.closed is not None)
    assert "closed by the peer" in tx.closed
    back = [e for e, _ in returns.items]
    assert all(e in sent for e in back)
    assert all(r.startswith("broken link: ") for _, r in returns.items)
    late = mk(b"late")
    tx.send([late])  # after the end: straight back, nothing blocks
    await wait_for(lambda: any(e is late for e, _ in returns.items))


async def test_the_connection_gets_the_large_unix_send_buffer(unix_send_buffer: int) -> None:
    _, rx, tx = await open_pair(Returns())
    assert tx._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == unix_send_buffer
    await tx.aclose(WAIT_S)
    await rx.stop()


async def test_close_writes_out_the_backlog_first() -> None:
    returns = Returns()
    _, rx, tx = await open_pair(returns)
    big = b"\x07" * more_than_the_socket_holds(tx)
    tx.send([mk(b"big", [big]), mk(b"tail")])
    assert tx._backlog
    closing = asyncio.ensure_future(tx.aclose(WAIT_S))
    async with asyncio.timeout(WAIT_S):
        first = await rx.recv()
        second = await rx.recv()
    await closing
    assert bytes(first.buffers[0]) == big and second.data == b"tail"
    assert tx.closed == "closed" and returns.items == []
    await rx.stop()


async def test_only_unix_addresses_are_opened() -> None:
    addr, rx = await serve(any_addr("tcp"))
    loop = asyncio.get_running_loop()
    with pytest.raises(LinkLost, match="unix address"):
        await asyncio.to_thread(DirectTx.open, addr, loop, Returns())
    await rx.stop()


async def test_an_empty_buffer_queued_behind_a_backlog_does_not_keep_the_loop_writing() -> None:
    returns = Returns()
    _, rx, tx = await open_pair(returns)
    tx.send([mk(b"big", [b"\x01" * more_than_the_socket_holds(tx)])])
    assert tx._backlog
    tx.send([mk(b"empty-last", [b"ab", b""])])  # a pickle of an empty array ends so
    async with asyncio.timeout(WAIT_S):
        await rx.recv()
        last = await rx.recv()
    assert [bytes(b) for b in last.buffers] == [b"ab", b""]
    await wait_for(lambda: not tx._writing)
    t0 = time.monotonic()
    await tx.aclose(5.0)  # nothing left to write: no wait for a backlog that never empties
    assert time.monotonic() - t0 < 2.0
    await rx.stop()


def more_than_the_socket_holds(tx: DirectTx) -> int:
    """Bytes that cannot all fit in the connection's send buffer (then a backlog waits)."""
    return 2 * tx._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + (1 << 20)


class SilentPeer:
    """A unix server that opens the session, then never reads or acks again, and a
    `DirectTx` to it."""

    def __init__(self) -> None:
        self.conns: list[Raw] = []
        self.server: asyncio.AbstractServer | None = None

    async def open(self, path: str, returns: Returns) -> DirectTx:
        opened = asyncio.Event()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            raw = Raw(r, w)
            self.conns.append(raw)
            await server_handshake(raw, TOKEN)
            assert isinstance(await raw.frame(), Init)
            opened.set()

        self.server = await asyncio.start_unix_server(handle, path)
        loop = asyncio.get_running_loop()
        tx = await asyncio.to_thread(
            DirectTx.open, ChannelAddr.parse(f"unix:{path}"), loop, returns
        )
        async with asyncio.timeout(WAIT_S):
            await opened.wait()
        return tx

    def close(self) -> None:
        for raw in self.conns:
            raw.writer.close()
        assert self.server is not None
        self.server.close()


async def test_a_peer_that_stops_reading_ends_the_session_after_the_delivery_timeout(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    peer, returns = SilentPeer(), Returns()
    with config.override(message_delivery_timeout_s=0.3):
        tx = await peer.open(str(tmp_path / "s"), returns)
    sent = mk(b"never acked")
    t0 = time.monotonic()
    tx.send([sent])
    await wait_for(lambda: tx.closed is not None)
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert tx.closed == "delivery timeout: no ack within 0.3 s"
    assert returns.items == [(sent, "broken link: delivery timeout: no ack within 0.3 s")]
    peer.close()


async def test_a_message_with_buffers_is_acked_at_once_so_its_memory_is_let_go() -> None:
    returns = Returns()
    with config.override(message_ack_interval_s=30.0, message_ack_every_n=100000):
        _, rx, tx = await open_pair(returns)
        tx.send([mk(b"plain")])
        async with asyncio.timeout(WAIT_S):
            await rx.recv()
        await asyncio.sleep(0.05)
        assert len(tx._unacked) == 1  # acks are lazy: a plain message waits for one
        tx.send([mk(b"with buffers", [b"\x05" * 4096])])
        async with asyncio.timeout(WAIT_S):
            await rx.recv()
        await wait_for(lambda: not tx._unacked, timeout=5.0)  # long before 30 s
    await tx.aclose(1.0)
    await rx.stop()


async def test_close_returns_what_a_peer_that_never_finishes_reading_did_not_confirm(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    peer, returns = SilentPeer(), Returns()
    tx = await peer.open(str(tmp_path / "s"), returns)
    sent = mk(b"unconfirmed")
    tx.send([sent])
    t0 = time.monotonic()
    with pytest.raises(LinkLost, match="1 messages unconfirmed: the peer did not finish reading"):
        await tx.aclose(0.3)
    assert time.monotonic() - t0 < 2.0
    assert tx.closed == "closed"
    assert [e for e, _ in returns.items] == [sent]
    assert returns.items[0][1].startswith("broken link: closed before the peer confirmed delivery")
    peer.close()
