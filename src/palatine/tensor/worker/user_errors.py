"""What a worker says about a user error: the exception's type, message, pickled form,
and its traceback with palatine's frames removed and the source lines of functions
shipped by value (`register_sources`) shown even where their files do not exist."""

from __future__ import annotations

import linecache
import os
import pickle
import threading
import traceback
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_EXCEPTION_BYTES",
    "PALATINE_DIR",
    "is_palatine_frame",
    "format_user_traceback",
    "pickle_exception",
    "qualified_type_name",
    "register_sources",
    "user_error_fields",
]

MAX_EXCEPTION_BYTES = 1024 * 1024
"""A user exception is shipped pickled only when it pickles within this size."""

#: palatine's own source tree: frames in it are the runtime's, not the user's.
PALATINE_DIR = str(Path(__file__).resolve().parents[2]) + os.sep  # .../palatine/


def is_palatine_frame(filename: str) -> bool:
    """Whether a frame's file is part of palatine (left out of what users are shown)."""
    return os.path.abspath(filename).startswith(PALATINE_DIR)


_sources: dict[str, list[str]] = {}
_sources_lock = threading.Lock()


def register_sources(sources: dict[str, str]) -> None:
    """Make ``sources`` (file name → text) visible to `linecache` (and keep them).

    Entries get no mtime, so ``linecache.checkcache`` keeps them even when the file
    does not exist on this host; `format_user_traceback` re-installs them if something
    cleared the cache.
    """
    with _sources_lock:
        for name, text in sources.items():
            lines = text.splitlines(keepends=True)
            if lines and not lines[-1].endswith("\n"):
                lines[-1] += "\n"
            _sources[name] = lines
            linecache.cache[name] = (len(text), None, lines, name)


def _ensure_sources(names: set[str]) -> None:
    with _sources_lock:
        for name in names:
            lines = _sources.get(name)
            if lines is not None and name not in linecache.cache:
                linecache.cache[name] = (sum(map(len, lines)), None, lines, name)


def qualified_type_name(cls: type[Any]) -> str:
    """``module.qualname`` of a type, ``builtins.`` included (``builtins.ValueError``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _strip(te: traceback.TracebackException, seen: set[int]) -> None:
    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not is_palatine_frame(f.filename)]
    )
    for nxt in (te.__cause__, te.__context__):
        if nxt is not None:
            _strip(nxt, seen)


def _frame_files(exc: BaseException) -> set[str]:
    names: set[str] = set()
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            names.add(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return names


def format_user_traceback(exc: BaseException) -> str:
    """The formatted traceback of a user error, palatine's own frames removed.

    Source lines of shipped files (`register_sources`) are shown even when the file
    does not exist on this host.
    """
    if _sources:
        _ensure_sources(_frame_files(exc))
    te = traceback.TracebackException.from_exception(exc)
    _strip(te, set())
    return "".join(te.format())


def pickle_exception(exc: BaseException) -> bytes | None:
    """``exc`` pickled when it pickles (and unpickles) within 1 MiB, else None."""
    try:
        data = pickle.dumps(exc, protocol=5)
    except Exception:  # noqa: BLE001 - try the slower pickler next
        try:
            import cloudpickle

            data = cloudpickle.dumps(exc, protocol=5)
        except Exception:  # noqa: BLE001 - unpicklable: text only
            return None
    if len(data) > MAX_EXCEPTION_BYTES:
        return None
    try:
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - would fail at the client too
        return None
    return data


def user_error_fields(exc: BaseException) -> dict[str, Any]:
    """``exc_type``, ``message``, ``traceback`` and ``exception`` of a `WorkerError`."""
    return {
        "exc_type": qualified_type_name(type(exc)),
        "message": str(exc),
        "traceback": format_user_traceback(exc),
        "exception": pickle_exception(exc),
    }
