"""The torch backend: eager PyTorch on one device (CPU, or a GPU without graphs).

A CUDA variant subclasses :class:`TorchBackend` and overrides the three
steps of ``run`` (copy in, forward, copy out) for pinned buffers and graphs.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from engine import settings as engine_settings
from engine.backend import loaded, warm_up_eagerly
from engine.model import ServedModel, load_served_model
from engine.validate import BadBatch, check_ids
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")


def default_threads() -> int:
    """CPUs this process may run on (container-aware), or BERTH_TORCH_THREADS."""
    configured = engine_settings.current().torch_threads
    if configured:
        return configured
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_device(device: str) -> torch.device:
    """Resolve "auto" (a GPU when there is one, else cpu) and bare "cuda"."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} asked for, but CUDA is unavailable")
        if torch_device.index is None:
            torch_device = torch.device("cuda", torch.cuda.current_device())
    elif torch_device.type != "cpu":
        raise ValueError(f"device {device!r} is not supported; use cpu, cuda[:N], auto")
    return torch_device


class TorchBackend:
    """Runs served models with eager PyTorch under inference mode on one device."""

    name = "torch"

    def __init__(
        self,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        threads: int | None = None,
    ) -> None:
        torch_device = resolve_device(device)
        self.device = str(torch_device)
        self.torch_device = torch_device
        self.dtype = dtype
        if torch_device.type == "cpu":
            wanted = threads or default_threads()
            if torch.get_num_threads() != wanted:
                torch.set_num_threads(wanted)
            log.info("torch on cpu with %d threads", torch.get_num_threads())
        self._models: dict[str, ServedModel] = {}

    # The interface.

    def load(self, entry: ModelEntry) -> None:
        log.info(
            "loading model %s on torch %s as %s", entry.name, self.device, self.dtype
        )
        model = load_served_model(entry, self.torch_device, self.dtype)
        if entry.quantize != "none":
            from engine.build.quantize import quantize_for_entry

            log.info("quantizing %s to %s (calibrating)", entry.name, entry.quantize)
            quantize_for_entry(model, entry, self.torch_device)
        self._models[entry.name] = model

    def width(self, model: str) -> int:
        return self.model(model).width

    def run(self, model: str, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        served = self.model(model)
        check_batch(token_ids, lengths)
        check_ids(token_ids, served.encoder.config.table_rows)
        if self.torch_device.type == "cpu" and lengths.size:
            # Eager CPU has no fixed shapes to keep: compute only up to the
            # longest row, not the bucket's padded length.
            longest = max(int(lengths.max()), 1)
            token_ids = token_ids[:, :longest]
        with torch.inference_mode():
            ids, lens = self.copy_in(token_ids), self.copy_in(lengths)
            out = self.forward(served, ids, lens)
            return self.copy_out(out)

    def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
        warm_up_eagerly(self, model, shapes)

    # The steps a subclass may replace.

    def model(self, name: str) -> ServedModel:
        return loaded(self._models, name, self.name)

    def copy_in(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor; shares memory on the CPU (no copy)."""
        if not array.flags.writeable:
            # torch.from_numpy warns on read-only arrays (np.frombuffer(bytes));
            # ids are small, so one copy is cheaper than a warnings filter.
            array = array.copy()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(self.torch_device, non_blocking=True)

    def forward(
        self, served: ServedModel, ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        return served(ids, lengths)

    def copy_out(self, out: torch.Tensor) -> np.ndarray:
        return out.to("cpu", torch.float32).numpy()


def check_batch(token_ids: np.ndarray, lengths: np.ndarray) -> None:
    """Shapes, dtypes and lengths of one batch: cheap (never the token ids);
    BadBatch (a ValueError) names what is wrong."""
    if token_ids.ndim != 2 or lengths.shape != token_ids.shape[:1]:
        raise BadBatch(
            f"need token_ids [B, L] and lengths [B], got {token_ids.shape} and "
            f"{lengths.shape}"
        )
    for what, array in (("token_ids", token_ids), ("lengths", lengths)):
        if array.dtype not in (np.int32, np.int64):
            raise BadBatch(f"{what} must be int32 (or int64), got {array.dtype}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > token_ids.shape[1]):
        raise BadBatch(
            f"lengths must lie in [0, {token_ids.shape[1]}], got {lengths.min()} "
            f"to {lengths.max()}"
        )
