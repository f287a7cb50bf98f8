"""The TensorRT backend: engines built from berth's ONNX export, on one GPU.

Per model: the ONNX file (engine/build/onnx_export.py), one TensorRT engine with
an optimization profile per length bucket (FP16, or INT8 calibrated by KL
divergence on real texts when the entry says ``quantize: "int8"``), cached
on disk by model hash + GPU + TensorRT version (engine/build/tensorrt.py);
one execution context per profile for eager enqueues, and a CUDA graph per
warmed-up (batch, bucket) shape, each captured from an execution context of
its own (TensorRT: a captured graph is only valid for the input shapes and
the state of the context it was captured from, so a context whose shapes
later change cannot keep one); every context of a model shares one block of
activation memory (its enqueues and replays never overlap: one stream, each
batch collected before the next). Batches pass through the same pinned slots
as the torch CUDA backend (engine/cuda/pinned.py).

NOT RUN: TensorRT cannot be installed on berth's machines (its full PyPI
wheels are stubs that download from elsewhere; the lean and dispatch
runtimes cannot build engines), so this backend is written against the
TensorRT 10 Python API and has never run here. Where ``tensorrt`` does not
import, ``create_backend("tensorrt", ...)`` logs that reason and the engine
falls back (see engine/backends_by_model.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.backend import BackendError, loaded
from engine.build.calibration import TokenBatch, calibration_texts
from engine.build.onnx_export import cache_dir, export_entry, file_sha256
from engine.build.tensorrt import (
    CALIBRATION_LENGTH,
    MAX_BATCH,
    TOKEN_BUDGET,
    Profile,
    bucket_profiles,
    build_serialized,
    calibration_batches,
    calibration_digest,
    check_version,
    engine_cache_key,
    engine_path,
    entropy_calibrator,
    profile_for,
    write_atomic,
)
from engine.cuda.graphs import capturing
from engine.cuda.pinned import Slot, SlotRing
from engine.torch_backend import check_batch, resolve_device
from services import files
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")


def precision_for(entry: ModelEntry) -> str:
    """fp16, or int8 when the entry asks for quantization (fp8 needs explicit
    Q/DQ nodes in TensorRT 10, which berth's export does not emit)."""
    quantize = getattr(entry, "quantize", "none")
    if quantize in ("none", None):
        return "fp16"
    if quantize == "int8":
        return "int8"
    raise BackendError(
        f"{entry.name}: quantize {quantize!r} is not available on tensorrt "
        "(use 'int8' or 'none', or the torch backend for 'fp8')"
    )


@dataclass
class TrtModel:
    """One model's engine, a context and device buffers per profile, graphs."""

    engine: Any
    contexts: list[Any]  # per profile: eager enqueues of any batch size
    profiles: list[Profile]
    width: int
    ids: list[torch.Tensor]  # int32 [max_batch * bucket] per profile
    lengths: list[torch.Tensor]  # int32 [max_batch] per profile
    outputs: list[torch.Tensor]  # float32 [max_batch * width] per profile
    ring: SlotRing
    memory: torch.Tensor  # uint8: activation memory every context shares
    # (profile, rows) -> (its own context, the graph captured from it)
    graphs: dict[tuple[int, int], tuple[Any, torch.cuda.CUDAGraph]] = field(
        default_factory=dict
    )


class TensorRTBackend:
    """Runs served models as TensorRT engines, one profile per length bucket."""

    name = "tensorrt"

    def __init__(
        self,
        device: str = "cuda",
        cache: Path | None = None,
        token_budget: int = TOKEN_BUDGET,
        max_batch: int = MAX_BATCH,
    ) -> None:
        import tensorrt as trt  # ImportError: create_backend logs it and skips

        check_version(trt.__version__)  # RuntimeError: logged and skipped too
        torch_device = resolve_device("cuda" if device == "auto" else device)
        if torch_device.type != "cuda":
            raise RuntimeError(f"TensorRT needs a CUDA device, not {device!r}")
        self.trt = trt
        self.device = str(torch_device)
        self.torch_device = torch_device
        self.cache = cache or cache_dir()
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.stream = torch.cuda.Stream(torch_device)
        self._models: dict[str, TrtModel] = {}
        log.info("TensorRT %s on %s", trt.__version__, self.device)

    # The interface.

    def load(self, entry: ModelEntry) -> None:
        precision = precision_for(entry)
        onnx_path = export_entry(entry, self.cache)
        profiles = bucket_profiles(entry.buckets, self.token_budget, self.max_batch)
        plan = self._engine_plan(entry, onnx_path, profiles, precision)
        engine = self.runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise BackendError(f"{entry.name}: TensorRT could not load its engine")
        dev = self.torch_device
        # The largest any profile needs; the contexts take turns on one stream.
        size = int(engine.device_memory_size_v2)
        memory = torch.empty(size, dtype=torch.uint8, device=dev)
        contexts = [self._context(engine, memory, i) for i in range(len(profiles))]
        width = int(engine.get_tensor_shape("output")[-1])
        i32 = torch.int32
        rows = [p.max_batch for p in profiles]
        io = max(p.max_batch * (p.bucket + 1) for p in profiles)
        slots = [Slot(io, max(rows) * width, self.torch_device) for _ in range(2)]
        self._models[entry.name] = TrtModel(
            engine=engine,
            contexts=contexts,
            profiles=profiles,
            width=width,
            ids=[
                torch.zeros(p.max_batch * p.bucket, dtype=i32, device=dev)
                for p in profiles
            ],
            lengths=[torch.zeros(n, dtype=i32, device=dev) for n in rows],
            outputs=[torch.zeros(n * width, device=dev) for n in rows],
            ring=SlotRing(slots),
            memory=memory,
        )
        self.stream.synchronize()
        log.info(
            "model %s loaded on TensorRT (%s, %d profiles, width %d)",
            entry.name,
            precision,
            len(profiles),
            width,
        )

    def width(self, model: str) -> int:
        return self.model(model).width

    def run(self, model: str, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        m = self.model(model)
        check_batch(token_ids, lengths)
        rows, length = token_ids.shape
        index = profile_for(m.profiles, rows, length)
        bucket = m.profiles[index].bucket
        # 1. The batch into a pinned slot, each row padded to the bucket.
        _, slot = m.ring.take()
        try:
            tokens = rows * bucket
            padded = slot.io[:tokens].reshape(rows, bucket)
            padded[:, :length] = token_ids
            padded[:, length:] = 0
            slot.io[tokens : tokens + rows] = lengths
            # 2. Copy in, replay (or enqueue), copy out, on the engine's stream.
            with torch.cuda.stream(self.stream):
                m.ids[index][:tokens].copy_(slot.io_cpu[:tokens], non_blocking=True)
                m.lengths[index][:rows].copy_(
                    slot.io_cpu[tokens : tokens + rows], non_blocking=True
                )
                captured = m.graphs.get((index, rows))
                if captured is not None:
                    captured[1].replay()
                else:
                    context = m.contexts[index]
                    self._bind(m, context, index, rows)
                    self._enqueue(context, rows, bucket)
                out = slot.out_cpu[: rows * m.width]
                out.copy_(m.outputs[index][: rows * m.width], non_blocking=True)
                slot.events[-1].record()
            # 3. Wait; the slot's bytes stay valid until it is taken again.
            slot.events[-1].synchronize()
            return slot.out[: rows * m.width].reshape(rows, m.width).copy()
        finally:
            slot.busy = False

    def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
        """Run each shape once, then capture its enqueue in a CUDA graph, from
        an execution context of its own that nothing changes afterwards."""
        m = self.model(model)
        start = time.perf_counter()
        for rows, length in shapes:
            index = profile_for(m.profiles, rows, length)
            ids = np.zeros((rows, length), dtype=np.int32)
            self.run(model, ids, np.full(rows, length, dtype=np.int32))
            if (index, rows) in m.graphs:
                continue
            bucket = m.profiles[index].bucket
            context = self._context(m.engine, m.memory, index)
            self._bind(m, context, index, rows)
            # One enqueue after the shapes are set flushes TensorRT's deferred
            # shape updates, which must not be captured.
            with torch.cuda.stream(self.stream):
                self._enqueue(context, rows, bucket)
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, stream=self.stream):
                self._enqueue(context, rows, bucket)
            m.graphs[(index, rows)] = (context, graph)
        log.info(
            "model %s: %d TensorRT graphs captured in %.2f s",
            model,
            len(m.graphs),
            time.perf_counter() - start,
        )

    def model(self, name: str) -> TrtModel:
        return loaded(self._models, name, self.name)

    # Steps.

    def _context(self, engine: Any, memory: torch.Tensor, index: int) -> Any:
        """A new execution context on profile ``index``, in shared memory."""
        strategy = self.trt.ExecutionContextAllocationStrategy.USER_MANAGED
        context = engine.create_execution_context(strategy)
        if context is None:
            raise BackendError("TensorRT could not create an execution context")
        context.set_device_memory(memory.data_ptr(), memory.numel())
        context.set_optimization_profile_async(index, self.stream.cuda_stream)
        return context

    def _bind(self, m: TrtModel, context: Any, index: int, rows: int) -> None:
        """Shapes and buffers of a [rows, bucket] batch on profile ``index``."""
        bucket = m.profiles[index].bucket
        for name, shape in (("input_ids", (rows, bucket)), ("lengths", (rows,))):
            if not context.set_input_shape(name, shape):
                raise BackendError(
                    f"TensorRT refused {name} of shape {shape} on profile {index}"
                )
        context.set_tensor_address("input_ids", m.ids[index].data_ptr())
        context.set_tensor_address("lengths", m.lengths[index].data_ptr())
        context.set_tensor_address("output", m.outputs[index].data_ptr())

    def _enqueue(self, context: Any, rows: int, bucket: int) -> None:
        """The bound batch through the engine, on our stream."""
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise BackendError(f"TensorRT failed on a [{rows}, {bucket}] batch")

    def _engine_plan(
        self,
        entry: ModelEntry,
        onnx_path: Path,
        profiles: list[Profile],
        precision: str,
    ) -> bytes:
        """The cached engine for this model, GPU and TensorRT, else a new one."""
        batches: list[TokenBatch] = []
        if precision == "int8":
            # Never longer than the model's positions (nor its last bucket).
            length = min(CALIBRATION_LENGTH, entry.max_tokens)
            batches = calibration_batches(
                entry.tokenizer_file, calibration_texts(), length=length
            )
        props = torch.cuda.get_device_properties(self.torch_device)
        key = engine_cache_key(
            file_sha256(onnx_path),
            props.name,
            (props.major, props.minor),
            self.trt.__version__,
            precision,
            profiles,
            calibration_digest(batches) if batches else "",
        )
        path = engine_path(self.cache, entry.name, precision, key)
        if files.verified(path, "TensorRT engine"):
            log.info("TensorRT engine for %s found in cache: %s", entry.name, path)
            return path.read_bytes()
        calibrator = None
        if precision == "int8":
            calibrator = entropy_calibrator(
                self.trt, batches, path.with_suffix(".calib"), self.torch_device
            )
        plan = build_serialized(self.trt, onnx_path, profiles, precision, calibrator)
        write_atomic(path, plan)
        return plan
