"""Channels end to end over real sockets.

Raw clients and fake servers speak the wire protocol by hand (through the sans-IO
`palatine.wire` halves) to reach states a well-behaved peer never produces. Every wait
is bounded. Run this file directly (``python tests/integration/test_channel.py``) for a
two-process throughput report.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import stat
import struct
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from palatine import config
from palatine.channel import any_addr, dial, parse, serve
from palatine.channel import token as token_mod
from palatine.channel.addr import ChannelAddr
from palatine.channel.base import Rx
from palatine.channel.net import dial_net
from palatine.channel.net.rx import NetRx
from palatine.channel.net.tx import NetTx
from palatine.errors import AddrParseError, ChannelClosed, ConfigError, SendError
from palatine.ids import ActorId, PortId, ProcId
from palatine.testing.proxy import LossyProxy
from palatine.wire.envelope import Envelope
from palatine.wire.frames import (
    Ack,
    Auth,
    AuthOk,
    Frame,
    FrameParser,
    Init,
    Message,
    Reject,
    encode_frame,
    encode_message,
    join_message,
)
from palatine.wire.handshake import ClientHandshake, ServerHandshake

TOKEN = "channel-test-token-0123456789abcdef"
SENDER = ActorId.parse("src[0].actor[0]")
DEST = ActorId.parse("dst[0].actor[0]").port(1025)
WAIT_S = 10.0

NET = ["tcp", "unix"]


@pytest.fixture(autouse=True)
def _token(module_token: str) -> None:
    """Every test here runs with this module's cluster token."""


def mk(i: int, *, buffers: list[Any] | None = None, data: bytes | None = None) -> Envelope:
    return Envelope(
        SENDER, DEST, 7, 1, data if data is not None else b"%d" % i, buffers=buffers or []
    )


def seqs(envs: list[Envelope]) -> list[int]:
    return [int(e.data) for e in envs]


async def recv_n(rx: Rx, n: int, timeout: float = WAIT_S) -> list[Envelope]:
    out = []
    async with asyncio.timeout(timeout):
        for _ in range(n):
            out.append(await rx.recv())
    return out


async def wait_for(cond: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Poll a condition every few ms until it holds (bounded)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


class Returns:
    """An ``on_return`` callback that records what came back."""

    def __init__(self) -> None:
        self.items: list[tuple[Envelope, str]] = []

    def __call__(self, env: Envelope, reason: str) -> None:
        self.items.append((env, reason))

    async def wait(self, n: int, timeout: float = WAIT_S) -> list[tuple[Envelope, str]]:
        await wait_for(lambda: len(self.items) >= n, timeout)
        return self.items


async def net_rx(transport: str) -> tuple[ChannelAddr, Rx]:
    return await serve(any_addr(transport))


# -- raw peers -------------------------------------------------------------------------


class Raw:
    """A hand-driven connection speaking frames (either role)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.parser = FrameParser(limit=1 << 30)
        self.pending: list[Frame] = []

    @classmethod
    async def open(cls, addr: ChannelAddr) -> Raw:
        if addr.transport == "unix":
            sockaddr = addr.sockaddr()
            assert isinstance(sockaddr, str)
            r, w = await asyncio.open_unix_connection(sockaddr)
        elif addr.transport == "tls":  # (with the PALATINE_TLS_* files of the environment)
            from palatine.channel.tls import client_context

            r, w = await asyncio.open_connection(
                addr.host, addr.port, ssl=client_context(), server_hostname=addr.host
            )
        else:
            r, w = await asyncio.open_connection(addr.host, addr.port)
        return cls(r, w)

    @classmethod
    async def client(
        cls, addr: ChannelAddr, session_id: int = 42, next_seq: int = 0, lane: ActorId | None = None
    ) -> Raw:
        """Connect, authenticate and send ``Init`` (opening a lane for ``lane``)."""
        raw = await cls.open(addr)
        hs = ClientHandshake(TOKEN.encode())
        auth = hs.receive(await raw.frame())
        assert auth is not None
        raw.send(auth)
        assert hs.receive(await raw.frame()) is None and hs.done
        if session_id is not None:
            raw.send(Init(session_id, next_seq, lane))
        return raw

    def send(self, frame: Frame) -> None:
        self.writer.write(encode_frame(frame))

    def send_msg(self, seq: int, env: Envelope, ack_now: bool = False) -> None:
        head, bufs, _ = encode_message(seq, ack_now, env)
        self.writer.write(join_message(head, bufs))

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def frame(self, timeout: float = WAIT_S) -> Frame:
        got = await self.frame_or_eof(timeout)
        assert got is not None, "connection closed"
        return got

    async def frame_or_eof(self, timeout: float = WAIT_S) -> Frame | None:
        async with asyncio.timeout(timeout):
            while not self.pending:
                data = await self.reader.read(65536)
                if not data:
                    return None
                self.pending += self.parser.feed(data)
        return self.pending.pop(0)

    async def until_eof(self, timeout: float = WAIT_S) -> list[Frame]:
        frames = []
        while (f := await self.frame_or_eof(timeout)) is not None:
            frames.append(f)
        return frames

    def close(self) -> None:
        self.writer.close()


class FakeServer:
    """A receiver under the test's control: runs ``on_conn(raw, handshake)`` per accept."""

    def __init__(self, on_conn: Callable[[Raw], Awaitable[None]]) -> None:
        self.on_conn = on_conn
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.addr: ChannelAddr | None = None

    async def __aenter__(self) -> ChannelAddr:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self.tasks.add(task)
            raw = Raw(r, w)
            try:
                await self.on_conn(raw)
            except (ConnectionError, TimeoutError, AssertionError):
                pass
            finally:
                w.close()
                self.tasks.discard(task)

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.addr = ChannelAddr.tcp("127.0.0.1", port)
        return self.addr

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=2.0)


async def server_handshake(raw: Raw, token: str = TOKEN) -> None:
    hs = ServerHandshake(token.encode())
    raw.send(hs.hello())
    reply = hs.receive(await raw.frame())
    raw.send(reply)
    assert hs.done


