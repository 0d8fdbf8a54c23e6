"""What a pickle of ours sends out of band: dense torch tensors and big bytes, as raw
memory, never through torch.save and never copied into the pickle itself.

torch pickles a tensor by saving its storage into bytes (``torch.save``), a copy on each
side and a third when the bytes are framed. `reduce_tensor` reduces a strided tensor to
``(rebuild_tensor, (buffer, dtype, shape, requires_grad))`` with the buffer a
`pickle.PickleBuffer`, which a protocol-5 pickler hands out of band: the channel writes
it as it is, and the receiver rebuilds the tensor over the received memory
(`rebuild_tensor`), without a copy. The worker's values and every value the wire codec
pickles (actor calls and results) go this way.

What the buffer is depends on what may happen to the tensor while it is being sent:

* its own memory, when the sender will not write it meanwhile (`memory_of`);
* a snapshot in pooled memory, copied once from any device and layout, when the value
  is sent later from the event loop while its owner goes on (a fetch; ``detach``);
* its own memory again under an `InPlace`, whose owner waits until the channel has let
  go of every buffer before it goes on.

`bytes` are immutable: a big one (`BIG_BYTES`) goes out of band over its own memory,
and a receiver that read it into a `bytes` of its own (a big frame's ``bytes``
buffer: `palatine.wire.frames`) hands that very object to the value (`bytes_of`); a
smaller frame's is copied once. (A ``bytearray`` goes out of band by itself.) Picklers never ask
``reducer_override`` about a `bytes`, so a value that is one is wrapped first
(`big_bytes`); a big `bytes` inside a container is pickled inline.

torch is never imported here: there can be no tensor to reduce before it is.
"""

from __future__ import annotations

import ctypes
import pickle
import sys
import threading
import weakref
from typing import Any, Final

from palatine.wire.buffers import take_buffer

__all__ = [
    "BIG_BYTES",
    "BigBytes",
    "InPlace",
    "big_bytes",
    "bytes_of",
    "memory_of",
    "rebuild_tensor",
    "reduce_tensor",
    "tensor_types",
]

BIG_BYTES: Final = 64 * 1024
"""From this size a `bytes` object goes out of band (smaller ones cost less inline)."""

_tensor_types: tuple[Any, Any] | None = None


def tensor_types() -> tuple[Any, Any] | None:
    """``(torch.Tensor, torch.nn.Parameter)`` once torch is imported (no tensors can
    exist before that), else None."""
    global _tensor_types
    if _tensor_types is None:
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "Tensor") and hasattr(torch, "nn"):
            _tensor_types = (torch.Tensor, torch.nn.Parameter)
    return _tensor_types


def rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """Unpickle side of `reduce_tensor`: a tensor over (a private copy of) ``buf``."""
    import torch

    dt = getattr(torch, dtype.removeprefix("torch."))
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        mv = memoryview(buf)
        # A read-only buffer (bytes off the wire) is copied once: torch tensors are
        # writable, and sharing the receive buffer would alias user data.
        data: Any = bytearray(mv) if mv.readonly else mv
        t = torch.frombuffer(data, dtype=dt).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


