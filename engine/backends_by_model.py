"""Per-model backend selection: each entry's ``backend`` field picks where it runs.

:func:`create_model_router` starts every backend the served entries name
(once each) and returns a :class:`ModelRouter`, which is itself a
:class:`~engine.backend.Backend`: the engine keeps one object and calls
``load``/``run``/``warmup`` by model name as before. A backend that cannot
start here (``tensorrt`` without TensorRT, ``onnxruntime`` without the
package, a GPU backend on a CPU machine) is logged with its reason, and
its models fall back to the engine's ``--backend``.

An entry's ``backend: "auto"`` (the default) is :func:`preferred_backend`:
torch on a GPU (fp16, fused kernels, CUDA graphs); onnxruntime on the CPU,
where benchmarks/quant_cpu.py measured it 1.9x torch's fp32 forward on the
same texts and benchmarks/e2e.py served 1.02x the offline sentence-
transformers throughput with it (0.81-0.87x with the torch engine); torch
again for ``quantize: "int8"`` on the CPU (its INT8 kept 98.3 % intent
agreement, onnxruntime's 95.5 %).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from engine.backend import Backend, BackendError, create_backend
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")

Factory = Callable[[str, str], Backend]


class ModelRouter:
    """One Backend face over several: each model runs on the backend chosen for it."""

    def __init__(self, backends: Mapping[str, Backend], chosen: Mapping[str, str]):
        self.backends = dict(backends)
        self.chosen = dict(chosen)  # model -> backend name
        names = sorted(set(self.chosen.values()) or self.backends)
        self.name = "+".join(names)
        first = self.backends[names[0]] if names else None
        self.device = first.device if first is not None else "cpu"

    def backend_for(self, model: str) -> Backend:
        try:
            return self.backends[self.chosen[model]]
        except KeyError:
            raise BackendError(
                f"model {model!r} has no backend (served: {sorted(self.chosen)})"
            ) from None

    def load(self, entry: ModelEntry) -> None:
        self.backend_for(entry.name).load(entry)

    def width(self, model: str) -> int:
        return self.backend_for(model).width(model)

    def run(self, model: str, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return self.backend_for(model).run(model, token_ids, lengths)

    def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
        self.backend_for(model).warmup(model, shapes)


def create_model_router(
    entries: Mapping[str, ModelEntry],
    fallback: str,
    device: str,
    factory: Factory = create_backend,
) -> ModelRouter:
    """Start the backends ``entries`` ask for on ``device``; models whose
    backend cannot start use ``fallback`` (the engine's --backend) instead."""
    backends: dict[str, Backend] = {}
    failed: dict[str, str] = {}

    def start(name: str) -> Backend | None:
        if name not in backends and name not in failed:
            try:
                backends[name] = factory(name, device)
            except BackendError as exc:
                failed[name] = str(exc)
        return backends.get(name)

    chosen: dict[str, str] = {}
    for model, entry in entries.items():
        wanted = entry.backend or fallback
        if wanted == "auto":
            wanted = preferred_backend(entry, device)
            log.info("model %s: backend auto is %s on %s", model, wanted, device)
        if start(wanted) is not None:
            chosen[model] = wanted
            continue
        if start(fallback) is None:
            raise BackendError(
                f"model {model}: backend {wanted!r} cannot start ({failed[wanted]}) "
                f"and neither can the fallback {fallback!r} ({failed[fallback]})"
            )
        log.warning(
            "model %s asks for backend %s, which cannot start on %s (%s): "
            "serving it with %s instead",
            model,
            wanted,
            device,
            failed[wanted],
            fallback,
        )
        chosen[model] = fallback
    for model, name in chosen.items():
        log.info("model %s runs on backend %s", model, name)
    return ModelRouter(backends, chosen)


def preferred_backend(entry: ModelEntry, device: str) -> str:
    """What ``backend: "auto"`` runs ``entry`` on for ``device`` (module doc)."""
    if device == "auto":
        import torch

        gpu = torch.cuda.is_available()
    else:
        gpu = device.partition(":")[0] != "cpu"
    if gpu or (entry.quantize or "none") != "none":  # int8 (or a misplaced fp8,
        return "torch"  # which torch refuses with the fix in its message)
    return "onnxruntime"
