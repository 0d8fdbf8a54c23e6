"""A worker's first ``import torch`` without starving its heartbeat.

Importing torch maps about half a gigabyte of shared libraries, and the interpreter
holds the GIL while the dynamic loader faults them in. With a cold page cache on a slow
disk that took 14 s here, with one 7 s stretch in which no other thread ran: the
heartbeat thread included, so the system could declare a healthy worker dead. CPU
workers import torch lazily, on a stream thread, when a command first needs it.

`install` puts a finder in front of ``sys.meta_path`` that, on that first import only,
reads torch's shared libraries through once before the real import goes on. Reads
release the GIL, so heartbeats continue while the disk works, and the loader then finds
the pages in memory (the longest stall measured drops from 7.3 s to 1.6 s). With a warm
cache the read-through costs about a tenth of the import itself.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final

__all__ = ["install", "torch_dir"]

_CHUNK: Final = 8 << 20


def torch_dir() -> str | None:
    """The directory of the installed ``torch`` package, found without importing or
    consulting import hooks (None if torch is not installed)."""
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "torch")
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            return candidate
    return None


def _shared_libraries(root: str) -> list[str]:
    """torch's shared libraries, without its test and sample libraries (never loaded)."""
    out: list[str] = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if ".so" in name and "test" not in name and "backend_with_compiler" not in name:
                out.append(os.path.join(dirpath, name))
    return sorted(out)


def read_through(paths: Sequence[str]) -> int:
    """Read each file once (the GIL is released during each read); bytes read."""
    buf = bytearray(_CHUNK)
    total = 0
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        except OSError:
            continue  # an unreadable file is the real import's business
    return total


class _TorchWarmup(importlib.abc.MetaPathFinder):
    """On the first ``import torch``: read its libraries through, then step aside."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._lock = threading.Lock()
        self._done = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname != "torch" or self._done:
            return None
        with self._lock:  # a second importer waits here for the read-through
            if not self._done:
                read_through(_shared_libraries(self._root))
                self._done = True
                try:
                    sys.meta_path.remove(self)
                except ValueError:
                    pass
        return None  # the ordinary finders import it


def install() -> bool:
    """Install the finder if torch is installed and not imported yet; whether it was."""
    if "torch" in sys.modules:
        return False
    root = torch_dir()
    if root is None:
        return False
    if not any(isinstance(f, _TorchWarmup) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWarmup(root))
    return True
