"""The onnxruntime backend: berth's ONNX export run by onnxruntime.

CPU by default; on ``cuda[:N]`` it asks for the TensorRT and CUDA execution
providers, when this onnxruntime build has them (``onnxruntime-gpu``), and
fails to start otherwise. A model whose entry says ``quantize: "int8"`` runs
onnxruntime's dynamic INT8 quantization of the exported graph (per-channel
weights), cached beside the float32 file.
"""

from __future__ import annotations

import fcntl
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.backend import BackendError, loaded, warm_up_eagerly
from engine.build.onnx_export import OUTPUT_NAME, cache_dir, export_entry
from engine.encoder import read_config
from engine.torch_backend import check_batch, default_threads
from engine.validate import BadBatch, check_ids, model_limits
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")


@dataclass
class OnnxModel:
    """One loaded model: its session, output width and input limits."""

    session: Any  # onnxruntime.InferenceSession
    width: int
    path: Path
    vocab: int  # token ids lie in [0, vocab)
    max_length: int  # positions the model can encode


def quantize_onnx_int8(path: Path) -> Path:
    """onnxruntime's dynamic INT8 quantization of ``path``, cached beside it."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path.with_name(path.stem + "-int8.onnx")
    if out.is_file():
        return out
    # Engines starting together quantize once (as they export once): the
    # quantizer also writes its own file beside ``path``, so two at once
    # break each other's files.
    with open(out.with_name(f".{out.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            log.info("onnx int8: %s written by another process", out.name)
            return out
        start = time.perf_counter()
        tmp = out.with_name(f".{out.name}.tmp")
        quantize_dynamic(path, tmp, per_channel=True, weight_type=QuantType.QInt8)
        tmp.replace(out)
    log.info("onnx int8: %s written in %.1f s", out.name, time.perf_counter() - start)
    return out


class OnnxRuntimeBackend:
    """Runs served models as ONNX graphs in onnxruntime sessions."""

    name = "onnxruntime"

    def __init__(
        self,
        device: str = "cpu",
        threads: int | None = None,
        cache: Path | None = None,
    ) -> None:
        import onnxruntime as ort

        self._ort = ort
        available = ort.get_available_providers()
        if device == "auto":
            device = "cuda" if "CUDAExecutionProvider" in available else "cpu"
        kind, _, index = device.partition(":")
        if kind == "cpu":
            self.providers: list[Any] = ["CPUExecutionProvider"]
        elif kind == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise RuntimeError(
                    f"onnxruntime has no CUDA execution provider (it has {available}); "
                    "install onnxruntime-gpu or use device cpu"
                )
            options = {"device_id": int(index or 0)}
            self.providers = [
                ("CUDAExecutionProvider", options),
                "CPUExecutionProvider",
            ]
            if "TensorrtExecutionProvider" in available:
                trt_options = {
                    **options,
                    "trt_fp16_enable": True,
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(cache_dir() / "ort-trt"),
                }
                self.providers.insert(0, ("TensorrtExecutionProvider", trt_options))
        else:
            raise ValueError(f"device {device!r} is not supported; use cpu, cuda[:N]")
        self.device = device if ":" in device or kind == "cpu" else f"{kind}:0"
        self.threads = threads or default_threads()
        self.cache = cache
        self._models: dict[str, OnnxModel] = {}
        log.info(
            "onnxruntime %s on %s (providers %s, %d threads)",
            ort.__version__,
            self.device,
            [p if isinstance(p, str) else p[0] for p in self.providers],
            self.threads,
        )

    # The interface.

    def load(self, entry: ModelEntry) -> None:
        path = export_entry(entry, self.cache)
        quantize = getattr(entry, "quantize", "none")
        if quantize == "int8":
            path = quantize_onnx_int8(path)
        elif quantize not in ("none", None):
            raise BackendError(
                f"{entry.name}: quantize {quantize!r} is not available on "
                "onnxruntime (use 'int8' or 'none')"
            )
        options = self._ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        level = self._ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.graph_optimization_level = level
        session = self._ort.InferenceSession(
            str(path), sess_options=options, providers=self.providers
        )
        probe = session.run(
            [OUTPUT_NAME],
            {
                "input_ids": np.zeros((1, 2), dtype=np.int32),
                "lengths": np.full(1, 2, dtype=np.int32),
            },
        )[0]
        config = read_config(entry.checkpoint_dir)
        self._models[entry.name] = OnnxModel(
            session,
            int(probe.shape[1]),
            path,
            model_limits(entry).vocab_size,
            config.max_length,
        )
        log.info(
            "model %s loaded on onnxruntime from %s (width %d, providers %s)",
            entry.name,
            path.name,
            probe.shape[1],
            session.get_providers(),
        )

    def width(self, model: str) -> int:
        return self.model(model).width

    def run(self, model: str, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        loaded = self.model(model)
        check_batch(token_ids, lengths)
        # What the torch backend refuses too: onnxruntime would read a negative
        # id from the end of the embedding table, and fail a length over the
        # position table with a broadcasting error.
        if token_ids.shape[1] > loaded.max_length:
            raise BadBatch(
                f"sequence length {token_ids.shape[1]} is over the model's "
                f"{loaded.max_length} positions"
            )
        check_ids(token_ids, loaded.vocab)
        if lengths.size:
            # As the torch CPU backend: compute up to the longest row, not the
            # bucket's padded length (the graph's length axis is dynamic; at
            # least 2 tokens, the shape it was exported and probed with).
            token_ids = token_ids[:, : max(int(lengths.max()), 2)]
        feeds = {
            "input_ids": np.ascontiguousarray(token_ids, dtype=np.int32),
            "lengths": np.ascontiguousarray(lengths, dtype=np.int32),
        }
        out: np.ndarray = loaded.session.run([OUTPUT_NAME], feeds)[0]
        return out.astype(np.float32, copy=False)

    def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
        warm_up_eagerly(self, model, shapes, min_length=2)

    def model(self, name: str) -> OnnxModel:
        return loaded(self._models, name, self.name)
