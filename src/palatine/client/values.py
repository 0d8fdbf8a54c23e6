"""Client-side values: `RemoteValue`, issue sites, argument pickling, function transport.

Arguments are pickled once per command (protocol 5, out-of-band buffers); every client
handle inside them (a remote value, a device mesh, a process group) becomes the
persistent id ``("ref", n)`` that the worker maps back (40-worker-client.md §1.3). The
refs met while pickling are the call's ``uses``.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle

from palatine.worker.messages import Cloudpickle, FunctionPath, FunctionRef, Pickled

if TYPE_CHECKING:
    from palatine.client.mesh import DeviceMesh, Stream
    from palatine.client.session import Session

__all__ = ["RemoteValue", "Handle", "IssueSite", "pickle_args", "function_ref", "capture_site"]

_PALATINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CAPTURE = os.environ.get("PALATINE_CLIENT_TRACEBACKS", "1") != "0"


class IssueSite:
    """Where a call was issued: up to 10 user frames (file, line, function)."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[tuple[str, int, str]]) -> None:
        self.frames = frames

    def format(self) -> str:
        out = []
        for filename, lineno, name in self.frames:
            out.append(f'  File "{filename}", line {lineno}, in {name}')
            line = linecache.getline(filename, lineno).strip()
            if line:
                out.append(f"    {line}")
        return "\n".join(out)

    def short(self) -> str:
        if not self.frames:
            return "?"
        filename, lineno, _ = self.frames[-1]
        return f"{os.path.basename(filename)}:{lineno}"


def capture_site() -> IssueSite | None:
    """The caller's stack without palatine frames (None when capture is off)."""
    if not _CAPTURE:
        return None
    frames: list[tuple[str, int, str]] = []
    f = sys._getframe(1)
    while f is not None and len(frames) < 10:
        filename = f.f_code.co_filename
        if not os.path.abspath(filename).startswith(_PALATINE_DIR):
            frames.append((filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back  # type: ignore[assignment]
    frames.reverse()
    return IssueSite(frames)


class Handle:
    """Anything the worker knows by a ref: remote values, device meshes, process groups."""

    __slots__ = ("session", "ref", "__weakref__")

    def __init__(self, session: Session, ref: int) -> None:
        self.session = session
        self.ref = ref


class RemoteValue(Handle):
    """A value living on the workers of ``mesh`` (one per rank), on ``stream``."""

    __slots__ = ("mesh", "stream", "seq", "label", "dropped_at")

    def __init__(self, session: Session, ref: int, mesh: DeviceMesh, stream: Stream, seq: int, label: str) -> None:
        super().__init__(session, ref)
        self.mesh = mesh
        self.stream = stream
        self.seq = seq
        self.label = label
        self.dropped_at: IssueSite | None = None

    def __repr__(self) -> str:
        ranks = self.mesh.ranks
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"
        return (
            f"<RemoteValue r{self.ref} on {self.session.worker_world}[{span}] stream "
            f"{self.stream.name} from s{self.seq} {self.label}>"
        )

    def drop(self) -> None:
        """Free the worker-side value now (later use raises `TypeError`)."""
        if self.dropped_at is None:
            self.dropped_at = capture_site() or IssueSite([])
            self.session.drop_later(self.ref, self.mesh.slice_spec)

    def __del__(self) -> None:
        try:
            if self.dropped_at is None and not self.session.closed:
                self.session.drop_later(self.ref, self.mesh.slice_spec)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def reduce(self, dims: str | tuple[str, ...], op: str = "sum", scatter: bool = False,
               in_place: bool = False, out: RemoteValue | None = None, like: Any = None) -> RemoteValue:
        """A collective over ``dims`` of this value's mesh (40-worker-client.md §2.8)."""
        from palatine.client.collectives import reduce

        return reduce(self, dims, op, scatter, in_place, out, like)


class _ArgPickler(cloudpickle.CloudPickler):
    """cloudpickle with client handles replaced by persistent ids ``("ref", n)``."""

    def __init__(self, file: io.BytesIO, check: Callable[[Handle], None], buffers: list[pickle.PickleBuffer]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self.check = check
        self.refs: list[int] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Handle):
            self.check(obj)
            self.refs.append(obj.ref)
            return ("ref", obj.ref)
        return None


def pickle_args(args: Any, check: Callable[[Handle], None]) -> tuple[Pickled, list[int]]:
    """One pickle of ``args`` with handles as persistent ids; returns it and the refs used."""
    buf = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    p = _ArgPickler(buf, check, buffers)
    p.dump(args)
    raw = [bytes(b.raw()) for b in buffers]
    return Pickled(data=buf.getvalue(), buffers=raw), p.refs


def function_ref(fn: Any) -> tuple[FunctionRef, str]:
    """How a function travels (path when importable by name, else cloudpickle) and its label."""
    if isinstance(fn, str):
        return FunctionPath(path=fn), fn
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    overload = type(fn).__name__ == "OpOverload"
    if overload:
        return FunctionPath(path=f"torch.ops.{fn.namespace}.{fn._opname}.{fn._overloadname}"), str(fn)
    by_value = module in cloudpickle.list_registry_pickle_by_value() if module else False
    if module and module != "__main__" and "<" not in name and not by_value:
        try:
            mod = sys.modules.get(module)
            target: Any = mod
            for part in name.split("."):
                target = getattr(target, part)
            if target is fn:
                path = f"{module}.{name}"
                if module.startswith("torch._C"):
                    path = f"torch.{name}"
                return FunctionPath(path=path), f"{module}.{name}"
        except AttributeError:
            pass
    data = cloudpickle.dumps(fn, protocol=5)
    sources: dict[str, str] = {}
    code = getattr(fn, "__code__", None)
    if code is not None:
        filename = code.co_filename
        try:
            if os.path.getsize(filename) <= 1 << 20:
                with open(filename, encoding="utf-8", errors="replace") as fh:
                    sources[filename] = fh.read()
        except OSError:
            pass
    label = name if module in (None, "__main__") else f"{module}.{name}"
    return Cloudpickle(data=data, sources=sources), label


def format_exc_short(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
