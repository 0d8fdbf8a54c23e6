"""Issue sites: where in the user's program a remote call was issued.

A call captures its caller's stack (without palatine's own frames) when it is issued, so
that an error the worker reports later, on another thread, can point at the line that
made the call (`palatine.RemoteException` shows it), and a dropped value can say where
it was dropped. Capture is on unless ``client_tracebacks`` is off.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys

from palatine import config
from palatine.tensor.worker.user_errors import is_palatine_frame

__all__ = ["IssueSite", "capture_site"]


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
    return is_palatine_frame(filename)


def capture_site() -> IssueSite | None:
    """The caller's stack without palatine frames (None when capture is off)."""
    if not config.get().client_tracebacks:
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
