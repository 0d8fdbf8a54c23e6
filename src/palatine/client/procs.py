"""Role processes started through the CLI (``local_mesh``, tests, benchmarks).

`RoleProcess` starts ``palatine <role> ...`` in its own process group, waits (bounded)
for its JSON ready line, and kills the whole group on `kill`/`close`. Each child also
holds the read end of a *lifeline* pipe (``PALATINE_LIFELINE_FD``): when the launcher
dies, even by SIGKILL, the child reads EOF and stops itself, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["RoleProcess", "palatine_cmd"]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (no orphans)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def palatine_cmd() -> list[str]:
    """How to run the CLI with this interpreter."""
    return [sys.executable, "-m", "palatine"]


class RoleProcess:
    """One ``palatine <role>`` process with its ready line."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 20.0,
        *,
        die_with_parent: bool = True,
        stderr_path: str | None = None,
        wait: bool = True,
    ) -> None:
        self.args = args
        full_env = dict(os.environ)
        full_env.update(env or {})
        lifeline_r, self._lifeline_w = os.pipe()
        full_env["PALATINE_LIFELINE_FD"] = str(lifeline_r)
        err: Any = subprocess.PIPE
        if stderr_path is not None:
            err = open(stderr_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.popen = subprocess.Popen(
                [*palatine_cmd(), *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=full_env,
                start_new_session=True,
                pass_fds=(lifeline_r,),
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        finally:
            os.close(lifeline_r)
            if stderr_path is not None:
                err.close()
        self.ready: dict[str, Any] | None = None
        self._stderr_chunks: list[bytes] = []
        if wait:  # else the caller calls wait_ready (several roles starting at once)
            self.wait_ready(ready_timeout_s)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def addr(self) -> str:
        assert self.ready is not None
        return str(self.ready["addr"])

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Read stdout until the ready line (raise with stderr if it never comes)."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout_s
        buf = b""
        fd = self.popen.stdout.fileno()
        while time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], 0.05)
            self._drain_stderr()
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and obj.get("event") == "ready":
                        self.ready = obj
                        return obj
            elif self.popen.poll() is not None:
                break
        self.kill()
        raise RuntimeError(
            f"palatine {' '.join(self.args)} printed no ready line within {timeout_s} s "
            f"(exit {self.popen.poll()}); stderr:\n{self.stderr()[-4000:]}"
        )

    def _drain_stderr(self) -> None:
        if self.popen.stderr is None:
            return
        fd = self.popen.stderr.fileno()
        while True:
            r, _, _ = select.select([fd], [], [], 0)
            if not r:
                return
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            self._stderr_chunks.append(chunk)

    def stderr(self) -> str:
        self._drain_stderr()
        return b"".join(self._stderr_chunks).decode(errors="replace")

    def signal(self, sig: int) -> None:
        os.kill(self.popen.pid, sig)

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._drain_stderr()
            code = self.popen.poll()
            if code is not None:
                return code
            time.sleep(0.02)
        raise TimeoutError(f"palatine {' '.join(self.args)} did not exit within {timeout_s} s")

    def terminate(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the group; the exit status."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                return self.wait(grace_s)
            except TimeoutError:
                pass
        self.kill()
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group (idempotent)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.cut_lifeline()

    close = kill

    def cut_lifeline(self) -> None:
        """Close the launcher's end of the lifeline (idempotent): the role then stops
        itself, as when the launcher dies."""
        fd, self._lifeline_w = self._lifeline_w, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
