"""The torch backend on a GPU: fp16 weights, fused kernels, a CUDA graph per
bucket shape, and pinned, device-mapped host buffers for the batch bytes.

``create_backend("torch", "cuda:0")`` returns a :class:`CudaBackend`
(:func:`torch_backend` picks by device); ``torch-eager`` keeps plain eager
torch on any device. Its defaults come from engine/settings.py
(``BERTH_CUDA_DTYPE``, ``BERTH_CUDA_INPUT``, ``BERTH_EXACT_GELU``,
``BERTH_PDL``); the constructor's arguments override them. Input modes:
``zero-copy`` (the graph reads the mapped pinned input and writes the mapped
pinned output itself, one graph per slot) or ``staging`` (async copies from
and to the pinned buffers around each replay); benchmarks/engine.py measures
both. Large shapes run packed (no padding token computed,
engine/cuda/graphs.py); ``pack=False`` keeps them padded, for the benchmark's
comparison.

One batch: write the wire bytes into a pinned slot, pad to the next
captured batch size, enqueue (copy in, replay, copy out) on the engine's
stream, wait. Its values are validated before the launch, or, where the
graph's embedding kernel clamps them (unpacked shapes), while it runs; such
shapes in zero-copy mode take the Direct way, their graph handles and output
views looked up once per request shape. ``submit``/``collect`` split that in
two, so a caller may fill the next slot while the GPU runs this one.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine import settings as engine_settings
from engine.backend import Backend
from engine.cuda.runner import WIRE_INT32, ModelRunner, Ticket, Times, collect
from engine.heads import ClsPooling, MeanPooling
from engine.torch_backend import TorchBackend, check_batch, resolve_device
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
INPUT_MODES = ("staging", "zero-copy")
DEFAULT_INPUT = "zero-copy"  # faster end to end: benchmarks/engine.py


def torch_backend(device: str = "auto") -> Backend:
    """The "torch" backend: graphs and pinned I/O on a GPU, eager on the CPU."""
    if resolve_device(device).type == "cuda":
        return CudaBackend(device)
    return TorchBackend(device)


class CudaBackend(TorchBackend):
    """Serves models on one GPU from CUDA graphs fed through pinned buffers."""

    name = "torch-cuda"

    def __init__(
        self,
        device: str = "cuda",
        dtype: torch.dtype | None = None,
        input_mode: str | None = None,
        gelu_epilogue: bool | None = None,
        pack: bool | None = None,
        pdl: bool | None = None,
    ) -> None:
        settings = engine_settings.current()
        super().__init__(device, dtype or DTYPES[settings.cuda_dtype])
        if self.torch_device.type != "cuda":
            raise ValueError(f"{self.name} needs a CUDA device, got {device!r}")
        self.input_mode = input_mode or settings.cuda_input
        if self.input_mode not in INPUT_MODES:
            raise ValueError(
                f"input mode {self.input_mode!r}: use one of {INPUT_MODES}"
            )
        if gelu_epilogue is None:
            gelu_epilogue = not settings.exact_gelu
        self.gelu_epilogue = gelu_epilogue
        self.pack = True if pack is None else pack
        self.pdl = pdl  # None: BERTH_PDL, where the GPU has it (FusedForward)
        torch.cuda.set_device(self.torch_device)
        self.stream = torch.cuda.Stream(self.torch_device)
        self.pool = torch.cuda.graph_pool_handle()
        self._runners: dict[str, ModelRunner] = {}
        props = torch.cuda.get_device_properties(self.torch_device)
        log.info(
            "torch-cuda on %s (%s %s, %d SMs, %.0f GiB): %s weights, %s inputs, "
            "GELU %s",
            self.device,
            props.name,
            getattr(props, "uuid", ""),  # which card, whatever CUDA numbers it
            props.multi_processor_count,
            props.total_memory / 2**30,
            str(self.dtype).removeprefix("torch."),
            self.input_mode,
            "tanh, in the matmul epilogue"
            if gelu_epilogue
            else "exact, after the matmul",
        )

    # The interface.

    def load(self, entry: ModelEntry) -> None:
        super().load(entry)
        served = self.model(entry.name)
        runner = ModelRunner(served, self, self.gelu_epilogue)
        self._runners[entry.name] = runner
        if not isinstance(served.pooling, (MeanPooling, ClsPooling)):
            # FusedForward pools with its kernel for mean and CLS alone; any
            # other pooling is the model's own torch module on the hidden
            # states, and FusedForward.packs is false for it.
            log.info(
                "model %s: pooling %s runs as torch ops in its CUDA graphs, "
                "not a fused kernel; its rows are never packed",
                entry.name,
                entry.pooling,
            )
        log.info(
            "model %s on %s: attention kernels %s (the faster per shape); "
            "dependent launches %s",
            entry.name,
            self.device,
            ", ".join(runner.forward.kinds),
            "on" if runner.forward.pdl else "off",
        )

    def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
        """Capture a graph per shape (largest first); done before SERVING."""
        runner = self.runner(model)
        start = time.perf_counter()
        runner.capture(shapes)
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.empty_cache()  # the eager warm-ups' blocks; graphs keep their pool
        chosen = list(runner.forward.chosen.values())
        preloaded = sum(runner.forward.preloaded.values())
        log.info(
            "model %s: %d CUDA graphs captured for %d shapes (%s inputs, pinned "
            "memory from %s) in %.2f s; %.0f MiB reserved on %s; attention %s; "
            "preloading GEMMs on %d shapes",
            model,
            len(runner.graphs),
            len(set(shapes)),
            self.input_mode,
            runner.ring.slots[0].allocator,
            time.perf_counter() - start,
            torch.cuda.memory_reserved(self.torch_device) / 2**20,
            self.device,
            ", ".join(f"{k} on {chosen.count(k)} shapes" for k in sorted(set(chosen))),
            preloaded,
        )

    def run(self, model: str, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        check_batch(token_ids, lengths)
        rows, length = token_ids.shape
        ticket = self.runner(model).submit(token_ids.reshape(-1), lengths, rows, length)
        output, _ = collect(ticket)
        return output.copy()

    def run_bytes(
        self, model: str, token_ids: bytes, lengths: bytes, batch: int, length: int
    ) -> tuple[np.ndarray, Times]:
        """A batch straight from the wire; the output is a view of a pinned slot,
        valid until that slot is reused (two batches later)."""
        return collect(self.submit(model, token_ids, lengths, batch, length))

    # Pipelining: fill slot n+1 while slot n computes.

    def submit(
        self, model: str, token_ids: bytes, lengths: bytes, batch: int, length: int
    ) -> Ticket:
        ids = np.frombuffer(token_ids, dtype=WIRE_INT32)
        lens = np.frombuffer(lengths, dtype=WIRE_INT32)
        if ids.size != batch * length or lens.size != batch:
            raise ValueError(
                f"batch {batch}x{length} needs {batch * length} ids and {batch} "
                f"lengths, got {ids.size} and {lens.size}"
            )
        # An unknown name goes to runner(), whose error names the loaded models.
        runner = self._runners.get(model) or self.runner(model)
        return runner.submit(ids, lens, batch, length)

    def collect(self, ticket: Ticket) -> tuple[np.ndarray, Times]:
        """Wait for a submitted batch: its output (a view of its pinned slot,
        valid until the slot is reused) and copy-in/compute/copy-out times."""
        return collect(ticket)

    def runner(self, model: str) -> ModelRunner:
        """The GPU state of one loaded model (graphs, slots)."""
        self.model(model)  # raises BackendError naming the loaded models
        return self._runners[model]