# -- many dials, many messages ------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "unix", "local"])
async def test_hundred_dials_each_deliver(transport: str) -> None:
    addr, rx = await serve(any_addr(transport))
    txs = [dial(addr) for _ in range(100)]
    for i, tx in enumerate(txs):
        tx.post(mk(i))
    got = await recv_n(rx, 100)
    assert sorted(seqs(got)) == list(range(100))
    await asyncio.gather(*(tx.close() for tx in txs))
    await rx.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", NET)
async def test_ten_thousand_in_order_exactly_once(transport: str) -> None:
    addr, rx = await net_rx(transport)
    tx = dial(addr)
    returns = Returns()
    for i in range(10_000):
        tx.post(mk(i), returns)
    got = await recv_n(rx, 10_000)
    assert seqs(got) == list(range(10_000))
    assert await tx.close() == []
    assert not returns.items
    await rx.stop()
    with pytest.raises(ChannelClosed):
        await rx.recv()


# -- dial before serve ----------------------------------------------------------------


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", NET)
async def test_dial_and_post_before_the_server_exists(transport: str) -> None:
    if transport == "tcp":
        addr = ChannelAddr.tcp("127.0.0.1", free_tcp_port())
    else:
        addr = any_addr("unix")
    tx = dial(addr)
    tx.post(mk(0))
    await asyncio.sleep(1.0)  # the scenario: the server appears 1 s later
    bound, rx = await serve(addr)
    assert bound == addr
    for i in range(1, 200):
        tx.post(mk(i))
    got = await recv_n(rx, 200)
    assert seqs(got) == list(range(200))
    await tx.close()
    with pytest.raises(TimeoutError):
        await recv_n(rx, 1, timeout=0.2)  # nothing arrived twice
    await rx.stop()


# -- a lossy link -------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_lossy_proxy_delivers_exactly_once_in_order() -> None:
    with config.override(reconnect_backoff_initial_s=0.005, reconnect_backoff_max_s=0.05):
        addr, rx = await serve(ChannelAddr.tcp("127.0.0.1", 0))
        assert isinstance(rx, NetRx)
        proxy = LossyProxy(addr, seed=19)
        paddr = await proxy.start()
        tx = dial(paddr)
        assert isinstance(tx, NetTx)
        session = tx.session_id
        returns = Returns()
        n = 10_001
        got: list[Envelope] = []
        for i in range(n):
            tx.post(mk(i), returns)
            if i % 100 == 99:
                await asyncio.sleep(0)  # a producer that yields now and then
        got = await recv_n(rx, n, timeout=45)
        assert seqs(got) == list(range(n))
        assert tx.session_id == session and rx.session_count == 1
        assert proxy.cuts >= 10 and tx.connects >= 10
        assert not returns.items
        await tx.close(flush_timeout_s=5)
        await proxy.stop()
        with pytest.raises(TimeoutError):
            await recv_n(rx, 1, timeout=0.2)
        await rx.stop()


# -- raw clients ---------------------------------------------------


@pytest.mark.timeout(30)
async def test_resent_seqs_are_delivered_once_and_acks_never_decrease() -> None:
    addr, rx = await net_rx("tcp")
    acks: list[int] = []
    a = await Raw.client(addr, session_id=77)
    acks.append((await a.frame()).seq)  # the Init ack: -1, nothing yet
    for seq in range(4):
        a.send_msg(seq, mk(seq), ack_now=True)
    while acks[-1] < 3:
        acks.append((await a.frame()).seq)
    b = await Raw.client(addr, session_id=77, next_seq=2)  # takes the session over
    assert await a.until_eof() == []  # the older connection is closed
    acks.append((await b.frame()).seq)
    for seq in (2, 3, 4):
        b.send_msg(seq, mk(seq), ack_now=True)
    while acks[-1] < 4:
        acks.append((await b.frame()).seq)
    got = await recv_n(rx, 5)
    assert seqs(got) == [0, 1, 2, 3, 4]
    assert acks == sorted(acks) and acks[0] == -1 and acks[-1] == 4
    with pytest.raises(TimeoutError):
        await recv_n(rx, 1, timeout=0.2)
    b.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_ack_every_message_when_n_is_one() -> None:
    with config.override(message_ack_every_n=1):
        addr, rx = await net_rx("unix")
    raw = await Raw.client(addr)
    assert await raw.frame() == Ack(-1)
    for i in range(20):
        raw.send_msg(i, mk(i))
        assert await raw.frame() == Ack(i)
    raw.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_sparse_acks_still_deliver_twenty_thousand_in_order() -> None:
    with config.override(message_ack_every_n=1000, message_ack_interval_s=0.5):
        addr, rx = await net_rx("unix")
        tx = dial(addr)
    for i in range(20_001):
        tx.post(mk(i))
    got = await recv_n(rx, 20_001)
    assert seqs(got) == list(range(20_001))
    assert isinstance(tx, NetTx)
    await wait_for(lambda: tx.pending == 0, timeout=2.0)  # the interval ack came
    await tx.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_sequence_gap_is_rejected_and_others_keep_going() -> None:
    addr, rx = await net_rx("tcp")
    other = dial(addr)
    raw = await Raw.client(addr)
    for seq in (0, 1, 3):
        raw.send_msg(seq, mk(seq))
    frames = await raw.until_eof()
    assert Reject("sequence gap: expected 2, got 3") in frames
    assert seqs(await recv_n(rx, 2)) == [0, 1]
    other.post(mk(100))
    assert seqs(await recv_n(rx, 1)) == [100]
    await other.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_message_before_init_and_second_init_are_rejected() -> None:
    addr, rx = await net_rx("tcp")
    raw = await Raw.client(addr, session_id=None)  # type: ignore[arg-type]
    raw.send_msg(0, mk(0))
    assert Reject("Message before Init") in await raw.until_eof()
    raw = await Raw.client(addr, session_id=5)
    assert await raw.frame() == Ack(-1)
    raw.send(Init(5, 0))
    frames = await raw.until_eof()
    assert next(f for f in frames if isinstance(f, Reject)).reason.startswith("unexpected Init")
    await rx.stop()


