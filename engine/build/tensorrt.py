"""Building TensorRT engines from berth's ONNX export: profiles, calibration, cache.

Everything up to the builder calls is plain Python and is tested without
TensorRT: the optimization profiles (one per length bucket, batch sizes as
the batcher forms them), the fixed-shape batches the INT8 entropy
calibrator is fed (real texts from engine/data/calibration_texts.txt), and
the engine cache key. :func:`build_serialized` and :func:`entropy_calibrator`
need the TensorRT 10 Python API (``import tensorrt``).

NOT RUN: TensorRT cannot be installed on berth's development and GPU
machines (its full PyPI wheels are stubs that download from elsewhere), so
the builder path has been written against the TensorRT 10 API but never
executed here.

INT8 here is TensorRT's implicit quantization: an IInt8EntropyCalibrator2,
``IBuilderConfig.int8_calibrator`` and a calibration profile. TensorRT 10.1
deprecated all three ("superseded by explicit quantization", i.e. Q/DQ nodes
in the ONNX graph, which berth's export does not emit) and TensorRT 11
removed them together with ``BuilderFlag.FP16``/``INT8``; they still work in
TensorRT 10, the only line :func:`check_version` accepts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.build.calibration import TokenBatch, load_tokenizer, pad_batches, tokenize
from services import files

log = logging.getLogger("berth.engine")

# The batcher's defaults (batcher/options.py SchedulerConfig).
TOKEN_BUDGET = 16384
MAX_BATCH = 256
PRECISIONS = ("fp16", "int8")
WORKSPACE_BYTES = 4 << 30
# Calibration batches: fixed shape (the calibration profile's opt shape).
CALIBRATION_BATCH = 32
CALIBRATION_LENGTH = 128
# The TensorRT line this is written for: set_device_memory(ptr, size) and
# device_memory_size_v2 arrived in 10.1; 11 removed implicit INT8 and the
# FP16/INT8 builder flags.
MIN_VERSION = (10, 1)
NEXT_MAJOR = 11


def check_version(version: str) -> None:
    """Refuse a TensorRT this backend is not written for (RuntimeError: the
    backend is then skipped with this reason, and the model falls back)."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        found = (0, 0)
    if not MIN_VERSION <= found < (NEXT_MAJOR, 0):
        raise RuntimeError(
            f"TensorRT {version} is not supported: berth's TensorRT backend needs "
            f"TensorRT {MIN_VERSION[0]}.{MIN_VERSION[1]} to {NEXT_MAJOR - 1}.x "
            f"(TensorRT {NEXT_MAJOR} removed the implicit INT8 calibration and "
            "FP16/INT8 builder flags it uses)"
        )


