"""Real-process clusters for tests: `RoleProcess` (lives in `palatine.tensor.client.procs`)."""

from __future__ import annotations

from palatine.tensor.client.procs import RoleProcess, palatine_cmd

__all__ = ["RoleProcess", "palatine_cmd"]
