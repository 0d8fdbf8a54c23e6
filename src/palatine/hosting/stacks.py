"""Stack dumps: in-process, by faulthandler on SIGUSR1, and from outside with py-spy.

Three things are asked of a stuck proc:

* `dump_threads` answers ``StackDump`` for the calling proc: every Python thread's stack,
  with names, innermost frame last. It runs on the caller's thread, so a proc answers
  only while its loop is responsive.
* `register_faulthandler`, called by every worker proc (``palatine worker``), makes ``kill -USR1 <pid>``
  write all threads' stacks to ``PALATINE_STACK_FILE`` (or stderr). faulthandler writes
  from a C signal handler, so this works while the loop is blocked in pure Python, in
  ``time.sleep`` or in most C calls.
* `dump_external`, used by a host for one of its children, runs ``py-spy dump`` when
  py-spy is available and otherwise signals the child and reads the stack file once it
  has stopped growing.

A child that has not registered faulthandler would be *killed* by SIGUSR1 (its default
action), so `dump_external` checks the child's caught-signal mask in ``/proc`` first and
refuses to signal a process that does not catch SIGUSR1.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import TextIO

from palatine import config
from palatine.errors import StackDumpError
from palatine.hosting.child_env import Handoff

__all__ = [
    "PYSPY_VAR",
    "STACK_FILE_VAR",
    "StackDumpError",
    "dump_external",
    "dump_threads",
    "find_pyspy",
    "register_faulthandler",
]

log = logging.getLogger(__name__)

#: The variable naming a proc's stack-dump file (set by hosts).
STACK_FILE_VAR = Handoff.variable("stack_file")
#: The variable naming the py-spy executable.
PYSPY_VAR = "PALATINE_PYSPY"

#: The stack file counts as complete once its size has not changed for this long.
_STABLE_S = 0.1
_POLL_S = 0.01

_registered_file: TextIO | None = None


# --------------------------------------------------------------------------- in-process


def dump_threads() -> str:
    """Every Python thread's stack, with thread names, innermost frame last.

    Threads appear main thread first, then by name. Each block reads
    ``Thread <ident> "<name>"[ (daemon)] (most recent call last):`` followed by
    ``traceback``-style frame lines.
    """
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate() if t.ident is not None}
    main_ident = threading.main_thread().ident

    def order(ident: int) -> tuple[int, str, int]:
        thread = threads.get(ident)
        name = thread.name if thread is not None else ""
        return (0 if ident == main_ident else 1, name, ident)

    blocks: list[str] = []
    for ident in sorted(frames, key=order):
        thread = threads.get(ident)
        name = thread.name if thread is not None else "<unknown>"
        daemon = " (daemon)" if thread is not None and thread.daemon else ""
        header = f'Thread {ident:#x} "{name}"{daemon} (most recent call last):\n'
        blocks.append(header + "".join(traceback.format_stack(frames[ident])))
    del frames
    return "\n".join(blocks)


def register_faulthandler(stack_file: str | os.PathLike[str] | None = None) -> Path | None:
    """Make SIGUSR1 dump every thread's stack, to the stack file or else to stderr.

    ``stack_file`` defaults to ``PALATINE_STACK_FILE``. The file is opened for appending,
    so readers can take what a dump added after a known offset. Returns the file's path,
    or ``None`` when dumps go to stderr. Calling it again replaces the registration.
    """
    global _registered_file
    path_text = os.fspath(stack_file) if stack_file is not None else os.environ.get(STACK_FILE_VAR)
    new_file: TextIO | None = None
    path: Path | None = None
    if path_text:
        path = Path(path_text)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            new_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open on purpose)
        except OSError as e:
            log.warning("cannot open stack file %s (%s); stack dumps go to stderr", path, e)
            path = None
    target: TextIO | int = new_file if new_file is not None else _stderr_target()
    faulthandler.register(signal.SIGUSR1, file=target, all_threads=True, chain=False)
    old, _registered_file = _registered_file, new_file
    if old is not None:
        with contextlib.suppress(OSError):
            old.close()
    return path


def _stderr_target() -> TextIO | int:
    """A stderr faulthandler can write to (pytest and friends replace ``sys.stderr``)."""
    for stream in (sys.stderr, sys.__stderr__):
        if stream is None:
            continue
        try:
            stream.fileno()
        except (OSError, ValueError, AttributeError):
            continue
        return stream
    return 2


# --------------------------------------------------------------------------- external


def find_pyspy() -> str | None:
    """The py-spy executable: ``PALATINE_PYSPY`` if set, else ``py-spy`` on PATH, else ``None``."""
    configured = (config.get().pyspy or "").strip()
    if configured:
        found = shutil.which(configured)
        if found is None:
            log.warning("%s=%s is not an executable; not using py-spy", PYSPY_VAR, configured)
        return found
    return shutil.which("py-spy")


async def dump_external(
    pid: int,
    stack_file: str | os.PathLike[str] | None,
    native: bool = False,
    timeout_s: float | None = None,
    *,
    use_pyspy: bool = True,
) -> tuple[str, str]:
    """Dump the stacks of process ``pid`` from outside; returns ``(method, text)``.

    Python's stacks come from ``faulthandler`` (SIGUSR1 to the process, ``stack_file``
    read once its size has been stable for 100 ms), in Python's own format whether or
    not py-spy is installed; ``py-spy dump --pid P`` answers when that fails. ``native``
    frames need py-spy (``--native``), which is then tried first, faulthandler after it
    (it may lack ptrace permission). ``use_pyspy`` False: faulthandler only. The whole
    call is bounded by ``timeout_s`` (default ``stack_dump_timeout``, 10 s). Both methods
    work while the target's event loop is blocked. Raises `StackDumpError`.
    """
    timeout = config.get().stack_dump_timeout_s if timeout_s is None else timeout_s
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    problems: list[str] = []
    exe = find_pyspy() if use_pyspy else None

    async def pyspy() -> str | None:
        if exe is None:
            return None
        try:
            return await _pyspy_dump(exe, pid, native, deadline - loop.time())
        except StackDumpError as e:
            log.info("py-spy dump of pid %d failed (%s)", pid, e)
            problems.append(str(e))
            return None

    async def faulthandler() -> str | None:
        if stack_file is None:
            problems.append(f"pid {pid} has no stack file ({STACK_FILE_VAR} unset)")
            return None
        remaining = deadline - loop.time()
        if remaining <= 0:
            problems.append("no time left for a faulthandler dump")
            return None
        try:
            return await _faulthandler_dump(pid, Path(stack_file), remaining)
        except StackDumpError as e:
            problems.append(str(e))
            return None

    order = (("py-spy", pyspy), ("faulthandler", faulthandler))
    for method, dump in order if native else order[::-1]:
        text = await dump()
        if text is not None:
            return method, text
    raise StackDumpError("; ".join(problems) or f"no way to dump the stacks of pid {pid}")


async def _pyspy_dump(exe: str, pid: int, native: bool, timeout_s: float) -> str:
    args = [exe, "dump", "--pid", str(pid)]
    if native:
        args.append("--native")
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        raise StackDumpError(f"cannot run py-spy ({exe}): {e.strerror or e}") from None
    try:
        async with asyncio.timeout(max(timeout_s, 0.0)):
            out, err = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await proc.wait()
        raise StackDumpError(f"py-spy did not finish within {timeout_s:.3g} s") from None
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    if proc.returncode != 0:
        detail = (err or out).decode("utf-8", "replace").strip().splitlines()
        last = detail[-1] if detail else "no output"
        raise StackDumpError(f"py-spy exited with code {proc.returncode}: {last}")
    return out.decode("utf-8", "replace")


def _signal_status(pid: int, signum: int) -> tuple[str | None, bool | None]:
    """``(state letter, catches signum)`` from ``/proc/<pid>/status``; ``None`` when unknown."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None, None
    state: str | None = None
    caught: bool | None = None
    for line in text.splitlines():
        if line.startswith("State:"):
            parts = line.split()
            state = parts[1] if len(parts) > 1 else None
        elif line.startswith("SigCgt:"):
            try:
                mask = int(line.split()[1], 16)
            except (IndexError, ValueError):
                continue
            caught = bool(mask & (1 << (signum - 1)))
    return state, caught


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


