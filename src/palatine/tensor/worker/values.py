"""Values on the worker wire: refs as persistent ids, tensors out of band, functions.

Both ends of the tensor-worker protocol use this module, and it imports neither torch
nor anything above the wire layer, so the client may import it freely:

* **Client side.** `dumps_args` / `dumps_value` pickle user values (protocol 5) and turn
  every client handle — any object with an int ``__palatine_ref__`` (remote values,
  device meshes, process-group handles) — into the persistent id
  ``("ref", n)``. `function_ref` names a function by import path when it can, and
  otherwise ships it with cloudpickle (`pickle_function`) together with the source text
  of its file, so worker tracebacks show source lines. `loads_value` reads back what a
  worker fetched.
* **Worker side.** `load_args` unpickles a command's ``(args, kwargs)`` mapping each
  ``("ref", n)`` through a lookup supplied by the stream; `dumps_fetched` pickles a
  fetched value after moving every tensor to CPU (``detach().cpu()``); `FunctionCache`
  resolves `FunctionPath` / `Cloudpickle` (per path / per digest); what a user error
  becomes is `palatine.tensor.worker.user_errors`.
* `SeqError` is what a stream's refs table holds for a value whose computation failed:
  the *root* failed seq and its `WorkerError`.

Dense CPU tensors are pickled as one raw out-of-band buffer plus dtype and shape (no
numpy needed); anything else uses torch's own pickling. Pickled values only ever come
from authenticated peers (the channel handshake), as everywhere in palatine.

A fetched value's buffers are private snapshots in pooled memory
(`palatine.wire.buffers`), each a `pickle.PickleBuffer`, so the worker's reply carries
them out of band and later commands cannot change what is sent; argument buffers are
plain memoryviews, which msgpack inlines.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import linecache
import logging
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

from palatine.protocol.worker import Cloudpickle, FunctionPath, FunctionRef, Pickled, WorkerError
from palatine.tensor.worker.user_errors import qualified_type_name, register_sources
from palatine.wire.buffers import take_buffer
from palatine.wire.codec import refers_by_value
from palatine.wire.oob import BigBytes, InPlace, big_bytes, reduce_tensor, tensor_types

__all__ = [
    "MAX_SOURCE_BYTES",
    "REF_TAG",
    "TEST_PANIC_PATH",
    "FunctionCache",
    "ResolvedFunction",
    "SeqError",
    "dumps_args",
    "dumps_fetched",
    "dumps_value",
    "function_label",
    "function_ref",
    "import_torch",
    "load_args",
    "load_value",
    "loads_value",
    "pickle_function",
    "ref_of",
]

log = logging.getLogger(__name__)

REF_TAG = "ref"
"""First item of the persistent id ``("ref", n)`` that stands for a client handle."""

TEST_PANIC_PATH = "__test_panic"
"""Reserved function path: calling it fails the worker actor."""

MAX_SOURCE_BYTES = 1024 * 1024
"""Source files larger than this are not shipped with a cloudpickled function."""


class SeqError:
    """A failed value in a stream's refs table: the root failed ``seq`` and its error.

    Dependents of a failed value carry the *root's* `SeqError` unchanged, so the
    controller (and the user) always see the invocation that actually failed.
    """

    __slots__ = ("error", "seq")

    def __init__(self, seq: int, error: WorkerError) -> None:
        self.seq = seq
        self.error = error

    def text(self) -> str:
        """One line for humans: ``s5 failed on rank 1 (f): ZeroDivisionError: ...``."""
        e = self.error
        return f"s{self.seq} failed on rank {e.rank} ({e.function}): {e.exc_type}: {e.message}"

    def __repr__(self) -> str:
        return f"SeqError({self.text()!r})"


# --------------------------------------------------------------------------- client side


def ref_of(obj: Any) -> int | None:
    """The ref number of a client handle (an int ``__palatine_ref__``), else None."""
    if type(obj) in _PLAIN:
        return None
    ref = getattr(obj, "__palatine_ref__", None)
    return ref if type(ref) is int else None


_PLAIN = frozenset({int, float, str, bytes, bool, type(None), tuple, list, dict, set, complex})


def _persistent_ref(obj: Any) -> tuple[str, int] | None:
    ref = ref_of(obj)
    return None if ref is None else (REF_TAG, ref)


def _override(obj: Any, detach: bool, private: set[int], sent: object | None = None) -> Any:
    t = type(obj)
    if t is BigBytes:
        reduced = obj.__reduce_ex__(5)
        private.add(id(reduced[1][0]))  # immutable: it needs no snapshot
        return reduced
    tt = tensor_types()
    if tt is not None and (t is tt[0] or (detach and t is tt[1])):
        return reduce_tensor(obj, detach, private, sent)  # a fetched Parameter arrives as its data
    return NotImplemented


OnRef = Callable[[Any], None]


def _persistent(obj: Any, refs: bool, on_ref: OnRef | None) -> Any:
    if not refs:
        return None
    pid = _persistent_ref(obj)
    if pid is not None and on_ref is not None:
        on_ref(obj)
    return pid


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler: handles → ``("ref", n)``, dense tensors out of band."""

    def __init__(
        self, file: Any, buffer_callback: Any, refs: bool, detach: bool, on_ref: OnRef | None = None
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._refs = refs
        self._detach = detach
        self._on_ref = on_ref
        self.private: set[int] = set()  # ids of buffers that are snapshots already
        self.by_value = False  # met something only cloudpickle can ship (`refers_by_value`)
        self.sent: object | None = None  # tensors go from their own memory (`InPlace`)

    def persistent_id(self, obj: Any) -> Any:
        return _persistent(obj, self._refs, self._on_ref)

    def reducer_override(self, obj: Any) -> Any:
        if not self.by_value and refers_by_value(obj):
            self.by_value = True
        return _override(obj, self._detach, self.private, self.sent)


_cloud_pickler: type[Any] | None = None


def _cloud_pickler_type() -> type[Any]:
    """The cloudpickle variant of `_Pickler` (built once; cloudpickle imported lazily)."""
    global _cloud_pickler
    if _cloud_pickler is None:
        import cloudpickle

        class _CloudPickler(cloudpickle.CloudPickler):  # type: ignore[misc]
            def __init__(
                self,
                file: Any,
                buffer_callback: Any,
                refs: bool,
                detach: bool,
                on_ref: OnRef | None = None,
            ) -> None:
                super().__init__(file, protocol=5, buffer_callback=buffer_callback)
                self._refs = refs
                self._detach = detach
                self._on_ref = on_ref
                self.private: set[int] = set()
                self.sent: object | None = None

            def persistent_id(self, obj: Any) -> Any:
                return _persistent(obj, self._refs, self._on_ref)

            def reducer_override(self, obj: Any) -> Any:
                r = _override(obj, self._detach, self.private, self.sent)
                if r is NotImplemented:
                    return super().reducer_override(obj)
                return r

        _cloud_pickler = _CloudPickler
    return _cloud_pickler


def _dumps(
    value: Any, refs: bool, detach: bool, on_ref: OnRef | None = None, sent: object | None = None
) -> Pickled:
    """Pickle with the stdlib pickler, falling back to cloudpickle (as `codec.dumps`).

    ``on_ref(handle)`` is called for every client handle met (it may raise to refuse it).
    With ``sent`` (`InPlace`), tensors go from their own memory.
    """
    bufs: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    data: bytes | None
    seen: list[Any] = []
    pickler: Any = _Pickler(f, bufs.append, refs, detach, seen.append)
    pickler.sent = sent
    try:
        pickler.dump(value)
        data = f.getvalue()
    except (pickle.PicklingError, AttributeError, TypeError):
        data = None
    if data is None or pickler.by_value or _by_value(data):
        bufs = []
        seen = []
        f = io.BytesIO()
        pickler = _cloud_pickler_type()(f, bufs.append, refs, detach, seen.append)
        pickler.sent = sent
        pickler.dump(value)
        data = f.getvalue()
    if on_ref is not None:
        for h in seen:
            on_ref(h)
    if not detach:
        # Views of user memory: msgpack copies them inline whenever the message is
        # encoded, and never sends them out of band (only PickleBuffers go there).
        return Pickled(data, [b.raw() for b in bufs])
    # A fetched value travels out of band (`encode_message_oob`: written later, from the
    # event loop), so every buffer must be a private snapshot: tensors are already;
    # anything else (arrays) is copied here, once.
    private = pickler.private
    for i, b in enumerate(bufs):
        if id(b) not in private:
            raw = b.raw()
            copy = take_buffer(raw.nbytes)
            copy[:] = raw
            bufs[i] = pickle.PickleBuffer(copy)
    return Pickled(data, bufs)


def dumps_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], on_ref: OnRef | None = None
) -> Pickled:
    """The one pickle of a command's ``(args, kwargs)``, handles as persistent ids."""
    return _dumps((tuple(args), dict(kwargs)), refs=True, detach=False, on_ref=on_ref)


