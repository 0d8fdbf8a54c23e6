"""Payload codec: typed runtime messages (msgpack) and user values (pickle 5).

* Runtime messages subclass `Message`; each class gets a stable 64-bit ``type_id``
  (blake2b of its name, bit 63 set) and is registered so any
  process can decode an envelope by its ``type_id``. A collision is an import-time error.
* User values are pickled with protocol 5, out-of-band buffers collected separately.
  The fast path is the stdlib pickler; values that reference ``__main__`` or cannot be
  pickled by reference (lambdas, local classes) fall back to cloudpickle.
* A message may hold `pickle.PickleBuffer` objects (the out-of-band buffers of a pickled
  value). `encode_message_oob` leaves them out of the msgpack bytes: each becomes the
  extension ``Ext(OOB_EXT_CODE, index)`` and the buffer itself is returned, for the
  envelope's ``buffers`` (the net framing writes them raw, without a copy).
  `decode_payload` maps each such extension back to ``PickleBuffer(env.buffers[index])``,
  so a process that only forwards a value (the controller) never copies it either.
  `encode_message` inlines them as msgpack binaries instead (a self-contained payload).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import threading
import types
from typing import Any, ClassVar, Final

import msgspec

from palatine.wire.envelope import ENC_MSGPACK, ENC_PICKLE, Envelope
from palatine.wire.oob import big_bytes, reduce_tensor, tensor_types

__all__ = [
    "Message",
    "type_id_for",
    "type_name_of",
    "message_type",
    "register",
    "encode_message",
    "encode_message_oob",
    "decode_payload",
    "OOB_EXT_CODE",
    "dumps",
    "loads",
    "refers_by_value",
    "PICKLED_VALUE_TID",
    "display",
]

_TYPES: dict[int, type[Any]] = {}
_DECODERS: dict[int, msgspec.msgpack.Decoder[Any]] = {}
_NAMES: dict[int, str] = {}

OOB_EXT_CODE: Final = 5
"""msgpack extension code of an out-of-band buffer reference; its data is the buffer's
index in the envelope's ``buffers`` (4 bytes, big-endian)."""


class _HasBuffers(Exception):
    """Raised by the probing encoder at the first `pickle.PickleBuffer` it meets."""


# Per-thread state: the buffer sink of the encode in progress and the buffers of the
# decode in progress (worker streams encode on their own threads).
_tls = threading.local()


def _inline_hook(obj: Any) -> Any:
    if type(obj) is pickle.PickleBuffer:
        return obj.raw()  # encoded as a msgpack binary (copied into the payload)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _probe_hook(obj: Any) -> Any:
    if type(obj) is pickle.PickleBuffer:
        raise _HasBuffers
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _oob_hook(obj: Any) -> Any:
    if type(obj) is pickle.PickleBuffer:
        sink: list[pickle.PickleBuffer] = _tls.sink
        sink.append(obj)
        return msgspec.msgpack.Ext(OOB_EXT_CODE, (len(sink) - 1).to_bytes(4, "big"))
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != OOB_EXT_CODE:
        return msgspec.msgpack.Ext(code, bytes(data))
    buffers: list[Any] | None = getattr(_tls, "buffers", None)
    index = int.from_bytes(data, "big")
    if buffers is None or len(data) != 4 or index >= len(buffers):
        raise ValueError("out-of-band buffer reference without a matching envelope buffer")
    buf = buffers[index]
    return buf if type(buf) is pickle.PickleBuffer else pickle.PickleBuffer(buf)


_encoder = msgspec.msgpack.Encoder(enc_hook=_inline_hook)
_probe_encoder = msgspec.msgpack.Encoder(enc_hook=_probe_hook)
_oob_encoder = msgspec.msgpack.Encoder(enc_hook=_oob_hook)


