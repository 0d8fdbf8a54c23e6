"""What a proc uses of its machine, as its heartbeats carry it: CPU, memory and GPU.

Each heartbeat of a managed proc carries ``resources`` (`ProcSupervisionState`):
``cpu_percent`` (its use of one core since the previous reading, as ``top`` shows it),
``rss_bytes`` and, where NVML can be loaded (``nvidia-ml-py``, the ``gpu`` extra) and
the proc has a GPU, ``gpu_util_percent`` (the device's) and ``gpu_mem_bytes`` (this
process's memory on it). So ``palatine top`` shows every host's procs, not only the
local machine's.

The cost stays at the floor: one `psutil.Process` kept for the proc's life, read at most
once per `MIN_INTERVAL_S` (a faster beat gets the last reading again), and NVML loaded
once, lazily; if it cannot be (no driver, no library), GPU figures are left out for good.
A failing reading is left out of that beat, never an error of the heartbeat.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Final

__all__ = ["MIN_INTERVAL_S", "ResourceSampler"]

log = logging.getLogger(__name__)

MIN_INTERVAL_S: Final = 1.0
"""A proc's resources are read at most this often (seconds)."""


class ResourceSampler:
    """Readings of one process (this one by default) for its heartbeats."""

    def __init__(self, pid: int | None = None, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.min_interval_s = min_interval_s
        self._proc: Any = None
        self._last: dict[str, float] = {}
        self._at: float | None = None
        self._nvml: Any = None  # the pynvml module once loaded; False: not available
        self._gpu: Any = None  # this proc's device handle

    def sample(self, now: float | None = None) -> dict[str, float]:
        """The current readings (the cached ones within `min_interval_s` of the last)."""
        now = time.monotonic() if now is None else now
        if self._at is not None and now - self._at < self.min_interval_s:
            return self._last
        self._at = now
        out: dict[str, float] = {}
        try:
            import psutil

            if self._proc is None:
                self._proc = psutil.Process(self.pid)
                self._proc.cpu_percent(None)  # (the first reading only starts the interval)
            else:
                out["cpu_percent"] = round(float(self._proc.cpu_percent(None)), 1)
            out["rss_bytes"] = float(self._proc.memory_info().rss)
        except Exception as e:  # noqa: BLE001 - a reading never stops a heartbeat
            log.debug("resources of pid %d: %s", self.pid, e)
        out.update(self._gpu_sample())
        self._last = out
        return out

    def _gpu_sample(self) -> dict[str, float]:
        if self._nvml is False:
            return {}
        try:
            if self._nvml is None:
                self._nvml = False  # (until it has loaded and found a device)
                import pynvml

                pynvml.nvmlInit()
                handle = self._device(pynvml)
                if handle is None:
                    return {}
                self._nvml, self._gpu = pynvml, handle
            nvml, handle = self._nvml, self._gpu
            util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            used = sum(
                float(p.usedGpuMemory or 0)
                for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid == self.pid
            )
            return {"gpu_util_percent": util, "gpu_mem_bytes": used}
        except Exception as e:  # noqa: BLE001 - no NVML, no driver, a device gone: no GPU figures
            log.debug("GPU resources of pid %d: %s", self.pid, e)
            self._nvml = False
            return {}

    @staticmethod
    def _device(nvml: Any) -> Any:
        """The handle of this proc's GPU: the first of ``CUDA_VISIBLE_DEVICES`` (a
        worker keeps one), else device 0; None without a device."""
        if nvml.nvmlDeviceGetCount() < 1:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if visible.startswith("GPU-") or visible.startswith("MIG-"):
            return nvml.nvmlDeviceGetHandleByUUID(visible)
        if visible == "":
            return nvml.nvmlDeviceGetHandleByIndex(0)
        if not visible.isdigit():
            return None  # ("-1", "NoDevFiles": no GPU for this proc)
        return nvml.nvmlDeviceGetHandleByIndex(int(visible))