async def _faulthandler_dump(pid: int, stack_file: Path, timeout_s: float) -> str:
    state, caught = _signal_status(pid, signal.SIGUSR1)
    if state in ("Z", "X"):
        raise StackDumpError(f"process {pid} has exited")
    if caught is False or (caught is None and not stack_file.exists()):  # noqa: ASYNC240 - one stat
        raise StackDumpError(
            f"process {pid} does not handle SIGUSR1 (faulthandler not registered); "
            "not signalling it, as SIGUSR1 would kill it"
        )
    offset = _size(stack_file)
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        raise StackDumpError(f"process {pid} is not running") from None
    except PermissionError as e:
        raise StackDumpError(f"cannot signal process {pid}: {e.strerror}") from None
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            last_size = offset
            changed_at = loop.time()
            while True:
                await asyncio.sleep(_POLL_S)
                size = _size(stack_file)
                now = loop.time()
                if size != last_size:
                    last_size, changed_at = size, now
                elif size > offset and now - changed_at >= _STABLE_S:
                    break
    except TimeoutError:
        raise StackDumpError(
            f"no stack dump from process {pid} in {stack_file} within {timeout_s:.3g} s"
        ) from None
    with open(stack_file, "rb") as f:  # noqa: ASYNC230 (a few KiB, already on disk)
        f.seek(offset)
        data = f.read(last_size - offset)
    return data.decode("utf-8", "replace")
