"""Real-process clusters for tests: `RoleProcess` (lives in `palatine.client.procs`)."""

from __future__ import annotations

from palatine.client.procs import RoleProcess, palatine_cmd

__all__ = ["RoleProcess", "palatine_cmd"]
