"""The backend interface, and start-up that picks the first backend that works.

A backend owns loaded models on one device and runs padded batches on them:
token ids int32 [B, L] (padded with 0) and lengths int32 [B] in, float32
[B, width] out. Backends are imported lazily, so a missing optional
dependency (onnxruntime, tensorrt…) only skips that backend.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Mapping
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np

from services.repository import ModelEntry

log = logging.getLogger("berth.engine")

# name -> "module:Class"; a class is built as Class(device=device).
# "torch" is eager on the CPU and CUDA graphs + pinned I/O on a GPU;
# "torch-eager" is plain eager torch on either.
BACKENDS: dict[str, str] = {
    "torch": "engine.cuda.backend:torch_backend",
    "torch-cuda": "engine.cuda.backend:CudaBackend",
    "torch-eager": "engine.torch_backend:TorchBackend",
    "onnxruntime": "engine.onnx_backend:OnnxRuntimeBackend",
    "tensorrt": "engine.tensorrt_backend:TensorRTBackend",
}
# The order "auto" tries them in.
PREFERENCE: tuple[str, ...] = ("torch",)


class BackendError(RuntimeError):
    """No backend could be started, or a backend was asked for a bad thing."""


@runtime_checkable
class Backend(Protocol):
    """What the engine worker needs from an inference backend."""

    name: str  # "torch"
    device: str  # "cpu", "cuda:0"

    def load(self, entry: ModelEntry) -> None:
        """Load ``entry`` so that ``run(entry.name, …)`` works."""
        ...

    def width(self, model: str) -> int:
        """Columns of ``run``'s output: hidden size, or number of labels."""
        ...

    def run(self, model: str, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """int32 [B, L] ids padded with 0, int32 [B] lengths -> float32 [B, width]."""
        ...

    def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
        """Prepare each (batch, length) shape (CUDA graphs); may do nothing."""
        ...


def create_backend(name: str, device: str) -> Backend:
    """The backend ``name`` on ``device``; ``name="auto"`` tries each in turn.

    Every backend that cannot start is logged with its reason; when none
    starts, the error lists them all.
    """
    candidates = list(PREFERENCE) if name == "auto" else [name]
    reasons = []
    for candidate in candidates:
        target = BACKENDS.get(candidate)
        if target is None:
            reasons.append(f"{candidate}: unknown (known: {', '.join(BACKENDS)})")
            continue
        module_name, _, class_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            backend: Backend = cls(device=device)
        except (ImportError, RuntimeError, ValueError) as exc:
            log.warning("backend %s on %s skipped: %s", candidate, device, exc)
            reasons.append(f"{candidate}: {exc}")
            continue
        log.info("backend %s started on %s", backend.name, backend.device)
        return backend
    raise BackendError(
        f"no backend could start on {device!r} ({'; '.join(reasons)}); "
        "change the model's backend or the engine's device to one that works here"
    )


Loaded = TypeVar("Loaded")


def loaded(models: Mapping[str, Loaded], name: str, backend: str) -> Loaded:
    """A backend's loaded model by name; the error lists what is loaded."""
    try:
        return models[name]
    except KeyError:
        raise BackendError(
            f"model {name!r} is not loaded on backend {backend} "
            f"(loaded: {sorted(models)})"
        ) from None


def warm_up_eagerly(
    backend: Backend, model: str, shapes: list[tuple[int, int]], min_length: int = 1
) -> None:
    """Run one all-padding batch of each (batch, length) shape, and log how long."""
    start = time.perf_counter()
    for batch, length in shapes:
        length = max(length, min_length)
        ids = np.zeros((batch, length), dtype=np.int32)
        backend.run(model, ids, np.full(batch, length, dtype=np.int32))
    log.info(
        "model %s warmed up on %d shapes in %.2f s",
        model,
        len(shapes),
        time.perf_counter() - start,
    )
