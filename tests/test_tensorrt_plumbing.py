"""What surrounds the TensorRT backend, tested without TensorRT.

TensorRT itself cannot be installed here: the builder is driven through a
stand-in module that records its calls, and selection must fall back.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest

from batcher._core_py import check_config
from engine import calibration
from engine.backend import BackendError, create_backend
from engine.backends_by_model import (
    ModelRouter,
    create_model_router,
    preferred_backend,
)
from engine.tensorrt_build import (
    CALIBRATION_BATCH,
    CALIBRATION_LENGTH,
    Profile,
    batch_sizes,
    bucket_profiles,
    build_serialized,
    calibration_batches,
    engine_cache_key,
    engine_path,
    entropy_calibrator,
    profile_for,
)
from services.default_models import minilm_checkpoint
from services.repository import DEFAULT_BUCKETS, ModelEntry

BUCKETS = [32, 64, 128, 256, 512]


def test_batch_sizes_are_the_batchers() -> None:
    for budget, max_batch in [(16384, 256), (8192, 64), (1024, 512)]:
        *_, sizes = check_config(BUCKETS, budget, 0.005, 4096, max_batch, 0)
        assert batch_sizes(BUCKETS, budget, max_batch) == sizes
    assert batch_sizes(DEFAULT_BUCKETS) == [256, 256, 128, 64, 32, 16]


def test_one_profile_per_bucket() -> None:
    profiles = bucket_profiles(BUCKETS)
    assert [p.bucket for p in profiles] == BUCKETS
    assert profiles[2] == Profile(bucket=128, min_batch=1, opt_batch=128, max_batch=128)
    shapes = profiles[2].shapes()
    assert shapes["input_ids"] == ((1, 128), (128, 128), (128, 128))
    assert shapes["lengths"] == ((1,), (128,), (128,))


def test_profile_for_picks_the_smallest_bucket_that_fits() -> None:
    profiles = bucket_profiles(BUCKETS)
    assert profile_for(profiles, 1, 1) == 0
    assert profile_for(profiles, 256, 32) == 0
    assert profile_for(profiles, 3, 33) == 1
    assert profile_for(profiles, 32, 512) == 4
    with pytest.raises(ValueError, match="over the engine's last bucket"):
        profile_for(profiles, 1, 513)
    with pytest.raises(ValueError, match="token budget"):
        profile_for(profiles, 129, 128)


def test_calibration_batches_are_real_texts_in_one_shape() -> None:
    texts = calibration.calibration_texts()
    batches = calibration_batches(minilm_checkpoint() / "tokenizer.json", texts)
    assert len(batches) == -(-len(texts) // CALIBRATION_BATCH)
    for b in batches:
        assert b.ids.shape == (CALIBRATION_BATCH, CALIBRATION_LENGTH)
        assert b.ids.dtype == np.int32 and b.lengths.dtype == np.int32
        assert (b.lengths >= 3).all() and (b.lengths <= CALIBRATION_LENGTH).all()
        assert (b.ids[:, 0] == 101).all()  # [CLS]: real tokenized text
    with pytest.raises(ValueError, match="at least one text"):
        calibration_batches(minilm_checkpoint() / "tokenizer.json", [])


def test_engine_cache_key_covers_model_gpu_and_tensorrt() -> None:
    profiles = bucket_profiles(BUCKETS)
    base = ("a" * 64, "NVIDIA H200", (9, 0), "10.9.0", "fp16", profiles)
    key = engine_cache_key(*base)
    assert key == engine_cache_key(*base)
    changes = [
        ("b" * 64, *base[1:]),
        (base[0], "NVIDIA H100", *base[2:]),
        (*base[:2], (8, 9), *base[3:]),
        (*base[:3], "10.10.0", *base[4:]),
        (*base[:4], "int8", base[5]),
        (*base[:5], bucket_profiles(BUCKETS, token_budget=8192)),
    ]
    assert len({key, *(engine_cache_key(*c) for c in changes)}) == len(changes) + 1
    path = engine_path(Path("/c"), "minilm", "fp16", key)
    assert path.parent == Path("/c/tensorrt") and path.suffix == ".plan"


class _FakeCalibratorBase:
    """Stands in for tensorrt.IInt8EntropyCalibrator2."""

    def __init__(self) -> None:
        pass


def test_entropy_calibrator_feeds_every_batch_then_stops(tmp_path: Path) -> None:
    texts = calibration.calibration_texts()[:70]
    batches = calibration_batches(minilm_checkpoint() / "tokenizer.json", texts)
    trt = SimpleNamespace(IInt8EntropyCalibrator2=_FakeCalibratorBase)
    cache = tmp_path / "calib.cache"
    calibrator = entropy_calibrator(trt, batches, cache, "cpu")
    assert calibrator.get_batch_size() == CALIBRATION_BATCH
    fed = 0
    while (pointers := calibrator.get_batch(["lengths", "input_ids"])) is not None:
        assert len(pointers) == 2 and all(isinstance(p, int) for p in pointers)
        held = calibrator.held
        assert held[0].shape == (CALIBRATION_BATCH,)  # in the names' order
        assert held[1].shape == (CALIBRATION_BATCH, CALIBRATION_LENGTH)
        fed += 1
    assert fed == len(batches) == 3
    assert calibrator.read_calibration_cache() is None
    calibrator.write_calibration_cache(b"table")
    assert calibrator.read_calibration_cache() == b"table"


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_builder_gets_a_profile_per_bucket(precision: str, tmp_path: Path) -> None:
    trt: Any = mock.MagicMock()
    trt.Builder.return_value.build_serialized_network.return_value = b"plan"
    trt.OnnxParser.return_value.parse_from_file.return_value = True
    calibrator = mock.MagicMock()
    calibrator.get_batch_size.return_value = CALIBRATION_BATCH
    profiles = bucket_profiles(BUCKETS)
    plan = build_serialized(
        trt, tmp_path / "m.onnx", profiles, precision, calibrator=calibrator
    )
    assert plan == b"plan"
    builder = trt.Builder.return_value
    config = builder.create_builder_config.return_value
    assert config.add_optimization_profile.call_count == len(BUCKETS)
    flags = [c.args[0] for c in config.set_flag.call_args_list]
    assert trt.BuilderFlag.FP16 in flags
    assert (trt.BuilderFlag.INT8 in flags) == (precision == "int8")
    shapes = builder.create_optimization_profile.return_value.set_shape.call_args_list
    assert mock.call("input_ids", (1, 128), (128, 128), (128, 128)) in shapes
    if precision == "int8":
        assert config.int8_calibrator is calibrator
        config.set_calibration_profile.assert_called_once()


def test_builder_reports_parse_errors(tmp_path: Path) -> None:
    trt: Any = mock.MagicMock()
    parser = trt.OnnxParser.return_value
    parser.parse_from_file.return_value = False
    parser.num_errors = 1
    parser.get_error.return_value = "unsupported node"
    with pytest.raises(RuntimeError, match="unsupported node"):
        build_serialized(trt, tmp_path / "m.onnx", bucket_profiles(BUCKETS), "fp16")


def test_tensorrt_backend_without_tensorrt_is_skipped_with_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("engine.tensorrt_backend")  # imports without TensorRT
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("TensorRT is installed here")
    with (
        caplog.at_level(logging.WARNING, logger="berth.engine"),
        pytest.raises(BackendError, match="tensorrt"),
    ):
        create_backend("tensorrt", "cuda")
    assert "backend tensorrt on cuda skipped" in caplog.text


def _entry(name: str, backend: str) -> ModelEntry:
    return ModelEntry(name=name, task="embed", checkpoint="", backend=backend)


def test_router_falls_back_per_model_with_a_logged_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entries = {
        "a": _entry("a", "tensorrt"),
        "b": _entry("b", "onnxruntime"),
        "c": _entry("c", "torch"),
    }
    with caplog.at_level(logging.WARNING, logger="berth.engine"):
        router = create_model_router(entries, fallback="torch", device="cpu")
    assert router.chosen["a"] == "torch"  # no TensorRT here
    assert router.chosen["c"] == "torch"
    pytest.importorskip("onnxruntime")
    assert router.chosen["b"] == "onnxruntime"
    assert "model a asks for backend tensorrt" in caplog.text
    assert "serving it with torch instead" in caplog.text


def test_router_dispatches_by_model_and_fails_when_nothing_starts() -> None:
    runs: list[tuple[str, str]] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name, self.device = name, "cpu"

        def load(self, entry: ModelEntry) -> None:
            runs.append((self.name, entry.name))

        def width(self, model: str) -> int:
            return len(self.name)

        def run(self, model: str, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
            runs.append((self.name, model))
            return np.zeros((len(ids), 1), dtype=np.float32)

        def warmup(self, model: str, shapes: list[tuple[int, int]]) -> None:
            pass

    def factory(name: str, device: str) -> Any:
        if name == "broken":
            raise BackendError("broken: cannot start")
        return Fake(name)

    entries = {"x": _entry("x", "onnxruntime"), "y": _entry("y", "broken")}
    router = create_model_router(entries, "torch", "cpu", factory)
    assert isinstance(router, ModelRouter) and router.name == "onnxruntime+torch"
    for entry in entries.values():
        router.load(entry)
    router.run("y", np.zeros((2, 4), dtype=np.int32), np.full(2, 4, dtype=np.int32))
    assert runs == [("onnxruntime", "x"), ("torch", "y"), ("torch", "y")]
    assert router.width("x") == len("onnxruntime")
    with pytest.raises(BackendError, match="has no backend"):
        router.width("z")
    with pytest.raises(BackendError, match="neither can the fallback"):
        create_model_router({"y": entries["y"]}, "broken", "cpu", factory)


def test_auto_backend_is_the_measured_faster_one_for_the_device() -> None:
    created: list[tuple[str, str]] = []

    def factory(name: str, device: str) -> Any:
        created.append((name, device))
        return type("Fake", (), {"name": name, "device": device})()

    plain, int8 = _entry("plain", "auto"), _entry("int8", "auto")
    int8.quantize = "int8"
    assert ModelEntry(name="x", task="embed", checkpoint="").backend == "auto"
    assert preferred_backend(plain, "cpu") == "onnxruntime"
    assert preferred_backend(int8, "cpu") == "torch"  # its INT8 agrees more
    int8.quantize = "fp8"  # refused on the CPU by torch, naming the fix
    assert preferred_backend(int8, "cpu") == "torch"
    int8.quantize = "int8"
    assert preferred_backend(plain, "cuda:0") == "torch"  # fp16 CUDA graphs
    router = create_model_router(
        {"plain": plain, "int8": int8}, "torch", "cpu", factory
    )
    assert router.chosen == {"plain": "onnxruntime", "int8": "torch"}
    assert created == [("onnxruntime", "cpu"), ("torch", "cpu")]
