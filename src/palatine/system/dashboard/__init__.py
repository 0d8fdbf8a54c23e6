"""The web dashboard of a job: one page per job, served by palatine's own loop.

`Dashboard` (server) reads the system's snapshots into a `JobView` (view) and serves the
page (page) and its JSON over a tiny HTTP/1.1 handler on asyncio streams (http), on
loopback and behind a token by default. ``palatine dashboard`` starts one; a launcher
(``local_mesh(dashboard=True)``) runs that command with `role_args`.
"""

from __future__ import annotations

import os

from palatine.system.dashboard.server import Dashboard
from palatine.system.dashboard.view import JobView

__all__ = ["Dashboard", "JobView", "role_args"]


def role_args(system_addr: str, log_dir: str | os.PathLike[str], addr: str | None) -> list[str]:
    """The ``palatine dashboard`` arguments a launcher starts it with, as a role: its link
    comes back as the ready line's ``addr``. ``addr`` ``HOST:PORT`` (None: loopback, a free
    port)."""
    return ["dashboard", "--system-addr", str(system_addr), "--log-dir", str(log_dir),
            "--addr", addr or "127.0.0.1:0", "--ready-line"]  # fmt: skip