@pytest.mark.timeout(30)
async def test_unknown_session_starts_at_next_seq() -> None:
    addr, rx = await net_rx("unix")
    raw = await Raw.client(addr, session_id=2**64 - 1, next_seq=5)
    assert await raw.frame() == Ack(4)
    raw.send_msg(5, mk(5), ack_now=True)
    assert await raw.frame() == Ack(5)
    assert seqs(await recv_n(rx, 1)) == [5]
    raw.close()
    await rx.stop()


# -- delivery timeout and send() --------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", NET)
async def test_never_listening_returns_all_oldest_first(transport: str) -> None:
    addr = ChannelAddr.tcp("127.0.0.1", free_tcp_port()) if transport == "tcp" else any_addr("unix")
    with config.override(message_delivery_timeout_s=1.0):
        tx = dial(addr)
    returns = Returns()
    closed: list[str] = []
    tx.on_closed(closed.append)
    start = time.monotonic()
    for i in range(50):
        tx.post(mk(i), returns)
    items = await returns.wait(50, timeout=5.0)
    assert time.monotonic() - start < 3.0
    assert [int(e.data) for e, _ in items] == list(range(50))
    reason = items[0][1]
    assert reason.startswith("delivery timeout: not delivered within 1 s of posting (link broken: ")
    assert all(r == reason for _, r in items)
    assert tx.status.closed and tx.status.reason == reason and closed == [reason]
    with pytest.raises(ChannelClosed) as info:
        tx.post(mk(99))
    assert info.value.envelope.data == b"99"


@pytest.mark.timeout(30)
async def test_peer_that_never_acks_returns_with_link_connected() -> None:
    async def silent(raw: Raw) -> None:
        await server_handshake(raw)
        while await raw.frame_or_eof(timeout=30) is not None:
            pass

    async with FakeServer(silent) as addr:
        with config.override(message_delivery_timeout_s=0.5):
            tx = dial(addr)
        returns = Returns()
        for i in range(3):
            tx.post(mk(i), returns)
        items = await returns.wait(3, timeout=3.0)
    assert [int(e.data) for e, _ in items] == [0, 1, 2]
    assert items[0][1] == (
        "delivery timeout: not acknowledged within 0.5 s of posting (link connected)"
    )


@pytest.mark.timeout(30)
async def test_send_completes_only_after_the_ack() -> None:
    got_message = asyncio.Event()
    release = asyncio.Event()

    async def acks_on_demand(raw: Raw) -> None:
        await server_handshake(raw)
        assert isinstance(await raw.frame(), Init)
        msg = await raw.frame()
        assert isinstance(msg, Message) and msg.ack_now
        got_message.set()
        await release.wait()
        raw.send(Ack(msg.seq))
        await raw.frame_or_eof(timeout=30)

    async with FakeServer(acks_on_demand) as addr:
        tx = dial(addr)
        sending = asyncio.ensure_future(tx.send(mk(0)))
        async with asyncio.timeout(WAIT_S):
            await got_message.wait()
        await asyncio.sleep(0.05)
        assert not sending.done()
        release.set()
        async with asyncio.timeout(WAIT_S):
            await sending
        await tx.close()


@pytest.mark.timeout(30)
async def test_send_to_a_gone_receiver_raises_send_error() -> None:
    with config.override(message_delivery_timeout_s=0.5):
        addr, rx = await net_rx("tcp")
        tx = dial(addr)
    await tx.send(mk(0))
    await rx.stop()
    env = mk(1)
    with pytest.raises(SendError) as info:
        async with asyncio.timeout(3.0):
            await tx.send(env)
    assert info.value.envelope is env
    assert info.value.reason.startswith("delivery timeout")


# -- frame size limits ----------------------------------------------------------


@pytest.mark.timeout(30)
async def test_oversize_returned_at_post_and_the_tx_stays_open() -> None:
    limit = 1 << 20
    with config.override(max_frame_bytes=limit):
        addr, rx = await net_rx("unix")
        tx = dial(addr)
    returns = Returns()
    probe = mk(0, data=b"x" * (limit - 1000))
    size = encode_message(0, False, probe)[2]
    exact = mk(0, data=b"x" * (limit - 1000 + (limit - size)))
    assert encode_message(0, False, exact)[2] == limit
    over = mk(0, data=b"x" * (len(exact.data) + 1))
    tx.post(over, returns)
    items = await returns.wait(1, timeout=5.0)
    assert items[0][0] is over
    assert items[0][1] == f"message of {limit + 1} bytes exceeds max frame size {limit}"
    tx.post(exact, returns)  # just under (here: exactly at) the limit, framing included
    tx.post(mk(1), returns)
    got = await recv_n(rx, 2)
    assert len(got[0].data) == len(exact.data) and got[1].data == b"1"
    assert not tx.status.closed and len(returns.items) == 1
    big_buffer = mk(2, buffers=[bytes(limit)])
    tx.post(big_buffer, returns)
    await returns.wait(2, timeout=5.0)
    assert "exceeds max frame size" in returns.items[1][1]
    await tx.close()
    await rx.stop()


# -- bad peers ------------------------------------------------------


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "palatine.channel.net.sockets"
    ]


