"""GPU utilization and memory through NVML, read-only, for each batch result.

NVML is only read: clocks, power limits and MIG layout are never touched.
The GPU is found by UUID (CUDA_VISIBLE_DEVICES may name a GPU or a MIG
instance by index or UUID, and NVML's indices need not match CUDA's).
Readings are cached for a short interval: NVML itself averages utilization
over about 1/6 s, and a read costs tens of microseconds.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger("berth.engine")

# How long one reading is reused: shorter than NVML's own sampling period.
REFRESH_S = 0.1


class GpuStats:
    """Utilization (percent, -1 when NVML cannot say) and memory of one GPU."""

    def __init__(self, nvml: Any, handle: Any, name: str) -> None:
        self._nvml = nvml
        self._handle = handle
        self.name = name
        self._at = -1.0
        self._last = (-1.0, 0)

    def sample(self) -> tuple[float, int]:
        """(utilization percent, device memory used in bytes), cached."""
        now = time.monotonic()
        if now - self._at < REFRESH_S:
            return self._last
        try:
            used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        except self._nvml.NVMLError:
            used = 0
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            utilization = float(rates.gpu)
        except self._nvml.NVMLError:  # MIG instances report no utilization
            utilization = -1.0
        self._at, self._last = now, (utilization, used)
        return self._last


def open_gpu_stats(device: str) -> GpuStats | None:
    """A reader for ``device`` ("cuda:N"), or None on the CPU or without NVML."""
    if not device.startswith("cuda"):
        return None
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        index = torch.device(device).index or 0
        handle = _handle(pynvml, index, torch.cuda.get_device_properties(index))
        name = pynvml.nvmlDeviceGetName(handle)
    except Exception as exc:  # NVML and CUDA raise many kinds
        log.warning("GPU utilization unavailable on %s: %s", device, exc)
        return None
    log.info("reading utilization and memory of %s (%s) through NVML", device, name)
    return GpuStats(pynvml, handle, str(name))


def _handle(nvml: Any, index: int, props: Any) -> Any:
    """NVML's handle for CUDA device ``index``: by the UUID CUDA_VISIBLE_DEVICES
    names, else by the UUID CUDA reports, else (one GPU, no UUID) by index."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index].startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(visible[index])
    uuid = str(getattr(props, "uuid", ""))
    for candidate in (f"GPU-{uuid}", f"MIG-{uuid}", uuid) if uuid else ():
        try:
            return nvml.nvmlDeviceGetHandleByUUID(candidate)
        except nvml.NVMLError:
            continue
    if index < len(visible) and visible[index].isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(visible[index]))
    return nvml.nvmlDeviceGetHandleByIndex(index)
