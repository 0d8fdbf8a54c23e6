"""What a proc's heartbeats say it uses (palatine.hosting.resources): read at most once
a second from one kept psutil.Process, GPU figures only where NVML loads."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

from palatine.hosting.resources import ResourceSampler


def test_cpu_comes_from_the_second_reading_and_rss_from_the_first() -> None:
    s = ResourceSampler(min_interval_s=0.0)
    first = s.sample(now=1.0)
    assert "cpu_percent" not in first and first["rss_bytes"] > 0
    second = s.sample(now=2.0)
    assert second["cpu_percent"] >= 0 and second["rss_bytes"] > 0


def test_readings_within_the_interval_are_the_last_ones_again() -> None:
    s = ResourceSampler(min_interval_s=1.0)
    s.sample(now=10.0)
    kept = s._proc
    a = s.sample(now=11.0)
    assert s.sample(now=11.5) is a
    assert s.sample(now=12.1) is not a
    assert s._proc is kept  # (one psutil.Process for the proc's life)


def test_a_process_that_is_gone_reports_nothing_and_raises_nothing() -> None:
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert ResourceSampler(pid=p.pid, min_interval_s=0.0).sample(now=1.0) == {}


def test_without_nvml_there_are_no_gpu_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # (an import of it fails)
    s = ResourceSampler(min_interval_s=0.0)
    assert not any(k.startswith("gpu") for k in s.sample(now=1.0))
    assert s._nvml is False  # (never tried again)


def fake_nvml(pid: int) -> Any:
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"  # type: ignore[attr-defined]
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87 if h == "gpu1" else 0)  # type: ignore[attr-defined]
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        types.SimpleNamespace(pid=pid, usedGpuMemory=3 * 2**30),
        types.SimpleNamespace(pid=pid + 1, usedGpuMemory=2**30),
    ]
    return m


def test_with_nvml_the_procs_own_gpu_and_memory_are_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(os.getpid()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    got = ResourceSampler(min_interval_s=0.0).sample(now=1.0)
    assert got["gpu_util_percent"] == 87
    assert got["gpu_mem_bytes"] == 3 * 2**30
