"""``mesh.activate()``: the active mesh, and torch factories on it once torch is loaded.

Activation sets the active mesh (`palatine.tensor.client.context`), which remote calls
and collectives run on. When the program has imported torch, it also turns on
`palatine.tensor.client.factories.FactoryMode`, so ``torch.zeros(...)`` in the block
makes a mesh tensor. A program that never imports torch never pays for loading it: the
factories module (which imports torch) is loaded on the first activation after torch
was.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import TypeVar

from palatine.tensor.client.context import activated
from palatine.tensor.client.values import ValueMesh

__all__ = ["activate"]

M = TypeVar("M", bound=ValueMesh)


@contextlib.contextmanager
def activate(mesh: M) -> Iterator[M]:
    """Make ``mesh`` the active mesh for the block, factories included (see the module)."""
    with activated(mesh):
        if "torch" not in sys.modules:
            yield mesh
            return
        factories = importlib.import_module("palatine.tensor.client.factories")
        with factories.factory_mode(mesh):
            yield mesh