def reduce_tensor(
    t: Any,
    detach: bool,
    private: set[int] | None = None,
    sent: object | None = None,
    *,
    snapshot: bool = False,
) -> Any:
    """Reduce a dense tensor to ``(rebuild, (raw buffer, dtype, shape, grad))``, or
    ``NotImplemented`` to let torch pickle it (sparse, quantized, non-CPU...).

    ``detach`` (a fetch): the buffer is a snapshot in pooled memory, copied once from
    any device and layout, and its `pickle.PickleBuffer`'s id is added to ``private``;
    but with ``sent`` (`InPlace`), a contiguous CPU tensor goes from its own memory: the
    buffer keeps the tensor and ``sent`` alive, so that ``sent`` dies when the last
    buffer is let go. Otherwise only CPU tensors are reduced, over their own memory, or
    over a snapshot with ``snapshot`` (a value the event loop sends later); with
    ``snapshot``, a view (which torch pickles sharing its base's storage with any other
    view of it in the value), a non-contiguous tensor (an expanded one would grow) and a
    tensor with attributes of its own are left to torch, which keeps all of that.
    """
    import torch

    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented
    if snapshot and (t._base is not None or not t.is_contiguous() or t.__dict__):
        return NotImplemented
    requires_grad = bool(t.requires_grad)
    if detach or requires_grad:
        if requires_grad and not detach and not t.is_leaf:
            return NotImplemented  # torch refuses this too; keep its error
        t = t.detach()
        requires_grad = requires_grad and not detach
    if detach:
        t = t.resolve_conj().resolve_neg()
        shape = tuple(t.shape)
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return (rebuild_tensor, (b"", str(t.dtype), shape, False))
        if sent is not None and t.device.type == "cpu" and t.is_contiguous():
            buf = memory_of(t, nbytes, sent)  # its sender waits until it is let go
        else:
            # A fetched value is sent later, from the event loop, while the stream goes
            # on running commands: its buffer must be a snapshot, not the user's memory.
            buf = _snapshot(t, shape, nbytes)
        if private is not None:
            private.add(id(buf))
        return (rebuild_tensor, (buf, str(t.dtype), shape, False))
    if t.device.type != "cpu":
        return NotImplemented
    t = t.resolve_conj().resolve_neg().contiguous()
    shape = tuple(t.shape)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return (rebuild_tensor, (b"", str(t.dtype), shape, requires_grad))
    buf = _snapshot(t, shape, nbytes) if snapshot else memory_of(t, nbytes)
    return (rebuild_tensor, (buf, str(t.dtype), shape, requires_grad))


def _snapshot(t: Any, shape: tuple[int, ...], nbytes: int) -> pickle.PickleBuffer:
    """A copy of ``t`` (any device and layout) in pooled memory, as one buffer."""
    import torch

    view = take_buffer(nbytes)
    torch.frombuffer(view, dtype=t.dtype).view(shape).copy_(t)
    return pickle.PickleBuffer(view)


def memory_of(t: Any, nbytes: int, sent: object | None = None) -> pickle.PickleBuffer:
    """A buffer over a contiguous CPU tensor's own memory, keeping the tensor (and
    ``sent``, `InPlace`'s token) alive for as long as the buffer lives."""
    raw: Any = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    raw._palatine_keep = t  # the memory must outlive the buffer
    raw._palatine_sent = sent
    return pickle.PickleBuffer(raw)


class InPlace:
    """Tensors of a fetched value sent from their own memory, and when they are let go.

    A snapshot of a big value costs a copy of it, held until it is sent. Instead, while
    the stream that owns the value waits, so that nothing it runs can write the memory
    meanwhile, the value's contiguous CPU tensors can go from their own memory. Each of
    their buffers holds a token; `wait` returns once the channel has let go of every
    one (the receiver acknowledged the message, or it was given up as undeliverable).
    """

    __slots__ = ("_done", "_ref", "token")

    def __init__(self) -> None:
        self._done = threading.Event()
        token = _SentToken()
        self._ref = weakref.ref(token, lambda _r: self._done.set())
        self.token: object | None = token

    def wait(self, timeout_s: float) -> bool:
        """Drop our own hold and wait until the buffers are let go; False on timeout."""
        self.token = None
        return self._done.wait(timeout_s)


class _SentToken:
    """What each in-place buffer holds: it dies with the last of them."""

    __slots__ = ("__weakref__",)


class BigBytes:
    """A big `bytes` to pickle out of band: it unpickles as the `bytes` itself."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[pickle.PickleBuffer]]:
        return (bytes_of, (pickle.PickleBuffer(self.data),))


def bytes_of(buf: Any) -> bytes:
    """Unpickle side of `BigBytes`: the `bytes` the buffer is, when it is one whole (the
    channel received it into a `bytes` of its own, or it never left this process), else
    a copy of the buffer."""
    raw = buf.raw() if isinstance(buf, pickle.PickleBuffer) else memoryview(buf)
    obj = raw.obj
    if type(obj) is bytes and len(obj) == raw.nbytes:
        return obj
    return bytes(raw)


def big_bytes(value: Any) -> Any:
    """``value``, or a `BigBytes` of it when it is a `bytes` of at least `BIG_BYTES`."""
    if type(value) is bytes and len(value) >= BIG_BYTES:
        return BigBytes(value)
    return value
