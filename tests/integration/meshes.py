"""The one local mesh a test module shares: ``mesh = module_mesh(hosts, procs)``.

Each module that tests mesh tensors on real workers starts one local mesh for all its
tests (start-up takes seconds) and shuts it down after the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import palatine


def module_mesh(hosts: int, procs: int, **options: Any) -> Callable[[], Iterator[Any]]:
    """A module-scoped ``mesh`` fixture: a ``palatine.local_mesh(hosts, procs)``."""

    def mesh() -> Iterator[Any]:
        m = palatine.local_mesh(hosts=hosts, procs_per_host=procs, startup_timeout_s=90, **options)
        try:
            yield m
        finally:
            m.shutdown()

    return pytest.fixture(scope="module", name="mesh")(mesh)
