"""Running a program as ``python`` would, inside a proc: a script path, ``-m module`` or
``module:function``, with its argv, as ``__main__``; its end as an exit status.

A program ends as a process would: returning (0), ``sys.exit(code)`` (the code: None is 0,
an int is itself, anything else is printed and is 1), or an exception (its traceback
printed to stderr, as Python prints it, and 1). What raised is kept in the result
(`ScriptFailed`), so a launcher can name it.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import threading
import traceback
from types import TracebackType

import msgspec

__all__ = ["ScriptFailed", "describe", "program_stack", "run_program"]


class ScriptFailed(msgspec.Struct, frozen=True):
    """A program that ended with an exception: its type, message and traceback text."""

    type_name: str
    message: str
    traceback: str

    @property
    def first_line(self) -> str:
        """``ValueError: boom``: the line Python ends a traceback with."""
        return f"{self.type_name}: {self.message}" if self.message else self.type_name


def describe(program: list[str]) -> str:
    """What ``program`` runs, for messages (``train.py``, ``-m pkg.train``)."""
    if not program:
        return "<nothing>"
    return f"-m {program[1]}" if program[0] == "-m" and len(program) > 1 else program[0]


def run_program(program: list[str]) -> int | ScriptFailed:
    """Run ``program`` (``["train.py", *args]``, ``["-m", "pkg.train", *args]`` or
    ``["pkg.train:main", *args]``) in this thread as ``__main__``; its exit status: 0,
    the code it exited with, or `ScriptFailed` (its traceback is printed to stderr)."""
    if not program:
        raise ValueError("no program: give a script path, '-m module' or 'module:function'")
    try:
        _run(program)
        return 0
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - whatever the program raised is its exit status
        text = "".join(traceback.format_exception(type(e), e, _program_frames(e.__traceback__)))
        print(text, end="", file=sys.stderr, flush=True)
        return ScriptFailed(type(e).__qualname__, str(e), text)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def _run(program: list[str]) -> None:
    head, rest = program[0], list(program[1:])
    if head == "-m" or (":" in head and not os.path.exists(head)):
        _first_on_path(os.getcwd())  # as `python -m` does
    if head == "-m":
        if not rest:
            raise ValueError("-m needs a module name")
        module, *args = rest
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    if ":" in head and not os.path.exists(head):
        module, _, name = head.partition(":")
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        sys.argv = [head, *rest]
        code = fn()  # type: ignore[operator]
        if code is not None and code != 0:
            raise SystemExit(code)
        return
    path = os.path.abspath(head)
    sys.argv = [head, *rest]
    # As `python script.py` does: the script's directory first on the import path.
    _first_on_path(os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


#: The frames a program runs under (a thread's start, this module, runpy), left out of
#: its tracebacks and stacks as Python leaves its own out for ``python script.py``.
_RUNNER_FILES = {__file__, runpy.__file__, "<frozen runpy>", threading.__file__}


def _program_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the program's own first frame on."""
    while (
        tb is not None
        and tb.tb_next is not None
        and tb.tb_frame.f_code.co_filename in _RUNNER_FILES
    ):
        tb = tb.tb_next
    return tb


def program_stack(thread: threading.Thread, runner_files: tuple[str, ...] = ()) -> str:
    """Where the program on ``thread`` is now (its own frames, outermost first, as a
    traceback shows them); "" when the thread has ended. ``runner_files``: more files
    whose frames precede the program's (the caller's own)."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or not thread.is_alive():
        return ""
    frames = traceback.extract_stack(frame)
    skip = _RUNNER_FILES | set(runner_files)
    while len(frames) > 1 and frames[0].filename in skip:
        frames = traceback.StackSummary.from_list(frames[1:])
    return "".join(frames.format())


def _first_on_path(directory: str) -> None:
    if sys.path[:1] != [directory]:
        sys.path.insert(0, directory)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1