def batch_sizes(
    buckets: Sequence[int], token_budget: int = TOKEN_BUDGET, max_batch: int = MAX_BATCH
) -> list[int]:
    """The largest batch the batcher forms per bucket (its check_config rule)."""
    return [max(1, min(max_batch, token_budget // n)) for n in sorted(buckets)]


@dataclass(frozen=True)
class Profile:
    """One optimization profile: a bucket's length, batch from 1 to its largest.

    The batcher pads every row of a batch to its bucket's length, so length
    is fixed per profile (TensorRT picks kernels for exactly that length);
    the backend pads a shorter batch up to its bucket.
    """

    bucket: int
    min_batch: int
    opt_batch: int
    max_batch: int

    def shapes(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Input name -> (min, opt, max) shapes, as set_shape takes them."""
        length = self.bucket
        return {
            "input_ids": (
                (self.min_batch, length),
                (self.opt_batch, length),
                (self.max_batch, length),
            ),
            "lengths": ((self.min_batch,), (self.opt_batch,), (self.max_batch,)),
        }


def bucket_profiles(
    buckets: Sequence[int], token_budget: int = TOKEN_BUDGET, max_batch: int = MAX_BATCH
) -> list[Profile]:
    """One profile per bucket; opt = max = the batcher's largest batch there
    (it grows batches to that size under load, where speed matters)."""
    sizes = batch_sizes(buckets, token_budget, max_batch)
    return [
        Profile(b, 1, size, size)
        for b, size in zip(sorted(buckets), sizes, strict=True)
    ]


def profile_for(profiles: Sequence[Profile], batch: int, length: int) -> int:
    """Index of the profile that runs a [batch, length] input (padded up)."""
    for i, profile in enumerate(profiles):
        if length <= profile.bucket:
            if batch > profile.max_batch:
                raise ValueError(
                    f"batch {batch} of length {length} is over the engine's "
                    f"{profile.max_batch} rows for bucket {profile.bucket}; rebuild "
                    "the engine with the batcher's token budget"
                )
            return i
    raise ValueError(
        f"length {length} is over the engine's last bucket {profiles[-1].bucket}"
    )


def calibration_batches(
    tokenizer_file: Path,
    texts: Sequence[str],
    batch: int = CALIBRATION_BATCH,
    length: int = CALIBRATION_LENGTH,
) -> list[TokenBatch]:
    """Texts as full [batch, length] batches: TensorRT's calibrator takes one
    shape. Longer texts are truncated; the last batch is filled by wrapping."""
    sequences = tokenize(load_tokenizer(tokenizer_file, length), texts)
    if not sequences:
        raise ValueError("calibration needs at least one text")
    count = -(-len(sequences) // batch) * batch
    wrapped = [sequences[i % len(sequences)] for i in range(count)]
    padded = pad_batches(wrapped, [length], batch)
    log.info(
        "calibration: %d texts in %d batches of [%d, %d]",
        len(texts),
        len(padded),
        batch,
        length,
    )
    return padded


def calibration_digest(batches: Sequence[TokenBatch]) -> str:
    """sha256 of the calibration batches (ids and lengths, in order)."""
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(str(batch.ids.shape).encode())
        digest.update(batch.ids.tobytes())
        digest.update(batch.lengths.tobytes())
    return digest.hexdigest()


def engine_cache_key(
    onnx_sha256: str,
    gpu: str,
    compute_capability: tuple[int, int],
    trt_version: str,
    precision: str,
    profiles: Sequence[Profile],
    calibration: str = "",
) -> str:
    """What makes an engine reusable: model hash, GPU, TensorRT, build options,
    and for INT8 the calibration data (:func:`calibration_digest`): TensorRT
    leaves recalibrating on new data to the application, and the calibration
    table is cached under this key too."""
    blob = {
        "onnx": onnx_sha256,
        "gpu": gpu,
        "sm": list(compute_capability),
        "tensorrt": trt_version,
        "precision": precision,
        "profiles": [asdict(p) for p in profiles],
        "calibration": calibration,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def engine_path(cache_dir: Path, model: str, precision: str, key: str) -> Path:
    return cache_dir / "tensorrt" / f"{model}-{precision}-{key[:20]}.plan"


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` durably, then its checksum (services/files.py)."""
    files.write_bytes(path, data)
    files.seal(path)


def entropy_calibrator(
    trt: Any, batches: Sequence[TokenBatch], cache_file: Path, device: Any
) -> Any:
    """A TensorRT IInt8EntropyCalibrator2 (KL divergence) over ``batches``.

    Device memory comes from torch; the calibration table is cached in
    ``cache_file`` so a rebuild skips the calibration passes. Every batch has
    one shape, :meth:`get_batch_shape`, the calibration profile's.
    (Deprecated in TensorRT 10.1, removed in 11: see the module docstring.)
    """
    import torch

    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):
        """Feeds real-text batches to TensorRT's INT8 entropy calibration."""

        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.index = 0
            self.held: list[Any] = []

        def get_batch_size(self) -> int:
            return int(batches[0].ids.shape[0])

        def get_batch_shape(self) -> tuple[int, int]:
            """[rows, length] of every batch: the calibration profile's shape."""
            rows, length = batches[0].ids.shape
            return int(rows), int(length)

        def get_batch(self, names: list[str]) -> list[int] | None:
            if self.index >= len(batches):
                return None
            batch = batches[self.index]
            self.index += 1
            arrays = {"input_ids": batch.ids, "lengths": batch.lengths}
            self.held = [torch.from_numpy(arrays[n]).to(device) for n in names]
            if self.index % 4 == 0:
                log.info("calibration batch %d/%d", self.index, len(batches))
            return [t.data_ptr() for t in self.held]

        def read_calibration_cache(self) -> bytes | None:
            return cache_file.read_bytes() if cache_file.is_file() else None

        def write_calibration_cache(self, cache: Any) -> None:
            write_atomic(cache_file, bytes(cache))

    return EntropyCalibrator()


def build_serialized(
    trt: Any,
    onnx_path: Path,
    profiles: Sequence[Profile],
    precision: str,
    calibrator: Any = None,
    workspace: int = WORKSPACE_BYTES,
) -> bytes:
    """Parse the ONNX file and build a serialized engine (TensorRT 10 API)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} not in {PRECISIONS}")
    start = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is TensorRT 10's only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    config.set_flag(trt.BuilderFlag.FP16)
    for profile in profiles:
        optimization = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.shapes().items():
            optimization.set_shape(name, low, opt, high)
        config.add_optimization_profile(optimization)
    if precision == "int8":
        if calibrator is None:
            raise ValueError("an INT8 build needs a calibrator")
        config.set_flag(trt.BuilderFlag.INT8)
        config.int8_calibrator = calibrator
        calibration = builder.create_optimization_profile()
        # The shape get_batch feeds (its length may be under
        # CALIBRATION_LENGTH: a model with fewer positions).
        rows, length = calibrator.get_batch_shape()
        for name, shape in (
            ("input_ids", (rows, length)),
            ("lengths", (rows,)),
        ):
            calibration.set_shape(name, shape, shape, shape)
        config.set_calibration_profile(calibration)
    log.info(
        "building TensorRT %s engine from %s: %d profiles (buckets %s)",
        precision,
        onnx_path.name,
        len(profiles),
        [p.bucket for p in profiles],
    )
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    log.info("TensorRT engine built in %.0f s", time.perf_counter() - start)
    return bytes(serialized)
