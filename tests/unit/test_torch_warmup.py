"""`palatine.tensor.worker.torch_warmup`: the first ``import torch`` reads torch's libraries through.

Run in a fresh interpreter each (torch must not be imported yet), with a thread that
ticks every 10 ms during the import: the finder must run once, step aside, and the
import must still produce the real module.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)


def run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_first_import_reads_the_libraries_then_steps_aside() -> None:
    out = run(
        """
        import sys
        from palatine.tensor.worker import torch_warmup
        seen = []
        orig = torch_warmup.read_through
        torch_warmup.read_through = lambda paths: seen.append(len(paths)) or orig(paths)
        root = torch_warmup.torch_dir()
        assert root is not None and root.endswith("torch")
        assert torch_warmup.install() is True
        assert torch_warmup.install() is True  # idempotent: still one finder
        n = sum(type(f).__name__ == "_TorchWarmup" for f in sys.meta_path)
        import torch
        import torch.nn
        print(n, len(seen), seen[0] > 0, type(f).__name__ if (f := sys.meta_path[0]) else "",
              torch.ones(2).sum().item())
        """
    )
    n, calls, some, first, total = out.split()
    assert (n, calls, some, total) == ("1", "1", "True", "2.0")
    assert first != "_TorchWarmup"  # removed after the first import


def test_nothing_is_installed_once_torch_is_imported() -> None:
    out = run(
        """
        import sys, torch
        from palatine.tensor.worker import torch_warmup
        print(torch_warmup.install(), any(type(f).__name__ == "_TorchWarmup" for f in sys.meta_path))
        """
    )
    assert out == "False False"
