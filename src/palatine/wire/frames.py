"""Channel frames: the structs, the encoder and an incremental parser (sans-IO).

Wire layout of every frame::

    [8-byte BE length L][4-byte BE header length H][H bytes msgpack header][raw buffers]

``L`` counts everything after itself (``4 + H + sum(buffer lengths)``). The header is
one of the tagged, array-like structs below. Only `Message` carries raw buffers: its
``buffer_lens`` lists them, in order, and they follow the header byte for byte. The
envelope inside a `Message` header is encoded with ``buffers = []``; the receiver
re-attaches the raw buffers as memoryviews of the received frame, so out-of-band pickle
buffers (arrays, tensors) are never copied into or out of msgpack.

Limits: a length prefix above the parser's ``limit`` (64 KiB before authentication,
``max_frame_bytes`` after) is refused before any body byte is read or allocated, so a
2**62 length costs nothing. Zero-length buffers are legal.

Nothing here touches sockets or the event loop; `palatine.channel.net` (asyncio) and the
heartbeat thread (blocking sockets) share it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Final

import msgspec

from palatine.errors import PalatineError
from palatine.ids import ActorId
from palatine.wire.buffers import fresh_bytes, take_buffer
from palatine.wire.envelope import Envelope

__all__ = [
    "PREAUTH_MAX_FRAME_BYTES",
    "PREFIX_BYTES",
    "PROTOCOL_VERSION",
    "Ack",
    "Auth",
    "AuthOk",
    "Frame",
    "FrameError",
    "FrameParser",
    "Hello",
    "Init",
    "Message",
    "Reject",
    "buffer_view",
    "encode_frame",
    "encode_message",
    "frames_bytes",
    "join_message",
    "message_frame_size",
]

PROTOCOL_VERSION: Final = 1
"""The handshake version this build speaks (``Hello.version`` / ``Auth.version``)."""

PREAUTH_MAX_FRAME_BYTES: Final = 64 * 1024
"""Largest frame accepted before authentication completes."""

PREFIX_BYTES: Final = 12
"""The 8-byte frame length plus the 4-byte header length."""

# Frames below this size (length prefix included) are gathered into one small bytes
# object when they straddle reads; larger ones get a dedicated, writable buffer from the
# pool (`palatine.wire.buffers`) that the body is read or copied into once, and whose
# memory backs the envelope's buffers.
_BIG_FRAME_BYTES: Final = 256 * 1024


# A sequence number on the wire: a negative one is a malformed frame, not a retransmit.
_Seq = Annotated[int, msgspec.Meta(ge=0)]


class Hello(msgspec.Struct, tag=1, array_like=True, gc=False):
    """Server → client on accept: ``nonce_s`` is 32 fresh random bytes."""

    version: int
    nonce: bytes


class Auth(msgspec.Struct, tag=2, array_like=True, gc=False):
    """Client → server: its nonce and ``HMAC(token, "palatine/1 client" + nonce_s + nonce_c)``."""

    version: int
    nonce: bytes
    mac: bytes


class AuthOk(msgspec.Struct, tag=3, array_like=True, gc=False):
    """Server → client: ``HMAC(token, "palatine/1 server" + nonce_c + nonce_s)``."""

    mac: bytes


class Init(msgspec.Struct, tag=4, array_like=True, gc=False):
    """Client → server once authenticated: which session, and its oldest unacked seq.

    The server answers every ``Init`` with ``Ack(expected - 1)`` — ``Ack(-1)`` for a
    session that has received nothing — so a reconnecting client can drop what already
    arrived before resending.

    ``lane`` (ours) opens a *lane* (`palatine.fastpath.lane`): one calling thread's connection on
    which the server also sends back, as ``Message`` frames of its own, whatever is
    addressed to the actor ``lane`` (the replies to that thread's calls).
    """

    session_id: int
    next_seq: _Seq
    lane: ActorId | None = None


class Message(msgspec.Struct, tag=5, array_like=True, gc=False):
    """Client → server: one envelope with its session sequence number.

    ``ack_now`` asks the server to acknowledge at once (``Tx.send``). ``buffer_lens``
    are the byte lengths of the envelope's out-of-band buffers, which follow the header
    raw; the envelope in the header always has ``buffers == []``. ``bytes_buffers``
    lists those that are `bytes` objects: in a big frame, the receiver reads each of
    them into a `bytes` of its own, which the value then is (no copy).
    """

    seq: _Seq
    ack_now: bool
    envelope: Envelope
    buffer_lens: list[int] = []
    bytes_buffers: list[int] = []


class Ack(msgspec.Struct, tag=6, array_like=True, gc=False):
    """Server → client: every seq ``<= seq`` of the session is delivered (cumulative).

    Acks of one session never decrease; ``-1`` (only as the answer to ``Init``) means
    nothing yet.
    """

    seq: int


class Reject(msgspec.Struct, tag=7, array_like=True, gc=False):
    """Either side, just before closing: why the connection is refused."""

    reason: str


Frame = Hello | Auth | AuthOk | Init | Message | Ack | Reject


class FrameError(PalatineError, ValueError):
    """The byte stream is not a valid frame sequence; raised by `FrameParser.feed`.

    ``reason`` is the text for logs and ``Reject``. ``before_body`` is True when the
    length prefix itself was refused (the connection is closed without a reply).
    """

    def __init__(self, reason: str, *, before_body: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.before_body = before_body


_prefix = struct.Struct(">QI")
_u64 = struct.Struct(">Q")
_u32 = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_NO_BUFFERS: list[Any] = []


def buffer_view(buf: Any) -> memoryview:
    """A flat unsigned-byte memoryview of ``buf`` (bytes, PickleBuffer, array, …).

    Raises `BufferError` for a non-contiguous buffer (pickle never produces one).
    """
    raw = getattr(buf, "raw", None)
    view = raw() if raw is not None else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def encode_frame(frame: Frame) -> bytes:
    """Encode a frame without buffers (everything except `Message`) into wire bytes."""
    header = _encoder.encode(frame)
    return _prefix.pack(len(header) + 4, len(header)) + header


def encode_message(seq: int, ack_now: bool, env: Envelope) -> tuple[bytes, list[memoryview], int]:
    """Encode one `Message` frame: ``(head, buffers, frame_bytes)``.

    ``head`` is the length prefix plus header; the frame on the wire is ``head``
    followed by each of ``buffers`` (flat views of ``env.buffers``, not copies).
    ``frame_bytes`` is the whole frame including the 8-byte prefix, to compare with
    ``max_frame_bytes``. ``env`` is left unchanged.
    """
    bufs = env.buffers
    if not bufs:
        header = _encoder.encode(Message(seq, ack_now, env))
        return _prefix.pack(len(header) + 4, len(header)) + header, _NO_BUFFERS, len(header) + 12
    views = [buffer_view(b) for b in bufs]
    lens = [v.nbytes for v in views]
    whole = [
        i for i, v in enumerate(views) if lens[i] and type(v.obj) is bytes and len(v.obj) == lens[i]
    ]
    # The header must not contain the buffers: encode the envelope with none attached.
    env.buffers = _NO_BUFFERS
    try:
        header = _encoder.encode(Message(seq, ack_now, env, lens, whole))
    finally:
        env.buffers = bufs
    body = 4 + len(header) + sum(lens)
    return _prefix.pack(body, len(header)) + header, views, body + 8


def message_frame_size(env: Envelope) -> int:
    """The wire size of ``env`` as a `Message` frame (prefix included), seq ``2**64-1``."""
    return encode_message(2**64 - 1, True, env)[2]


_decoder = msgspec.msgpack.Decoder(Frame)


def _decode_header(header: memoryview) -> Frame:
    try:
        frame: Frame = _decoder.decode(header)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise FrameError(f"undecodable frame header: {exc}") from None
    except RecursionError:
        raise FrameError("undecodable frame header: nested too deeply") from None
    return frame


class _BigFrame:
    """A big frame being received, in segments of memory of their own: the header's
    length, the header, then each of a `Message`'s buffers (a `bytes` one straight into
    a new `bytes`, `Message.bytes_buffers`; the others into one pooled block)."""

    __slots__ = ("bufs", "done", "frame", "head", "length", "phase", "seg", "segs")

    def __init__(self, length: int) -> None:
        self.length = length  # of the body (after the length prefix)
        self.phase = 0  # 0: the header's length, 1: the header, 2: the buffers
        self.segs: list[memoryview] = [memoryview(bytearray(4))]
        self.seg = 0
        self.done = 0  # bytes of the segments already filled
        self.head: memoryview | None = None
        self.frame: Frame | None = None
        self.bufs: list[Any] = []

    def current(self) -> memoryview:
        return self.segs[self.seg]

    def advance(self) -> Frame | None:
        """The current segment is full: plan the next one; the frame once all is in."""
        self.done += len(self.segs[self.seg])
        if self.phase == 0:
            (hlen,) = _u32.unpack_from(self.segs[0], 0)
            if 4 + hlen > self.length:
                raise FrameError(f"header length {hlen} exceeds the frame ({self.length} bytes)")
            self.head = (
                take_buffer(hlen) if hlen >= _BIG_FRAME_BYTES else memoryview(bytearray(hlen))
            )
            self.phase = 1
            if hlen:
                self.segs, self.seg = [self.head], 0
                return None
        if self.phase == 1:
            assert self.head is not None
            return self._plan(_decode_header(self.head))
        self.seg += 1
        if self.seg < len(self.segs):
            return None
        return self._complete()

    def _plan(self, frame: Frame) -> Frame | None:
        assert self.head is not None
        rest = self.length - 4 - len(self.head)
        lens = frame.buffer_lens if type(frame) is Message else None
        if not lens:
            if rest:
                raise FrameError(f"{rest} stray bytes after the frame header")
            if type(frame) is Message and frame.envelope.buffers:
                raise FrameError("message envelope carries inline buffers")
            return frame
        assert type(frame) is Message
        if any(n < 0 for n in lens) or sum(lens) > rest:
            raise FrameError("message buffers exceed the frame")
        if sum(lens) < rest:
            raise FrameError(f"{rest - sum(lens)} stray bytes after the message buffers")
        whole = set(frame.bytes_buffers)
        pooled = sum(n for i, n in enumerate(lens) if i not in whole)
        try:
            block = take_buffer(pooled) if pooled else memoryview(b"")
            pos = 0
            bufs: list[Any] = []
            segs: list[memoryview] = []
            for i, n in enumerate(lens):
                if i in whole and n:
                    data, view = fresh_bytes(n)
                    bufs.append(data)
                    segs.append(view)
                    continue
                part = block[pos : pos + n]
                pos += n
                bufs.append(part)
                if n:
                    segs.append(part)
        except MemoryError:
            raise FrameError(f"no memory for a frame of {self.length} bytes") from None
        self.frame, self.bufs, self.segs, self.seg, self.phase = frame, bufs, segs, 0, 2
        return None if segs else self._complete()

    def _complete(self) -> Frame:
        frame = self.frame
        assert type(frame) is Message
        frame.envelope.buffers = self.bufs
        return frame


def _decode_body(buf: Any, view: memoryview, start: int, end: int) -> Frame:
    """Decode the frame body ``buf[start:end]`` (``view`` is ``memoryview(buf)``)."""
    if end - start < 4:
        raise FrameError(f"frame of {end - start} bytes has no header length")
    (hlen,) = _u32.unpack_from(buf, start)
    hstart = start + 4
    hend = hstart + hlen
    if hend > end:
        raise FrameError(f"header length {hlen} exceeds the frame ({end - start} bytes)")
    frame = _decode_header(view[hstart:hend])
    if type(frame) is Message:
        lens = frame.buffer_lens
        if lens:
            pos = hend
            bufs: list[Any] = []
            for n in lens:
                if n < 0 or pos + n > end:
                    raise FrameError("message buffers exceed the frame")
                bufs.append(view[pos : pos + n])
                pos += n
            if pos != end:
                raise FrameError(f"{end - pos} stray bytes after the message buffers")
            frame.envelope.buffers = bufs
        elif hend != end:
            raise FrameError(f"{end - hend} stray bytes after the frame header")
        elif frame.envelope.buffers:
            raise FrameError("message envelope carries inline buffers")
    elif hend != end:
        raise FrameError(f"{end - hend} stray bytes after the frame header")
    return frame


class FrameParser:
    """Incremental frame decoder: `feed` bytes as they arrive, get complete frames back.

    Complete frames inside one chunk are decoded in place (no copy of the chunk); only
    the partial frame at a chunk's end is kept. Big frames are assembled into one
    dedicated pooled buffer, so a large message costs at most one copy (none when the
    reader receives straight into `big_window`) and its buffers are writable memoryviews
    of that buffer. ``limit`` may be raised after authentication; a length
    prefix above it raises `FrameError` (``before_body=True``) without allocating.
    After a `FrameError` the stream is unusable: close the connection.
    """

    __slots__ = ("_big", "_big_pos", "_bf", "_failed", "_part", "limit")

    def __init__(self, limit: int = PREAUTH_MAX_FRAME_BYTES) -> None:
        self.limit = limit
        # Bytes of an incomplete small frame (or of an incomplete length prefix).
        self._part = bytearray()
        # An incomplete big frame (`_BigFrame`): the segment being filled and how much
        # of it is.
        self._bf: _BigFrame | None = None
        self._big: memoryview | None = None
        self._big_pos = 0
        self._failed = False

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (EOF now would be a clean end)."""
        return not self._part and self._big is None

    @property
    def buffered_bytes(self) -> int:
        """How many bytes of an incomplete frame are held."""
        done = self._bf.done if self._bf is not None else 0
        return len(self._part) + done + self._big_pos

    def discard(self) -> None:
        """Drop any incomplete frame (its connection is gone): its buffer is freed, and
        the parser takes nothing more."""
        self._part = bytearray()
        self._bf = None
        self._big = None
        self._big_pos = 0
        self._failed = True

    def _check(self, length: int) -> None:
        if length > self.limit:
            self._failed = True
            raise FrameError(
                f"frame length {length} exceeds the limit of {self.limit} bytes",
                before_body=True,
            )

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Consume ``data`` and return the frames it completes, in order.

        Raises `FrameError` for a length over the limit, an undecodable header or
        inconsistent buffer lengths; frames completed before the bad one are lost with
        the connection, which must be closed.
        """
        if self._failed:
            raise FrameError("frame stream already failed")
        if type(data) is not bytes:
            # Views of the caller's mutable buffer must not leak into envelopes.
            data = bytes(data)
        out: list[Frame] = []
        n = len(data)
        off = 0
        try:
            if self._big is not None:
                off = self._fill_big(data, out)
                if self._big is not None:
                    return out
            elif self._part:
                off = self._fill_part(data, out)
                if self._part or self._big is not None:
                    return out
            view = memoryview(data)
            unpack = _u64.unpack_from
            while n - off >= 8:
                (length,) = unpack(data, off)
                if length > self.limit:
                    self._check(length)
                end = off + 8 + length
                if end > n:
                    break
                out.append(_decode_body(data, view, off + 8, end))
                off = end
            if off < n:
                self._keep(data, off)
            return out
        except FrameError:
            self._failed = True
            raise

    def big_window(self) -> memoryview | None:
        """The unfilled rest of the big frame being assembled, else None.

        A reader may receive straight into it (no intermediate copy), then report the
        byte count with `big_filled`; it must not read past the window.
        """
        big = self._big
        return None if big is None or self._failed else big[self._big_pos :]

    def big_filled(self, n: int) -> list[Frame]:
        """``n`` bytes were written at the start of `big_window`: the frame, if complete."""
        big = self._big
        if big is None or n < 0 or self._big_pos + n > len(big):
            raise ValueError("big_filled without a matching big_window")
        self._big_pos += n
        if self._big_pos < len(big):
            return []
        frame = self._next_segment()
        return [] if frame is None else [frame]

    def _next_segment(self) -> Frame | None:
        """The segment being filled is full: on to the next, or the frame is done."""
        bf = self._bf
        assert bf is not None
        try:
            frame = bf.advance()
        except FrameError:
            self._failed = True
            raise
        if frame is None:
            self._big = bf.current()
            self._big_pos = 0
            return None
        self._bf = None
        self._big = None
        self._big_pos = 0
        return frame

    def _keep(self, data: bytes, off: int) -> None:
        """Hold the incomplete frame starting at ``data[off:]``."""
        if len(data) - off >= 8:
            (length,) = _u64.unpack_from(data, off)
            if length + 8 >= _BIG_FRAME_BYTES:
                self._start_big(length)
                self._fill_big(memoryview(data)[off + 8 :], [])
                return
        self._part += memoryview(data)[off:]

    def _start_big(self, length: int) -> None:
        # Its buffers go into pooled memory (no page faults for a body as big as the one
        # before; a block is reused only once no buffer of it is referenced any more),
        # a `bytes` buffer into a new `bytes` (`_BigFrame`).
        self._bf = _BigFrame(length)
        self._big = self._bf.current()
        self._big_pos = 0

    def _fill_big(self, data: bytes | memoryview, out: list[Frame]) -> int:
        """Copy into the big frame; returns bytes consumed, appends the frame when full."""
        off = 0
        n = len(data)
        while off < n:
            big = self._big
            assert big is not None
            need = len(big) - self._big_pos
            take = min(need, n - off)
            big[self._big_pos : self._big_pos + take] = data[off : off + take]
            self._big_pos += take
            off += take
            if take == need:
                frame = self._next_segment()
                if frame is not None:
                    out.append(frame)
                    break
        return off

    def _fill_part(self, data: bytes, out: list[Frame]) -> int:
        """Complete the held small frame (or prefix); returns bytes of ``data`` consumed."""
        part = self._part
        off = 0
        if len(part) < 8:
            off = min(8 - len(part), len(data))
            part += data[:off]
            if len(part) < 8:
                return off
        length: int = _u64.unpack_from(part, 0)[0]
        self._check(length)
        total = length + 8
        if total >= _BIG_FRAME_BYTES:
            # Only a prefix (and maybe a little body) was held: switch to a big frame.
            held = bytes(part[8:])
            part.clear()
            self._start_big(length)
            self._fill_big(held, out)
            if self._big is None:
                return off
            return off + self._fill_big(memoryview(data)[off:], out)
        take = min(total - len(part), len(data) - off)
        part += memoryview(data)[off : off + take]
        off += take
        if len(part) == total:
            body = bytes(part)  # a private copy: buffers may keep views of it
            part.clear()
            out.append(_decode_body(body, memoryview(body), 8, total))
        return off


def frames_bytes(frames: Iterable[Frame]) -> bytes:
    """Concatenated encoding of buffer-free frames (tests and the blocking client)."""
    return b"".join(encode_frame(f) for f in frames)


def join_message(head: bytes, buffers: Sequence[memoryview]) -> bytes:
    """One contiguous copy of an encoded message frame (tests, tiny blocking writers)."""
    return head + b"".join(buffers) if buffers else head
