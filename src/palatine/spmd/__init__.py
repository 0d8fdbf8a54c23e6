"""Torchrun-style programs on palatine meshes: the torch elastic environment on every
proc (`setup_torch_elastic_env`), a program run as ``__main__`` on every rank
(`SPMDActor`), and the launcher behind ``palatine torchrun`` (`palatine.spmd.launcher`).
"""

from __future__ import annotations

from palatine.spmd.actor import RankExited, SPMDActor
from palatine.spmd.env import elastic_env
from palatine.spmd.script import ScriptFailed
from palatine.spmd.setup import setup_torch_elastic_env

__all__ = ["RankExited", "SPMDActor", "ScriptFailed", "elastic_env", "setup_torch_elastic_env"]
