"""The payload codec's out-of-band buffers, sans-IO.

A runtime message holding `pickle.PickleBuffer` objects (a pickled value's buffers) is
encoded by `encode_message_oob` with the buffers left out of the msgpack bytes, and
`decode_payload` maps them back onto the envelope's buffers without copying them;
`encode_message` still produces a self-contained payload.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import msgspec
import numpy as np
import pytest

from palatine.ids import ActorId, PortId
from palatine.protocol.controller import Result
from palatine.protocol.worker import FetchResult, Ok, Pickled
from palatine.tensor.worker.values import dumps_fetched, loads_value
from palatine.wire.codec import (
    OOB_EXT_CODE,
    Message,
    decode_payload,
    display,
    encode_message,
    encode_message_oob,
)
from palatine.wire.envelope import ENC_MSGPACK, Envelope

pytestmark = pytest.mark.timeout(30)

SENDER = ActorId.parse("worker[1].w[0]")
DEST = ActorId.parse("controller[0].root[0]")


def envelope(msg: Any, data: bytes, buffers: list[Any]) -> Envelope:
    tid = type(msg).__palatine_type_id__
    env = Envelope(SENDER, PortId(DEST, tid), tid, ENC_MSGPACK, data)
    env.buffers = buffers
    return env


def fetch_result(value: Any, seq: int = 3) -> FetchResult:
    return FetchResult(seq=seq, value=Ok(dumps_fetched(value)))


def test_buffers_stay_out_of_the_msgpack_bytes() -> None:
    arrays = [np.arange(250_000, dtype=np.float64), np.ones((300, 400), dtype=np.int32)]
    msg = fetch_result(arrays)
    data, buffers = encode_message_oob(msg)
    assert len(buffers) == 2 and all(type(b) is pickle.PickleBuffer for b in buffers)
    assert len(data) < 1024  # 2.5 MB of arrays, none of it inline
    assert [b.raw().nbytes for b in buffers] == [a.nbytes for a in arrays]
    got = decode_payload(envelope(msg, data, buffers))
    assert type(got) is FetchResult and got.seq == 3
    out = loads_value(got.value.value)
    assert all(
        np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(out, arrays, strict=True)
    )


def test_decoded_buffers_are_views_of_the_envelope_buffers() -> None:
    msg = fetch_result(np.zeros(1000, dtype=np.uint8))
    data, buffers = encode_message_oob(msg)
    # What a receiver holds: a writable region of a received frame.
    frame = bytearray(bytes(buffers[0].raw()))
    got = decode_payload(envelope(msg, data, [memoryview(frame)]))
    (buf,) = got.value.value.buffers
    assert type(buf) is pickle.PickleBuffer
    frame[7] = 42  # no copy in between: the decoded value sees the frame's memory
    assert buf.raw()[7] == 42
    arr = loads_value(got.value.value)
    assert arr[7] == 42 and arr.flags.writeable


def test_a_forwarder_re_encodes_out_of_band_without_copying() -> None:
    """The controller decodes a FetchResult and sends its value on inside a Result."""
    msg = fetch_result(np.arange(100_000, dtype=np.int64))
    data, buffers = encode_message_oob(msg)
    frame = bytearray(bytes(buffers[0].raw()))
    got = decode_payload(envelope(msg, data, [memoryview(frame)]))
    result = Result(seq=3, result=got.value)
    data2, buffers2 = encode_message_oob(result)
    assert len(data2) < 1024 and len(buffers2) == 1
    assert np.shares_memory(
        np.frombuffer(buffers2[0], dtype=np.uint8), np.frombuffer(frame, dtype=np.uint8)
    )
    again = decode_payload(envelope(result, data2, buffers2))
    assert np.array_equal(loads_value(again.result.value), np.arange(100_000))


def test_messages_without_buffers_encode_as_before() -> None:
    msg = FetchResult(seq=1, value=Ok(Pickled(b"\x80\x05K\x07.", [b"inline"])))
    data, buffers = encode_message_oob(msg)
    assert buffers == [] and data == encode_message(msg)
    got = decode_payload(envelope(msg, data, []))
    assert got == msg


def test_encode_message_inlines_pickle_buffers() -> None:
    arr = np.arange(1000, dtype=np.int16)
    msg = fetch_result(arr)
    data = encode_message(msg)
    assert len(data) > arr.nbytes  # self-contained
    got = decode_payload(envelope(msg, data, []))
    assert [type(b) for b in got.value.value.buffers] == [bytes]
    assert np.array_equal(loads_value(got.value.value), arr)


def test_buffer_reference_without_its_buffer_is_a_decode_error() -> None:
    msg = fetch_result(np.arange(10))
    data, buffers = encode_message_oob(msg)
    assert buffers
    with pytest.raises(ValueError, match="out-of-band buffer"):
        decode_payload(envelope(msg, data, []))


class Foreign(Message):
    """A message carrying some other msgpack extension."""

    ext: Any


def test_other_extension_codes_still_decode_as_ext() -> None:
    msg = Foreign(ext=msgspec.msgpack.Ext(OOB_EXT_CODE + 1, b"xyz"))
    data, buffers = encode_message_oob(msg)
    assert buffers == []
    assert decode_payload(envelope(msg, data, [])).ext == msgspec.msgpack.Ext(
        OOB_EXT_CODE + 1, b"xyz"
    )


def test_threads_encode_and_decode_independently() -> None:
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(200):
                n = 1 + (k * 7 + i) % 5
                arrays = [np.full(50 + j, k * 1000 + i, dtype=np.int64) for j in range(n)]
                msg = fetch_result(arrays, seq=i)
                data, buffers = encode_message_oob(msg)
                assert len(buffers) == n
                out = loads_value(decode_payload(envelope(msg, data, buffers)).value.value)
                assert [a.tolist() for a in out] == [a.tolist() for a in arrays]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_display_of_a_message_with_buffers() -> None:
    msg = fetch_result(np.arange(10))
    data, buffers = encode_message_oob(msg)
    assert display(envelope(msg, data, buffers)).startswith(f"{SENDER} > ")