def _by_value(data: bytes) -> bool:
    """Whether the pickle names a module registered with cloudpickle to go by value."""
    import cloudpickle

    mods = cloudpickle.list_registry_pickle_by_value()
    return bool(mods) and any(m.encode() in data for m in mods)


def dumps_value(value: Any) -> Pickled:
    """Pickle one user value for a worker (``SetRefUnitTestsOnly``), handles as ids."""
    return _dumps(value, refs=True, detach=False)


def loads_value(p: Pickled) -> Any:
    """Unpickle a value a worker sent (``FetchResult``, ``RefValue``): no refs inside."""
    return pickle.loads(p.data, buffers=p.buffers)


def function_ref(fn: Callable[..., Any] | str) -> FunctionRef:
    """How to name ``fn`` in a command: a path string or an importable module-level
    function becomes `FunctionPath`; anything else (``__main__``, closures, lambdas)
    is shipped by value with `pickle_function`."""
    if isinstance(fn, str):
        return FunctionPath(fn)
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if type(fn).__name__ == "OpOverload":
        op: Any = fn
        return FunctionPath(f"torch.ops.{op.namespace}.{op._opname}.{op._overloadname}")
    if (
        isinstance(module, str)
        and isinstance(qualname, str)
        and module != "__main__"
        and "<" not in qualname
        and not _registered_by_value(module)
    ):
        obj: Any = sys.modules.get(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is fn:
            return FunctionPath(f"{module}.{qualname}")
    return pickle_function(fn)


def _registered_by_value(module: str) -> bool:
    if "cloudpickle" not in sys.modules:
        return False
    import cloudpickle

    return module in cloudpickle.list_registry_pickle_by_value()


def _code_files(fn: Any) -> list[str]:
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: its __call__ method
        call = type(fn).__dict__.get("__call__")
        code = getattr(call, "__code__", None)
    files: list[str] = []
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        if c.co_filename not in files:
            files.append(c.co_filename)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_filename"))
    return files


def pickle_function(fn: Callable[..., Any]) -> Cloudpickle:
    """``fn`` by value (cloudpickle) plus the source text of its file(s), ≤ 1 MiB each."""
    import cloudpickle

    sources: dict[str, str] = {}
    for path in _code_files(fn):
        lines = linecache.getlines(path)
        text = "".join(lines)
        if lines and len(text.encode()) <= MAX_SOURCE_BYTES:
            sources[path] = text
    return Cloudpickle(cloudpickle.dumps(fn, protocol=5), sources)


# --------------------------------------------------------------------------- worker side


class _ArgUnpickler(pickle.Unpickler):
    """Maps ``("ref", n)`` through the stream's lookup while unpickling."""

    def __init__(self, data: bytes, buffers: list[Any], lookup: Callable[[int], Any]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._lookup = lookup

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is tuple and len(pid) == 2 and pid[0] == REF_TAG and type(pid[1]) is int:
            return self._lookup(pid[1])
        raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")


def load_args(p: Pickled, lookup: Callable[[int], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Unpickle a command's ``(args, kwargs)``, each ref replaced by ``lookup(n)``.

    ``lookup`` is called in pickle order, which is argument order; it raises for a
    missing ref (a user error) and may return a `SeqError` placeholder.
    """
    obj = _ArgUnpickler(p.data, p.buffers, lookup).load()
    if not (type(obj) is tuple and len(obj) == 2):
        raise TypeError(f"command arguments must pickle (args, kwargs), got {type(obj).__name__}")
    args, kwargs = obj
    if not isinstance(args, tuple | list) or not isinstance(kwargs, dict):
        raise TypeError(
            f"command arguments must pickle (args, kwargs), got "
            f"({type(args).__name__}, {type(kwargs).__name__})"
        )
    return tuple(args), kwargs


def load_value(p: Pickled, lookup: Callable[[int], Any]) -> Any:
    """Unpickle one value (``SetRefUnitTestsOnly``), each ref replaced by ``lookup(n)``."""
    return _ArgUnpickler(p.data, p.buffers, lookup).load()


def dumps_fetched(value: Any, in_place: InPlace | None = None) -> Pickled:
    """Pickle a fetched value: every tensor detached and copied to CPU, every buffer a
    private snapshot (one copy, into pooled memory); but with ``in_place``, contiguous
    CPU tensors go from their own memory (the caller then waits, `InPlace.wait`).

    Raises ``TypeError("cannot pickle a value of type T for fetch: ...")`` when the
    value does not pickle (a user error).
    """
    try:
        sent = in_place.token if in_place is not None else None
        return _dumps(big_bytes(value), refs=False, detach=True, sent=sent)
    except Exception as e:
        tname = qualified_type_name(type(value))
        raise TypeError(
            f"cannot pickle a value of type {tname} for fetch: {type(e).__name__}: {e}"
        ) from e


class ResolvedFunction:
    """A resolved callable and the label shown in errors and progress reports."""

    __slots__ = ("fn", "label")

    def __init__(self, fn: Callable[..., Any], label: str) -> None:
        self.fn = fn
        self.label = label


def function_label(fn: Any) -> str:
    """``module.qualname`` (just ``qualname`` for ``__main__``), for humans."""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if qual is None:
        return type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    if not module or module == "__main__":
        return str(qual)
    return f"{module}.{qual}"


def import_torch() -> Any:
    """``torch`` if it is installed, else None (cached by Python's import system)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _import_longest_prefix(parts: list[str]) -> tuple[Any, int]:
    """Import the longest importable module prefix of ``parts``; (module, its length)."""
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            return importlib.import_module(name), i
        except ModuleNotFoundError as e:
            missing = e.name
            # Only "this prefix does not exist" moves on; a module that exists but
            # fails to import one of *its* dependencies is a real error.
            if missing is not None and (name == missing or name.startswith(missing + ".")):
                continue
            raise
    raise ModuleNotFoundError(f"no module named {parts[0]!r}", name=parts[0])


class FunctionCache:
    """Resolves command functions, caching by path and by cloudpickle digest.

    Failures raise ``ImportError("failed to resolve function <path>: ...")`` (or, for a
    ``torch.*`` path without torch, ``ModuleNotFoundError("torch is not installed on
    worker rank R")``) and are not cached. One cache serves every stream of a process;
    a racing double resolution is harmless.
    """

    def __init__(self) -> None:
        self._paths: dict[str, ResolvedFunction] = {}
        self._blobs: dict[bytes, ResolvedFunction] = {}

    def resolve(self, ref: FunctionRef, rank: int) -> ResolvedFunction:
        if type(ref) is FunctionPath:
            hit = self._paths.get(ref.path)
            if hit is None:
                hit = self._paths[ref.path] = self._resolve_path(ref.path, rank)
            return hit
        if type(ref) is Cloudpickle:
            key = hashlib.blake2b(ref.data, digest_size=16).digest()
            got = self._blobs.get(key)
            if got is None:
                got = self._blobs[key] = self._resolve_blob(ref)
            return got
        raise TypeError(f"not a function reference: {type(ref).__name__}")

    def _resolve_path(self, path: str, rank: int) -> ResolvedFunction:
        parts = path.split(".")
        if parts[0] == "torch" and import_torch() is None:
            raise ModuleNotFoundError(f"torch is not installed on worker rank {rank}", name="torch")
        try:
            if not all(p.isidentifier() for p in parts):
                raise ValueError("not a dotted import path")
            obj, n = _import_longest_prefix(parts)
            for attr in parts[n:]:
                obj = getattr(obj, attr)
            impl = getattr(obj, "_remote_impl", None)
            if impl is not None:
                obj = impl
            if not callable(obj):
                raise TypeError(f"{type(obj).__name__} object is not callable")
        except Exception as e:
            raise ImportError(f"failed to resolve function {path}: {type(e).__name__}: {e}") from e
        return ResolvedFunction(obj, path)

    def _resolve_blob(self, ref: Cloudpickle) -> ResolvedFunction:
        if ref.sources:
            register_sources(ref.sources)
        try:
            fn = pickle.loads(ref.data)
            if not callable(fn):
                raise TypeError(f"{type(fn).__name__} object is not callable")
        except Exception as e:
            raise ImportError(
                f"failed to resolve function <cloudpickled function>: {type(e).__name__}: {e}"
            ) from e
        if ref.sources:
            _restore_filename(fn, ref.sources)
        impl = getattr(fn, "_remote_impl", None)
        return ResolvedFunction(impl if impl is not None else fn, function_label(fn))


_DYNAMIC_CODE = "<dynamic-code>"


def _with_filename(code: types.CodeType, name: str) -> types.CodeType:
    consts = tuple(
        _with_filename(c, name) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=name, co_consts=consts)


def _restore_filename(fn: Any, sources: dict[str, str]) -> None:
    """Give a cloudpickled function its client file name back.

    cloudpickle (≥ 3.1) replaces ``co_filename`` with ``<dynamic-code>``, which would
    hide the shipped source lines from tracebacks. The file is the one shipped source
    whose line ``co_firstlineno`` defines this function.
    """
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType) or code.co_filename != _DYNAMIC_CODE:
        return
    name = "lambda" if code.co_name == "<lambda>" else code.co_name
    n = code.co_firstlineno
    matches = []
    for path, text in sources.items():
        # co_firstlineno is the first decorator's line for a decorated function.
        window = text.splitlines()[max(n - 1, 0) : n + 10]
        if any(name in line for line in window):
            matches.append(path)
    if len(sources) == 1 and not matches:
        matches = list(sources)
    if len(matches) == 1:
        try:
            fn.__code__ = _with_filename(code, matches[0])
        except (TypeError, ValueError, AttributeError) as e:
            log.debug("cannot restore the file name of %r: %s", fn, e)
