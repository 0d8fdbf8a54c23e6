"""Frame layout, encoder and incremental parser, sans-IO."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palatine.ids import ActorId, PortId
from palatine.wire.envelope import Envelope
from palatine.wire.frames import (
    PREAUTH_MAX_FRAME_BYTES,
    Ack,
    Auth,
    AuthOk,
    FrameError,
    FrameParser,
    Hello,
    Init,
    Message,
    Reject,
    encode_frame,
    encode_message,
    join_message,
    message_frame_size,
)

SENDER = ActorId.parse("src[0].actor[0]")
DEST = ActorId.parse("dst[1].actor[0]").port(1025)
CONTROL = [
    Hello(1, b"n" * 32),
    Auth(1, b"c" * 32, b"m" * 32),
    AuthOk(b"s" * 32),
    Init(2**64 - 1, 5),
    Ack(7),
    Ack(-1),
    Reject("sequence gap: expected 2, got 3"),
]


def env(data: bytes = b"payload", buffers: list[object] | None = None) -> Envelope:
    return Envelope(SENDER, DEST, 2**63 + 1, 1, data, buffers=buffers or [])


def message_bytes(seq: int, e: Envelope, ack_now: bool = False) -> bytes:
    head, bufs, _ = encode_message(seq, ack_now, e)
    return join_message(head, bufs)


def test_layout_is_length_header_length_header_buffers() -> None:
    e = env(buffers=[b"abc", b"", bytearray(b"wxyz")])
    raw = message_bytes(3, e)
    (length, hlen) = struct.unpack_from(">QI", raw)
    assert length == len(raw) - 8
    header = raw[12 : 12 + hlen]
    assert raw[12 + hlen :] == b"abcwxyz"  # buffers follow the header, raw
    decoded = msgspec.msgpack.decode(header)
    assert decoded[0] == 5  # the Message tag
    assert decoded[1:3] == [3, False]
    assert decoded[-2] == [3, 0, 4]  # buffer lengths, not contents
    assert decoded[-1] == [0]  # the buffers that are whole `bytes` objects
    assert b"wxyz" not in header


def test_encode_does_not_copy_buffers_or_change_the_envelope() -> None:
    big = bytearray(b"x" * 100_000)
    e = env(buffers=[big])
    head, bufs, size = encode_message(0, True, e)
    assert e.buffers == [big] and e.buffers[0] is big
    assert bufs[0].obj is big  # a view, not a copy
    assert len(head) < 200
    assert size == len(head) + len(big)
    assert message_frame_size(e) >= size


@pytest.mark.parametrize("frame", CONTROL, ids=lambda f: type(f).__name__)
def test_control_frames_round_trip(frame: object) -> None:
    assert FrameParser().feed(encode_frame(frame)) == [frame]  # type: ignore[arg-type]


def test_message_round_trip_byte_by_byte_with_zero_length_buffers() -> None:
    e = env(buffers=[b"", b"abc", b""])
    raw = message_bytes(9, e, ack_now=True)
    parser = FrameParser()
    out = []
    for i in range(len(raw)):
        assert parser.at_boundary == (i == 0)
        out += parser.feed(raw[i : i + 1])
    assert parser.at_boundary
    (msg,) = out
    assert isinstance(msg, Message)
    assert (msg.seq, msg.ack_now) == (9, True)
    got = msg.envelope
    assert [bytes(b) for b in got.buffers] == [b"", b"abc", b""]
    assert (got.sender, got.dest, got.data, got.type_id) == (SENDER, DEST, b"payload", 2**63 + 1)


def test_many_frames_in_one_chunk_and_split_anywhere() -> None:
    stream = b"".join(message_bytes(i, env(b"%d" % i)) for i in range(50))
    stream += encode_frame(Ack(3))
    for cut in (1, 7, 8, 13, 100, len(stream) // 2, len(stream) - 1):
        parser = FrameParser()
        frames = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        assert [f.envelope.data for f in frames[:-1]] == [b"%d" % i for i in range(50)]
        assert frames[-1] == Ack(3)


def test_big_frame_gets_its_own_writable_buffer() -> None:
    payload = bytearray(bytes(range(256)) * 4096)  # 1 MiB
    raw = message_bytes(1, env(buffers=[payload, bytearray(b"tail")]))
    parser = FrameParser(limit=10 * 2**20)
    out = []
    for i in range(0, len(raw), 65536):
        out += parser.feed(raw[i : i + 65536])
    (msg,) = out
    big, tail = msg.envelope.buffers
    assert bytes(big) == payload and bytes(tail) == b"tail"
    assert not big.readonly


@pytest.mark.parametrize("chunk", [65536, 1 << 20])
def test_a_bytes_buffer_of_a_big_frame_arrives_as_a_bytes_of_its_own(chunk: int) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    raw = message_bytes(1, env(buffers=[bytearray(b"head"), payload, b"", b"tail"]))
    for read in (
        lambda p: [f for i in range(0, len(raw), chunk) for f in p.feed(raw[i : i + chunk])],
        lambda p: read_like_a_socket(p, raw, chunk),
    ):
        parser = FrameParser(limit=10 * 2**20)
        (msg,) = read(parser)
        head, big, empty, tail = msg.envelope.buffers
        assert type(big) is bytes and big == payload  # the value can be this very object
        assert type(tail) is bytes and tail == b"tail"
        assert bytes(head) == b"head" and not memoryview(head).readonly
        assert bytes(empty) == b""
        assert parser.at_boundary


def read_like_a_socket(parser: FrameParser, stream: bytes, chunk: int) -> list[object]:
    """What `palatine.channel.net.rx` does: receive straight into `big_window` when one
    is open (never past it), otherwise a chunk for `feed`."""
    out: list[object] = []
    pos = 0
    while pos < len(stream):
        window = parser.big_window()
        if window is not None:
            n = min(len(window), chunk, len(stream) - pos)
            window[:n] = stream[pos : pos + n]
            out += parser.big_filled(n)
        else:
            n = min(chunk, len(stream) - pos)
            out += parser.feed(stream[pos : pos + n])
        pos += n
    return out


@pytest.mark.parametrize("chunk", [7, 4096, 65536, 1 << 20])
def test_reading_into_the_big_window_gives_the_same_frames(chunk: int) -> None:
    payloads = [bytes(range(256)) * 2048, b"x" * 300_000, bytes(1 << 20)]  # 512 KiB ...
    stream = b"".join(
        [message_bytes(0, env(b"small")), encode_frame(Ack(1))]
        + [
            message_bytes(i + 1, env(b"%d" % i, [bytearray(p), bytearray(b"tail")]))
            for i, p in enumerate(payloads)
        ]
        + [message_bytes(9, env(b"last"))]
    )
    parser = FrameParser(limit=1 << 30)
    frames = read_like_a_socket(parser, stream, chunk)
    assert parser.at_boundary and parser.big_window() is None
    assert [type(f).__name__ for f in frames] == ["Message", "Ack"] + ["Message"] * 4
    for f, p in zip(frames[2:5], payloads, strict=True):
        big, tail = f.envelope.buffers  # type: ignore[attr-defined]
        assert bytes(big) == p and bytes(tail) == b"tail"
        assert big.obj is tail.obj  # views of one buffer: the frame's, or a whole chunk's
        if chunk < len(p):
            assert not big.readonly  # assembled in the frame's own buffer
    assert frames[-1].envelope.data == b"last"  # type: ignore[attr-defined]


def test_big_frames_do_not_share_memory() -> None:
    one = message_bytes(0, env(buffers=[bytearray(b"a" * 500_000)]))
    two = message_bytes(1, env(buffers=[bytearray(b"b" * 500_000)]))
    parser = FrameParser(limit=1 << 30)
    (first,) = read_like_a_socket(parser, one, 65536)
    (second,) = read_like_a_socket(parser, two, 65536)
    first.envelope.buffers[0][:3] = b"zzz"  # type: ignore[attr-defined]
    assert bytes(second.envelope.buffers[0][:3]) == b"bbb"  # type: ignore[attr-defined]
    assert bytes(first.envelope.buffers[0][3:6]) == b"aaa"  # type: ignore[attr-defined]


def test_big_filled_without_a_window_is_refused() -> None:
    parser = FrameParser()
    with pytest.raises(ValueError):
        parser.big_filled(1)


def test_feeding_a_bytearray_does_not_alias_it() -> None:
    chunk = bytearray(message_bytes(0, env(buffers=[b"keep"])))
    (msg,) = FrameParser().feed(chunk)
    chunk[:] = b"\0" * len(chunk)
    assert bytes(msg.envelope.buffers[0]) == b"keep"


def test_preauth_limit_refuses_the_prefix_before_any_body() -> None:
    parser = FrameParser()
    with pytest.raises(FrameError) as info:
        parser.feed(struct.pack(">Q", PREAUTH_MAX_FRAME_BYTES + 1))
    assert info.value.before_body
    assert "exceeds the limit" in info.value.reason
    with pytest.raises(FrameError):
        parser.feed(b"")  # a failed stream stays failed


def test_huge_length_prefix_closes_without_allocating() -> None:
    parser = FrameParser(limit=10 * 2**30)
    with pytest.raises(FrameError) as info:
        parser.feed(struct.pack(">Q", 2**62) + b"junk")
    assert info.value.before_body
    assert parser.buffered_bytes == 0


def test_limit_applies_to_a_split_prefix() -> None:
    parser = FrameParser(limit=100)
    parser.feed(struct.pack(">Q", 101)[:3])
    with pytest.raises(FrameError):
        parser.feed(struct.pack(">Q", 101)[3:])


def test_raising_the_limit_after_auth() -> None:
    raw = message_bytes(0, env(b"x" * 70_000))
    parser = FrameParser()
    with pytest.raises(FrameError):
        parser.feed(raw)
    parser = FrameParser()
    parser.limit = 1 << 20
    assert len(parser.feed(raw)) == 1


@pytest.mark.parametrize(
    "body, problem",
    [
        (b"\x00\x00", "no header length"),
        (struct.pack(">I", 99) + b"\x91\x06", "exceeds the frame"),
        (struct.pack(">I", 2) + b"\x92\x63\x01", "undecodable"),  # unknown tag 99
        (struct.pack(">I", 1) + b"\xc1", "undecodable"),  # never-used msgpack byte
        (struct.pack(">I", 3) + b"\x92\x06\x01" + b"extra", "stray bytes"),
    ],
)
def test_malformed_bodies(body: bytes, problem: str) -> None:
    with pytest.raises(FrameError, match=problem):
        FrameParser().feed(struct.pack(">Q", len(body)) + body)


def test_buffer_lengths_must_match_the_frame() -> None:
    raw = bytearray(message_bytes(0, env(buffers=[b"abcd"])))
    with pytest.raises(FrameError, match="exceed the frame"):
        FrameParser().feed(struct.pack(">Q", len(raw) - 9) + raw[8:-1])  # one byte short
    with pytest.raises(FrameError, match="stray bytes"):
        FrameParser().feed(struct.pack(">Q", len(raw) - 7) + raw[8:] + b"!")


def test_eof_mid_frame_is_visible() -> None:
    parser = FrameParser()
    parser.feed(encode_frame(Ack(1))[:-1])
    assert not parser.at_boundary
    assert parser.buffered_bytes > 0


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_only_raise_frame_error(data: bytes) -> None:
    parser = FrameParser(limit=1 << 20)
    try:
        parser.feed(data)
    except FrameError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=64), st.binary(max_size=64), st.integers(0, 40))
def test_fuzz_valid_prefix_then_garbage(cuts: list[int], junk: bytes, at: int) -> None:
    stream = message_bytes(1, env(buffers=[b"zz"])) + encode_frame(Ack(1))
    stream = stream[:at] + junk + stream[at:]
    parser = FrameParser(limit=1 << 20)
    pos = 0
    try:
        for c in cuts:
            parser.feed(stream[pos : pos + c])
            pos += c
        parser.feed(stream[pos:])
    except FrameError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=30))
def test_fuzz_any_split_gives_the_same_frames(sizes: list[int]) -> None:
    stream = b"".join(message_bytes(i, env(b"d" * i, buffers=[b"b" * (i % 3)])) for i in range(10))
    parser = FrameParser()
    out = []
    pos = 0
    for size in sizes * 100:
        if pos >= len(stream):
            break
        out += parser.feed(stream[pos : pos + size])
        pos += size
    out += parser.feed(stream[pos:])
    assert [f.seq for f in out] == list(range(10))
    assert [bytes(f.envelope.buffers[0]) for f in out] == [b"b" * (i % 3) for i in range(10)]


def test_a_header_nested_too_deeply_is_a_frame_error_not_a_crash() -> None:
    # A pre-auth peer's Message whose envelope buffers (list[Any]) nest 1,500 arrays deep:
    # a clear FrameError (the peer gets a Reject), never a RecursionError out of the
    # reader's callback.
    enc = msgspec.msgpack.Encoder()
    env = [[[["w"], 0], "a", 0], [[[["w"], 0], "a", 0], 1], 1, 0, b"", None, None, None]
    nested = b"\x91" * 1500 + b"\xc0"  # [[[…[nil]…]]]
    header = (
        b"\x95"
        + enc.encode(5)
        + enc.encode(0)
        + enc.encode(True)
        + b"\x99"
        + b"".join(enc.encode(x) for x in env)
        + b"\x91"
        + nested
        + b"\x90"
    )
    frame = struct.pack(">QI", len(header) + 4, len(header)) + header
    with pytest.raises(FrameError, match="undecodable frame header: nested too deeply"):
        FrameParser().feed(frame)


def test_a_negative_sequence_number_is_a_malformed_frame() -> None:
    env = Envelope(ActorId.parse("a[0].x[0]"), PortId(ActorId.parse("b[0].y[0]"), 1), 1, 0, b"")
    for bad in (Message(-1, False, env), Init(1, -5)):
        header = msgspec.msgpack.encode(bad)
        frame = struct.pack(">QI", len(header) + 4, len(header)) + header
        with pytest.raises(FrameError, match="Expected `int` >= 0"):
            FrameParser().feed(frame)
