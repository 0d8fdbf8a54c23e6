"""Client-side values: `RemoteValue`, issue sites, argument pickling, function transport.

Arguments are pickled once per command (protocol 5, out-of-band buffers); every client
handle inside them (a remote value, a device mesh, a process group) becomes the
persistent id ``("ref", n)`` that the worker maps back (40-worker-client.md §1.3). The
refs met while pickling are the call's ``uses``.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from palatine.worker.messages import FunctionPath, FunctionRef, Pickled
from palatine.worker.values import dumps_args, function_label
from palatine.worker.values import function_ref as worker_function_ref

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


@functools.lru_cache(maxsize=4096)
def _is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PALATINE_DIR)


def capture_site() -> IssueSite | None:
    """The caller's stack without palatine frames (None when capture is off)."""
    if not _CAPTURE:
        return None
    frames: list[tuple[str, int, str]] = []
    f = sys._getframe(1)
    ours = _is_ours
    while f is not None and len(frames) < 10:
        code = f.f_code
        if not ours(code.co_filename):
            frames.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back  # type: ignore[assignment]
    frames.reverse()
    return IssueSite(frames)


class Handle:
    """Anything the worker knows by a ref: remote values, device meshes, process groups."""

    __slots__ = ("session", "ref", "__weakref__")

    def __init__(self, session: Session, ref: int) -> None:
        self.session = session
        self.ref = ref

    @property
    def __palatine_ref__(self) -> int:
        """The ref the worker knows this handle by (pickled as ``("ref", n)``)."""
        return self.ref


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


def pickle_args(args: Any, check: Callable[[Handle], None]) -> tuple[Pickled, list[int]]:
    """One pickle of ``(args, kwargs)`` with handles as refs; returns it and the refs used."""
    refs: list[int] = []

    def on_ref(h: Any) -> None:
        if isinstance(h, Handle):
            check(h)
        refs.append(h.__palatine_ref__)

    a, k = args
    return dumps_args(a, k, on_ref), refs


def function_ref(fn: Any) -> tuple[FunctionRef, str]:
    """How a function travels (path when importable by name, else by value) and its label."""
    if isinstance(fn, str):
        return FunctionPath(path=fn), fn
    return worker_function_ref(fn), function_label(fn)


def format_exc_short(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
