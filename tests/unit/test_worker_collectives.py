"""Worker collectives without a process group: backend choice, reduce header codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from palatine import config
from palatine.tensor.worker.collectives import _choose_backend


def info(host: str, kind: str, uuid: str = "") -> list[str]:
    return [host, kind, uuid]


@pytest.mark.parametrize(
    ("infos", "backend"),
    [
        ([info("a", "cpu"), info("a", "cpu")], "gloo"),
        ([info("a", "cuda", "GPU-1"), info("a", "cuda", "GPU-2")], "nccl"),
        ([info("a", "cuda", "GPU-1"), info("b", "cuda", "GPU-1")], "nccl"),  # same uuid, other host
        ([info("a", "cuda", "GPU-1"), info("a", "cuda", "GPU-1")], "gloo"),  # two ranks, one GPU
        ([info("a", "cuda", "GPU-1"), info("a", "cpu")], "gloo"),  # one rank on CPU
        ([info("a", "cuda", "GPU-1")], "nccl"),
    ],
)
def test_nccl_iff_every_rank_has_a_gpu_of_its_own(
    infos: list[list[str]], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PALATINE_COLLECTIVE_BACKEND", raising=False)
    assert _choose_backend(infos) == backend


def test_palatine_collective_backend_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    with config.override(collective_backend="gloo"):
        assert _choose_backend([info("a", "cuda", "GPU-1"), info("a", "cuda", "GPU-2")]) == "gloo"


def test_reduce_header_codes_are_the_same_in_every_process() -> None:
    """Ranks compare header codes; a dtype outside the listed ones must get one code
    everywhere, whatever the process's string-hash salt."""
    pytest.importorskip("torch")
    code = (
        "import torch\n"
        "from palatine.tensor.worker import reduce\n"
        "for dt in (torch.uint16, torch.uint32, torch.float32):\n"
        "    h = reduce._header(torch, reduce._OK, 0, torch.zeros(2, dtype=dt), 'cpu')\n"
        "    print(int(h[2]))\n"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(seen) == 1, seen
    uint16, uint32, float32 = map(int, seen.pop().split())
    assert float32 < 100 <= min(uint16, uint32) and uint16 != uint32
