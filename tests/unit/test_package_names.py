"""The names ``palatine`` offers: every public name resolves, and the submodules that
live deeper in the tree import by their short names, without loading torch first."""

from __future__ import annotations

import subprocess
import sys

import palatine


def test_every_public_name_resolves() -> None:
    for name in palatine.__all__:
        assert getattr(palatine, name) is not None, name


def test_submodules_import_by_their_short_names_in_a_fresh_interpreter() -> None:
    code = (
        "import sys\n"
        "from palatine.metrics import counter\n"
        "import palatine.random as r\n"
        "from palatine.random import set_manual_seed_remote\n"
        "print(counter.__module__, r.__name__, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == [
        "palatine.hosting.user_metrics",
        "palatine.tensor.client.random",
        "False",
    ]
