"""The web dashboard of a job: one page per job, served by palatine's own loop.

`Dashboard` (server) reads the system's snapshots into a `JobView` (view) and serves the
page (page) and its JSON over a tiny HTTP/1.1 handler on asyncio streams (http), on
loopback and behind a token by default. ``palatine dashboard`` starts one.
"""

from palatine.system.dashboard.server import Dashboard
from palatine.system.dashboard.view import JobView

__all__ = ["Dashboard", "JobView"]