@pytest.mark.timeout(30)
async def test_garbage_after_handshake_closes_only_that_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    addr, rx = await net_rx("tcp")
    good = dial(addr)
    good.post(mk(0))
    assert seqs(await recv_n(rx, 1)) == [0]
    raw = await Raw.client(addr)
    port = raw.writer.get_extra_info("sockname")[1]
    raw.write(struct.pack(">Q", 12) + b"\xff" * 12)
    frames = await raw.until_eof()
    assert any(isinstance(f, Reject) for f in frames)
    good.post(mk(1))
    assert seqs(await recv_n(rx, 1)) == [1]
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and f"127.0.0.1:{port}" in msgs[0]
    await good.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_huge_length_prefix_closes_without_allocating() -> None:
    addr, rx = await net_rx("tcp")
    good = dial(addr)
    raw = await Raw.client(addr)
    assert await raw.frame() == Ack(-1)
    tracemalloc.start()
    try:
        raw.write(struct.pack(">Q", 2**62) + b"x" * 100)
        await raw.until_eof()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20
    good.post(mk(0))
    assert seqs(await recv_n(rx, 1)) == [0]
    await good.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_a_big_frame_that_stops_arriving_is_rejected_and_its_buffer_freed() -> None:
    # A session announces a 4 MiB frame, sends 1 KiB of it and stalls: after the delivery
    # timeout (its sender has given the message up by then) the connection is rejected
    # and the frame's buffer goes back to the pool; a frame that keeps coming is not cut.
    from palatine.wire.buffers import POOL

    with config.override(message_delivery_timeout_s=0.5):
        addr, rx = await net_rx("tcp")
    slow = await Raw.client(addr, session_id=43)
    assert await slow.frame() == Ack(-1)
    raw = await Raw.client(addr)
    assert await raw.frame() == Ack(-1)
    stalled, stalled_bufs, _ = encode_message(0, False, mk(0, buffers=[bytearray(4 << 20)]))
    raw.write(stalled + bytes(stalled_bufs[0][:1024]))  # its header, and 1 KiB of its buffer
    free_before = POOL.free_bytes
    start = time.monotonic()
    frames = await raw.until_eof(timeout=5.0)
    assert 0.4 <= time.monotonic() - start < 3.0
    assert frames == [Reject("a frame stopped arriving: no byte of it for 0.5 s")]
    assert POOL.free_bytes >= free_before + (4 << 20)  # returned, not held by the dead connection
    # A big message whose bytes keep coming, slower than the timeout in total, arrives.
    head, bufs, _size = encode_message(0, False, mk(0, buffers=[b"y" * (2 << 20)]))
    data = head + b"".join(bytes(b) for b in bufs)
    for i in range(0, len(data), len(data) // 8 + 1):
        slow.write(data[i : i + len(data) // 8 + 1])
        await asyncio.sleep(0.1)
    assert seqs(await recv_n(rx, 1)) == [0]
    await rx.stop()


@pytest.mark.timeout(30)
async def test_preauth_limit_and_auth_timeout() -> None:
    with config.override(auth_timeout_s=0.3):
        addr, rx = await net_rx("tcp")
    raw = await Raw.open(addr)
    assert (await raw.frame()).version == 1  # type: ignore[union-attr]
    raw.write(struct.pack(">Q", 64 * 1024 + 1) + b"\0" * 64)
    assert await raw.until_eof() == []
    silent = await Raw.open(addr)
    start = time.monotonic()
    await silent.frame()  # Hello
    assert await silent.until_eof(timeout=3.0) == []
    assert 0.25 <= time.monotonic() - start < 2.0
    # Authenticated but never opening a session (no Init): closed on the same clock.
    mute = await Raw.client(addr, session_id=None)  # type: ignore[arg-type]
    start = time.monotonic()
    assert await mute.until_eof(timeout=3.0) == []
    assert time.monotonic() - start < 2.0
    tx = dial(addr)
    await tx.send(mk(0))  # the listener still serves
    assert seqs(await recv_n(rx, 1)) == [0]
    await tx.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_wrong_token_returns_messages_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    addr, rx = await net_rx("tcp")
    returns = Returns()
    bad = [dial_net(addr, token=b"not-the-cluster-token-at-all") for _ in range(2)]
    for i, tx in enumerate(bad):
        tx.post(mk(i), returns)
    items = await returns.wait(2)
    for _, reason in items:
        assert reason.startswith("server rejected connection: authentication failed")
    assert all(tx.status.closed for tx in bad)
    good = dial(addr)
    await good.send(mk(5))
    assert seqs(await recv_n(rx, 1)) == [5]
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and "127.0.0.1" in msgs[0] and "authentication failed" in msgs[0]
    await good.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_forged_auth_ok_closes_the_client() -> None:
    async def forger(raw: Raw) -> None:
        hs = ServerHandshake(b"some-other-token-entirely-xxxxxx")
        raw.send(hs.hello())
        assert isinstance(await raw.frame(), Auth)
        raw.send(AuthOk(b"\x01" * 32))
        await raw.frame_or_eof(timeout=30)

    async with FakeServer(forger) as addr:
        tx = dial(addr)
        returns = Returns()
        tx.post(mk(0), returns)
        items = await returns.wait(1)
    reason = "server authentication failed (cluster token mismatch?)"
    assert items[0][1] == reason and tx.status.reason == reason


# -- local transport ----------------------------------------------------------------


async def test_local_after_stop_post_and_dial_raise() -> None:
    addr, rx = await serve(parse("local:0"))
    tx = dial(addr)
    closed: list[str] = []
    tx.on_closed(closed.append)
    await tx.send(mk(0))
    assert seqs(await recv_n(rx, 1)) == [0]
    await rx.stop()
    env = mk(1)
    with pytest.raises(ChannelClosed) as info:
        tx.post(env)
    assert info.value.envelope is env
    assert tx.status.closed and closed
    with pytest.raises(ChannelClosed):
        dial(addr)


async def test_local_ports_count_up_and_are_never_reused() -> None:
    a, rx_a = await serve(parse("local:0"))
    b, rx_b = await serve(parse("local:0"))
    assert b.port == a.port + 1
    await rx_a.stop()
    c, rx_c = await serve(parse("local:0"))
    assert c.port == b.port + 1
    with pytest.raises(AddrParseError, match="invalid local addr: serve local:0 to get a port"):
        await serve(parse("local:5"))
    with pytest.raises(ChannelClosed):
        dial(parse("local:999999"))
    await rx_b.stop()
    await rx_c.stop()


async def test_local_handler_sees_objects_in_order_without_recursion() -> None:
    addr, rx = await serve(parse("local:0"))
    seen: list[Envelope] = []
    tx = dial(addr)
    tx.post(mk(0))  # queued before the handler exists
    rx.set_handler(seen.append)
    envs = [mk(i) for i in range(1, 5)]
    for e in envs:
        tx.post(e)
    assert seen == []  # dispatch happens on the loop, never inside post
    await wait_for(lambda: len(seen) == 5)
    assert seqs(seen) == [0, 1, 2, 3, 4] and seen[1] is envs[0]
    await rx.stop()


# -- TLS ----------------------------------------------------------------------------


async def serve_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ChannelAddr, Rx]:
    """A test PKI; a tls Rx served with the server's certificate; then this process's
    environment set to the client's. Returns (pki, addr, rx)."""
    pytest.importorskip("cryptography")
    from palatine.testing.certs import make_test_pki, tls_env

    pki = make_test_pki(tmp_path / "pki")
    for key, value in tls_env(pki, "server").items():
        monkeypatch.setenv(key, value)
    addr, rx = await serve(parse("tls:127.0.0.1:0"))
    assert addr.transport == "tls"
    for key, value in tls_env(pki, "client").items():
        monkeypatch.setenv(key, value)
    return pki, addr, rx


@pytest.mark.timeout(60)
async def test_tls_mutual_auth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from palatine.testing.certs import tls_env

    pki, addr, rx = await serve_tls(tmp_path, monkeypatch)
    tx = dial(addr)
    await tx.send(mk(0))
    assert seqs(await recv_n(rx, 1)) == [0]
    await tx.close()

    # A client that presents no certificate is refused; its messages come back at once,
    # saying why (not after the delivery timeout).
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.load_verify_locations(cafile=str(pki.ca))
    with config.override(message_delivery_timeout_s=1.0):
        anon = dial_net(addr, ssl_context=no_cert)
    returns = Returns()
    anon.post(mk(1), returns)
    items = await returns.wait(1, timeout=5.0)
    assert items[0][1].startswith(
        "tls: the peer closed 3 connections in a row during the TLS handshake"
    )
    with pytest.raises(TimeoutError):
        await recv_n(rx, 1, timeout=0.2)
    msgs = warnings_of(caplog)  # several attempts, one WARNING naming the peer
    assert len(msgs) == 1 and "127.0.0.1:" in msgs[0] and "TLS handshake failed" in msgs[0]

    # A client whose certificate another CA signed is refused the same way.
    for key, value in tls_env(pki, "other_client").items():
        monkeypatch.setenv(key, value)
    with config.override(message_delivery_timeout_s=0.5):
        other = dial(addr)
    other.post(mk(2), returns)
    await returns.wait(2, timeout=5.0)
    await rx.stop()

    for var in ("PALATINE_TLS_CERT", "PALATINE_TLS_KEY", "PALATINE_TLS_CA"):
        monkeypatch.delenv(var)
    with pytest.raises(ConfigError, match="tls transport requires PALATINE_TLS_CERT"):
        dial(addr)


@pytest.mark.timeout(60)
async def test_tls_hands_a_big_message_to_the_transport_a_slice_at_a_time_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pki, addr, rx = await serve_tls(tmp_path, monkeypatch)
    tx = dial(addr)
    assert isinstance(tx, NetTx)
    await tx.send(mk(0))  # connected
    payload = os.urandom(1 << 20) * 32  # 32 MiB
    tx.post(mk(1, buffers=[payload]))
    tx.post(mk(2))
    tx.post(mk(3, buffers=[b"z" * 1000]))
    await asyncio.sleep(0)  # the flush: the big one starts out
    conn = tx._conn
    assert conn is not None and conn.writer is not None
    # Only a slice or so went to the transport; the rest waits for it to ask for more,
    # and the two small messages wait behind it.
    assert conn.writer.busy
    got = await recv_n(rx, 4)
    assert seqs(got) == [0, 1, 2, 3]
    assert bytes(got[1].buffers[0]) == payload
    assert bytes(got[3].buffers[0]) == b"z" * 1000
    assert not conn.writer.busy
    await tx.close()

    # The same on the serving side: a lane's big reply, between two small ones.
    seen: list[Envelope] = []
    rx.set_handler(seen.append)
    lane = ActorId.parse("src[0].lane[4]")
    raw = await Raw.client(addr, session_id=79, lane=lane)
    assert await raw.frame() == Ack(-1)
    raw.send_msg(0, mk(0), ack_now=True)
    await wait_for(lambda: len(seen) == 1)
    assert await raw.frame() == Ack(0)  # (so that no ack comes between the replies)
    assert isinstance(rx, NetRx)
    back = rx.lanes[lane]
    sender = ActorId.parse("dst[0].actor[0]")
    for i, buffers in enumerate(([], [payload], [])):
        reply = Envelope(sender, PortId(lane, i), 7, 1, b"%d" % i, buffers=buffers)
        assert back.send_back(reply) is None
    assert back._writer is not None and back._writer.busy
    replies = [await raw.frame() for _ in range(3)]
    assert [r.envelope.data for r in replies if isinstance(r, Message)] == [b"0", b"1", b"2"]
    assert isinstance(replies[1], Message) and bytes(replies[1].envelope.buffers[0]) == payload
    raw.close()
    await rx.stop()


# -- token configuration -------------------------------------------------------------


async def test_token_file_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PALATINE_CLUSTER_TOKEN")
    loose = tmp_path / "loose-token"
    loose.write_text("a" * 40)
    loose.chmod(0o644)
    monkeypatch.setenv("PALATINE_CLUSTER_TOKEN_FILE", str(loose))
    token_mod.reset_token_cache()
    with pytest.raises(ConfigError, match="0644"):
        await serve(ChannelAddr.tcp("127.0.0.1", 0))
    monkeypatch.delenv("PALATINE_CLUSTER_TOKEN_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    token_mod.reset_token_cache()
    addr, rx = await serve(any_addr("unix"))
    created = tmp_path / "config" / "palatine" / "cluster-token"
    assert stat.S_IMODE(created.stat().st_mode) == 0o600
    tx = dial(addr)
    await tx.send(mk(0))
    await tx.close()
    await rx.stop()


# -- resume after reconnect ---------------------------------------------------------


@pytest.mark.timeout(30)
async def test_reconnect_resends_only_unacked_and_acks_prune_the_outbox() -> None:
    inits: list[Init] = []
    received: list[list[int]] = []

    async def server(raw: Raw) -> None:
        await server_handshake(raw)
        init = await raw.frame()
        assert isinstance(init, Init)
        inits.append(init)
        if len(inits) == 2:
            raw.send(Ack(4))  # what a real receiver answers to Init: all it has
        seen: list[int] = []
        received.append(seen)
        while (f := await raw.frame_or_eof(timeout=30)) is not None:
            assert isinstance(f, Message)
            seen.append(f.seq)
            if len(inits) == 1 and f.seq == 4:
                raw.send(Ack(4))
            if len(inits) == 1 and f.seq == 5:
                await asyncio.sleep(0.05)  # let the ack land, then "lose" the link
                return
            if len(inits) == 2 and f.seq == 5:
                raw.send(Ack(5))

    async with FakeServer(server) as addr:
        with config.override(reconnect_backoff_initial_s=0.01):
            tx = dial(addr)
        assert isinstance(tx, NetTx)
        for i in range(6):
            tx.post(mk(i))
        await wait_for(lambda: tx.pending == 0)
        assert received[0] == [0, 1, 2, 3, 4, 5]
        assert received[1] == [5]
        assert [i.session_id for i in inits] == [tx.session_id] * 2
        assert inits[1].next_seq == 5
        await tx.close()


@pytest.mark.timeout(30)
async def test_ack_covering_the_outbox_removes_without_sending() -> None:
    received: list[list[int]] = []

    async def server(raw: Raw) -> None:
        if received:
            # Second connection: prove everything arrived before the client resends.
            hs = ServerHandshake(TOKEN.encode())
            raw.send(hs.hello())
            reply = hs.receive(await raw.frame())
            raw.write(encode_frame(reply) + encode_frame(Ack(2)))
        else:
            await server_handshake(raw)
        seen: list[int] = []
        received.append(seen)
        while (f := await raw.frame_or_eof(timeout=30)) is not None:
            if isinstance(f, Message):
                seen.append(f.seq)
                if len(received) == 1 and f.seq == 2:
                    return  # drop the link without acking anything
                if len(received) == 2:
                    raw.send(Ack(f.seq))

    async with FakeServer(server) as addr:
        with config.override(reconnect_backoff_initial_s=0.01):
            tx = dial(addr)
        assert isinstance(tx, NetTx)
        for i in range(3):
            tx.post(mk(i))
        await wait_for(lambda: len(received) == 2 and tx.pending == 0)
        tx.post(mk(3))
        await wait_for(lambda: tx.pending == 0)
        assert received == [[0, 1, 2], [3]]
        await tx.close()


# -- final ack, EOF inside a frame, zero-length buffers ---------------------------


@pytest.mark.timeout(30)
async def test_stop_flushes_a_final_ack() -> None:
    with config.override(message_ack_every_n=10_000, message_ack_interval_s=30.0):
        addr, rx = await net_rx("unix")
        tx = dial(addr)
    returns = Returns()
    for i in range(10):
        tx.post(mk(i), returns)
    await recv_n(rx, 10)
    assert isinstance(tx, NetTx) and tx.pending == 10
    await rx.stop()
    await wait_for(lambda: tx.pending == 0, timeout=2.0)
    assert await tx.close() == [] and not returns.items


@pytest.mark.timeout(30)
async def test_eof_inside_a_frame_is_a_connection_error() -> None:
    addr, rx = await net_rx("tcp")
    raw = await Raw.client(addr, session_id=9)
    assert await raw.frame() == Ack(-1)
    frame = join_message(*encode_message(0, False, mk(0))[:2])
    raw.write(frame[: len(frame) // 2])
    await raw.writer.drain()
    raw.writer.write_eof()
    assert await raw.until_eof() == []
    # The sender reconnects and resends; the message arrives once.
    again = await Raw.client(addr, session_id=9)
    assert await again.frame() == Ack(-1)
    again.send_msg(0, mk(0), ack_now=True)
    assert await again.frame() == Ack(0)
    assert seqs(await recv_n(rx, 1)) == [0]
    again.close()
    await rx.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", NET)
async def test_buffers_round_trip_including_zero_length(transport: str) -> None:
    addr, rx = await net_rx(transport)
    tx = dial(addr)
    big = bytearray(os.urandom(3 * 2**20))
    bufs: list[Any] = [b"", memoryview(b"abc"), b"", big, b""]
    await tx.send(mk(0, buffers=bufs))
    (got,) = await recv_n(rx, 1)
    assert [bytes(b) for b in got.buffers] == [bytes(b) for b in bufs]
    await tx.close()
    await rx.stop()


async def _pickled_values_round_trip(transport: str) -> None:
    """Fetched values (pickle buffers out of band) through a real channel, twice."""
    import numpy as np

    from palatine.protocol.worker import FetchResult, Ok
    from palatine.tensor.worker.values import dumps_fetched, loads_value
    from palatine.wire.codec import decode_payload, encode_message_oob

    addr, rx = await net_rx(transport)
    tx = dial(addr)
    values = [np.arange(2**20, dtype=np.float64), np.full(3 * 2**20 + 7, 5, dtype=np.uint8)]
    tid = FetchResult.__palatine_type_id__
    got: list[Any] = []
    for seq, value in enumerate(values):
        data, buffers = encode_message_oob(FetchResult(seq=seq, value=Ok(dumps_fetched(value))))
        assert len(data) < 1024 and len(buffers) == 1
        sent = Envelope(SENDER, DEST, tid, 0, data)
        sent.buffers = buffers
        tx.post(sent)  # a plain post: buffers ask for an immediate ack themselves
        (env,) = await recv_n(rx, 1)
        assert len(env.buffers) == 1 and not memoryview(env.buffers[0]).readonly
        msg = decode_payload(env)
        got.append(loads_value(msg.value.value))
        # An immediate ack: the callers set message_ack_interval_s to 5 s.
        await wait_for(lambda: tx.pending == 0, timeout=3.0)
    for g, v in zip(got, values, strict=True):
        assert g.dtype == v.dtype and np.array_equal(g, v)
    got[0][:] = -1.0  # writable, and private to each message
    assert np.array_equal(got[1], values[1]) and got[0][0] == -1.0
    await tx.close()
    await rx.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", NET)
async def test_pickled_values_travel_out_of_band(transport: str) -> None:
    with config.override(message_ack_interval_s=5.0):
        await _pickled_values_round_trip(transport)


@pytest.mark.timeout(30)
def test_pickled_values_travel_out_of_band_on_the_asyncio_loop() -> None:
    """The same through asyncio's own loop (``event_loop = "asyncio"``)."""
    with config.override(message_ack_interval_s=5.0):
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_pickled_values_round_trip("unix"))
        finally:
            loop.close()


# -- receiver behaviour: peers lost, back-pressure, session GC, takeover ---------------


@pytest.mark.timeout(30)
async def test_peer_lost_reports_the_sender_procs_of_a_closed_connection() -> None:
    addr, rx = await net_rx("unix")
    seen: list[Envelope] = []
    lost: list[set[ProcId]] = []
    rx.set_handler(seen.append, lost.append)
    tx = dial(addr)
    other = ActorId.parse("src[1].actor[3]")
    tx.post(mk(0))
    tx.post(Envelope(other, DEST, 7, 1, b"1"))
    await tx.send(mk(2))
    assert seqs(seen) == [0, 1, 2]  # delivered synchronously, before the ack
    await tx.close()
    await wait_for(lambda: bool(lost))
    assert lost == [{SENDER.proc, other.proc}]
    await rx.stop()


@pytest.mark.timeout(30)
async def test_lane_carries_messages_back_and_is_forgotten_when_it_closes() -> None:
    addr, rx = await net_rx("unix")
    assert isinstance(rx, NetRx)
    seen: list[Envelope] = []
    lost: list[set[ProcId]] = []
    rx.set_handler(seen.append, lost.append)
    lane = ActorId.parse("src[0].lane[3]")
    raw = await Raw.client(addr, session_id=77, lane=lane)
    assert await raw.frame() == Ack(-1)
    raw.send_msg(0, mk(0))
    await wait_for(lambda: len(seen) == 1)
    conn = rx.lanes[lane]
    reply = Envelope(ActorId.parse("dst[0].actor[0]"), PortId(lane, 5), 7, 1, b"back")
    assert conn.send_back(reply) is None
    got = await raw.frame()
    assert isinstance(got, Message) and got.seq == 0
    assert got.envelope.dest == PortId(lane, 5) and got.envelope.data == b"back"
    big = Envelope(reply.sender, reply.dest, 7, 1, b"x" * 64)
    rx._max_frame = 64
    assert "exceeds max frame size 64" in (conn.send_back(big) or "")
    raw.close()
    await wait_for(lambda: lane not in rx.lanes)
    assert conn.send_back(reply) == "the lane's connection is closed"
    assert lost == []  # a lane's end says nothing about its sender proc
    await rx.stop()


@pytest.mark.timeout(30)
async def test_a_lane_must_name_a_lane_actor() -> None:
    addr, rx = await net_rx("unix")
    assert isinstance(rx, NetRx)
    raw = await Raw.client(addr, session_id=78, lane=ActorId.parse("src[0].system[0]"))
    frames = await raw.until_eof()
    assert any(
        isinstance(f, Reject) and "a lane's actor is named 'lane'" in f.reason for f in frames
    )
    assert rx.lanes == {}
    await rx.stop()


@pytest.mark.timeout(30)
async def test_full_inbound_queue_pauses_reading() -> None:
    with config.override(inbound_queue_frames=8):
        addr, rx = await net_rx("unix")
    assert isinstance(rx, NetRx)
    tx = dial(addr)
    for i in range(2000):
        tx.post(mk(i, data=b"%06d" % i + b"p" * 2000))
    await wait_for(lambda: bool(rx._paused))
    got = await recv_n(rx, 2000)
    assert [int(e.data[:6]) for e in got] == list(range(2000))
    assert not rx._paused
    await tx.close()
    await rx.stop()


@pytest.mark.timeout(30)
async def test_sessions_are_collected_after_twice_the_delivery_timeout() -> None:
    with config.override(message_delivery_timeout_s=0.2):
        addr, rx = await net_rx("tcp")
    assert isinstance(rx, NetRx)
    tx = dial(addr)
    await tx.send(mk(0))
    assert rx.session_count == 1
    await tx.close()
    start = time.monotonic()
    await wait_for(lambda: rx.session_count == 0, timeout=3.0)
    assert time.monotonic() - start >= 0.2
    await rx.stop()


@pytest.mark.timeout(30)
async def test_stopped_unix_rx_removes_its_socket_file() -> None:
    addr, rx = await net_rx("unix")
    assert addr.path is not None
    assert stat.S_IMODE(os.stat(addr.path).st_mode) == 0o600
    await rx.stop()
    assert not os.path.exists(addr.path)  # noqa: ASYNC240 - one stat in a test


async def test_abstract_unix_any_gets_a_name() -> None:
    addr, rx = await serve(parse("unix:"))
    assert addr.is_abstract and addr.name
    tx = dial(addr)
    await tx.send(mk(0))
    assert seqs(await recv_n(rx, 1)) == [0]
    await tx.close()
    await rx.stop()


async def test_bind_error_names_the_address() -> None:
    addr, rx = await serve(ChannelAddr.tcp("127.0.0.1", 0))
    with pytest.raises(OSError, match=f"cannot serve {addr}"):
        await serve(addr)
    await rx.stop()


async def test_close_returns_what_is_unacked() -> None:
    async def silent(raw: Raw) -> None:
        await server_handshake(raw)
        while await raw.frame_or_eof(timeout=30) is not None:
            pass

    async with FakeServer(silent) as addr:
        tx = dial(addr)
        returns = Returns()
        envs = [mk(i) for i in range(3)]
        for e in envs:
            tx.post(e, returns)
        left = await tx.close(flush_timeout_s=0.1)
    assert left == envs and not returns.items
    assert tx.status.reason == "channel closed"
    with pytest.raises(ChannelClosed):
        tx.post(mk(4))


# -- throughput (reported, never asserted) ---------------------------------------------


async def ping_pong(transport: str, n: int) -> float:
    """Sync request/reply between two Rx/Tx pairs in this process; returns calls/s."""
    a_addr, a_rx = await serve(any_addr(transport))
    b_addr, b_rx = await serve(any_addr(transport))
    back = dial(a_addr)
    b_rx.set_handler(lambda env: back.post(env))
    to_b = dial(b_addr)
    loop = asyncio.get_running_loop()
    waiter: list[asyncio.Future[None]] = []
    a_rx.set_handler(lambda env: waiter.pop().set_result(None))
    start = time.perf_counter()
    for i in range(n):
        fut = loop.create_future()
        waiter.append(fut)
        to_b.post(mk(i))
        await fut
    rate = n / (time.perf_counter() - start)
    for tx in (back, to_b):
        await tx.close()
    await a_rx.stop()
    await b_rx.stop()
    return rate


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["unix", "local"])
async def test_throughput_smoke(transport: str, record_property: Any) -> None:
    rate = await ping_pong(transport, 2000)
    record_property(f"ping_pong_{transport}_per_s", round(rate))
    assert rate > 0


# -- two-process benchmark (python tests/integration/test_channel.py) --------------------


async def _echo_main(back: str) -> None:
    addr, rx = await serve(any_addr("unix"))
    sys.stdout.write(f"{addr}\n")
    sys.stdout.flush()
    tx = dial(parse(back))
    done = asyncio.get_running_loop().create_future()

    def handle(env: Envelope) -> None:
        if env.data == b"stop":
            done.set_result(None)
        else:
            tx.post(env)

    rx.set_handler(handle)
    await done
    await tx.close()
    await rx.stop()


async def _bench_main() -> None:
    addr, rx = await serve(any_addr("unix"))
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--echo", str(addr), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        tx = dial(parse((await child.stdout.readline()).decode().strip()))
        loop = asyncio.get_running_loop()
        waiters: dict[int, asyncio.Future[None]] = {}
        rx.set_handler(lambda env: waiters.pop(int(env.data)).set_result(None))

        async def call(i: int) -> None:
            fut = loop.create_future()
            waiters[i] = fut
            tx.post(mk(i))
            await fut

        for i in range(2000):
            await call(i)
        n = 20_000
        start = time.perf_counter()
        for i in range(n):
            await call(i)
        print(f"1_1 sync request/reply over unix: {n / (time.perf_counter() - start):,.0f}/s")
        n, inflight = 100_000, 1000

        async def worker(k: int) -> None:
            for i in range(k, n, inflight):
                await call(i)

        start = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(inflight)))
        print(f"1_1 async (1000 in flight) over unix: {n / (time.perf_counter() - start):,.0f}/s")
        tx.post(mk(0, data=b"stop"))
        await tx.close()
    finally:
        async with asyncio.timeout(10):
            await child.wait()
        await rx.stop()


if __name__ == "__main__":
    os.environ.setdefault("PALATINE_CLUSTER_TOKEN", TOKEN)
    from palatine.core.runtime import new_event_loop

    bench_loop = new_event_loop()
    if sys.argv[1:2] == ["--echo"]:
        bench_loop.run_until_complete(_echo_main(sys.argv[2]))
    else:
        print(f"loop: {type(bench_loop).__module__}")
        bench_loop.run_until_complete(_bench_main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spin_us", "lane", "spins"),
    [(1_000_000, True, True), (0, True, False), (1_000_000, False, False)],
)
async def test_a_loop_stays_awake_for_the_idle_spin_after_a_lane_request(
    spin_us: int, lane: bool, spins: bool
) -> None:
    """A request on a lane keeps the receiving loop polling (`palatine.channel.spin`), so
    the caller's next request is read without a wake-up; other connections do not, and
    ``PALATINE_IDLE_SPIN_US=0`` turns it off."""
    from palatine.channel.spin import _spins

    loop = asyncio.get_running_loop()
    _spins.pop(loop, None)
    with config.override(idle_spin_us=spin_us):
        addr, rx = await net_rx("unix")
        seen: list[Envelope] = []
        rx.set_handler(seen.append, lambda procs: None)
        raw = await Raw.client(
            addr, session_id=78, lane=ActorId.parse("src[0].lane[4]") if lane else None
        )
        assert await raw.frame() == Ack(-1)
        raw.send_msg(0, mk(0))
        await wait_for(lambda: bool(seen))
        spinning = _spins[loop].spinning
        raw.close()
        await rx.stop()
    _spins.pop(loop, None)
    assert spinning is spins


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_both_ends_of_a_connection_get_the_socket_options(
    transport: str, unix_send_buffer: int
) -> None:
    addr, rx = await net_rx(transport)
    assert isinstance(rx, NetRx)
    tx = dial(addr)
    await tx.send(mk(0))
    assert seqs(await recv_n(rx, 1)) == [0]
    assert tx._conn is not None and tx._conn.transport is not None
    (server,) = rx._conns
    assert server.transport is not None
    for t in (tx._conn.transport, server.transport):
        sock = t.get_extra_info("socket")
        if transport == "unix":
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == unix_send_buffer
        else:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    await tx.close()
    await rx.stop()