def type_id_for(name: str) -> int:
    """The handler-port index of a message type name: blake2b-64, bit 63 set."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") | (1 << 63)


def _name_of(cls: type[Any]) -> str:
    explicit = cls.__dict__.get("__palatine_name__")
    return explicit if explicit else f"{cls.__module__}.{cls.__qualname__}"


def register(cls: type[Any], name: str | None = None) -> int:
    """Register a message type (struct) under its stable name; returns its type id."""
    name = name or _name_of(cls)
    tid = type_id_for(name)
    other = _TYPES.get(tid)
    if other is not None and other is not cls and _NAMES.get(tid) == name:
        # Re-definition of the same name (module reloaded): the newest class wins.
        pass
    elif other is not None and other is not cls:
        raise TypeError(f"message type id collision: {name} and {_NAMES[tid]}")
    _TYPES[tid] = cls
    _NAMES[tid] = name
    _DECODERS.pop(tid, None)  # built lazily: the struct is not complete yet here
    cls.__palatine_type_id__ = tid
    return tid


class Message(msgspec.Struct):
    """Base of typed runtime messages: registered by name with a stable ``type_id``."""

    __palatine_type_id__: ClassVar[int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register(cls)


def type_name_of(type_id: int) -> str:
    """Short display name of a registered type id (``Join``), or a hex placeholder."""
    name = _NAMES.get(type_id)
    if name is None:
        return f"type{type_id:#x}"
    return name.rsplit(".", 1)[-1]


def message_type(type_id: int) -> type[Any] | None:
    """The registered class for ``type_id``, if any."""
    return _TYPES.get(type_id)


def encode_message(msg: Any) -> bytes:
    """msgpack-encode a registered runtime message (`pickle.PickleBuffer`s inlined)."""
    return _encoder.encode(msg)


def encode_message_oob(msg: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """msgpack-encode ``msg`` with its `pickle.PickleBuffer`s out of band.

    Returns ``(data, buffers)``: ``buffers`` (usually empty) go in the envelope's
    ``buffers``, in order, and are not copied. A message without buffers costs one
    plain encode.
    """
    try:
        return _probe_encoder.encode(msg), []
    except _HasBuffers:
        pass
    sink: list[pickle.PickleBuffer] = []
    _tls.sink = sink
    try:
        data = _oob_encoder.encode(msg)
    finally:
        _tls.sink = None
    return data, sink


class _PickledValue:
    """Marker type: an envelope whose payload is a pickled user value."""

    __palatine_name__ = "palatine.PickledValue"


PICKLED_VALUE_TID = register(_PickledValue)


def refers_by_value(obj: Any) -> bool:
    """Whether pickling ``obj`` by reference would name code another process cannot import
    by name: something of ``__main__``, a lambda, a local function or class, a function
    without a module (made by ``exec`` in a bare namespace: the stdlib would name it as
    ``__main__``'s). Our picklers' ``reducer_override`` asks this of every object that is
    not a plain builtin value (functions, classes, instances: an instance's class is
    pickled as well), so a value that needs cloudpickle is known without scanning the
    pickle's bytes."""
    try:
        module = getattr(obj, "__module__", None)
        if module == "__main__" or (module is None and type(obj) is types.FunctionType):
            return True
        q = getattr(obj, "__qualname__", None)
        return type(q) is str and ("<lambda>" in q or "<locals>" in q)
    except Exception:  # noqa: BLE001 - an odd __getattr__: let the pickler decide
        return False


class _Pickler(pickle.Pickler):
    """The stdlib pickler (protocol 5), noting `refers_by_value` as it goes; one per
    thread, reused (`dumps`)."""

    def __init__(self) -> None:
        self._out = io.BytesIO()
        super().__init__(self._out, protocol=5, buffer_callback=self._buffer)
        self.buffers: list[pickle.PickleBuffer] = []
        self.by_value = False
        self.busy = False

    def _buffer(self, buf: pickle.PickleBuffer) -> None:
        self.buffers.append(buf)

    def reducer_override(self, obj: Any) -> Any:
        tt = tensor_types()
        if tt is not None and type(obj) is tt[0]:
            # Out of band, over a snapshot: the loop writes it later, while its owner
            # may change the tensor (`palatine.wire.oob`).
            return reduce_tensor(obj, False, snapshot=True)
        if not self.by_value and refers_by_value(obj):
            self.by_value = True
        return NotImplemented

    def pickle(self, value: Any) -> bytes:
        """``value``'s pickle; `buffers` and `by_value` describe it afterwards."""
        out = self._out
        self.buffers = []
        self.by_value = False
        self.busy = True
        try:
            self.dump(value)
            return out.getvalue()
        finally:
            try:
                self.clear_memo()  # the memo and the output would keep the value alive
                out.seek(0)
                out.truncate()
            finally:
                # Only now: clearing the memo may run a finalizer that pickles too, and
                # it must get a pickler of its own (`dumps`), not this half-cleared one.
                self.busy = False


_LARGE_PICKLE: Final = 1 << 20  # a pickler that produced more is not kept (its buffer)
_picklers = threading.local()


def dumps(value: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``value`` (protocol 5), returning the bytes and out-of-band buffers: the
    stdlib pickler, or cloudpickle for a value that `refers_by_value` (or that the stdlib
    pickler refuses)."""
    value = big_bytes(value)  # (a big bytes out of band, as it is: it cannot change)
    p: _Pickler | None = getattr(_picklers, "p", None)
    if p is None or p.busy:  # (busy: a value's own reduction is pickling something)
        p = _picklers.p = _Pickler()
    try:
        data = p.pickle(value)
        by_value = p.by_value
    except (pickle.PicklingError, AttributeError, TypeError):
        by_value = True
    buffers = p.buffers
    p.buffers = []
    if by_value:
        import cloudpickle

        buffers = []
        data = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    if len(data) > _LARGE_PICKLE:
        _picklers.p = None
    return data, buffers


def loads(data: bytes | memoryview, buffers: list[Any] | None = None) -> Any:
    """Unpickle a value produced by `dumps` (only ever from authenticated peers)."""
    return pickle.loads(data, buffers=buffers or ())


def _decoder_for(type_id: int) -> msgspec.msgpack.Decoder[Any]:
    cls = _TYPES.get(type_id)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        raise TypeError(f"unknown message type id {type_id:#x}")
    dec = _DECODERS[type_id] = msgspec.msgpack.Decoder(cls, ext_hook=_ext_hook)
    return dec


def decode_payload(env: Envelope) -> Any:
    """Decode an envelope's payload by its encoding and ``type_id``.

    Out-of-band buffer references in a msgpack payload become `pickle.PickleBuffer`
    objects over ``env.buffers`` (no copy).
    """
    if env.encoding == ENC_PICKLE:
        return loads(env.data, env.buffers)
    if env.encoding == ENC_MSGPACK:
        dec = _DECODERS.get(env.type_id)
        if dec is None:
            dec = _decoder_for(env.type_id)
        buffers = env.buffers
        if not buffers:
            return dec.decode(env.data)
        _tls.buffers = buffers
        try:
            return dec.decode(env.data)
        finally:
            _tls.buffers = None
    raise TypeError(f"unknown payload encoding {env.encoding}")


_json = msgspec.json.Encoder()


def display(env: Envelope) -> str:
    """``<sender> > <dest>: <TypeName><payload>`` plus ``: delivery error: e1; e2``."""
    name = type_name_of(env.type_id)
    if env.encoding == ENC_MSGPACK:
        try:
            body = _json.encode(decode_payload(env)).decode()
        except (msgspec.DecodeError, TypeError, msgspec.ValidationError):
            body = f"<undecodable {len(env.data)} bytes>"
    else:
        body = f"<pickled {len(env.data)} bytes>"
    text = f"{env.sender} > {env.dest}: {name}{body}"
    if env.errors:
        text += ": delivery error: " + "; ".join(env.errors)
    return text
