"""What surrounds the TensorRT backend, tested without TensorRT.

TensorRT itself cannot be installed here: the builder is driven through a
stand-in module that records its calls, and selection must fall back.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from batcher._core_py import check_config
from engine.backend import BackendError, create_backend
from engine.backends_by_model import (
    ModelRouter,
    create_model_router,
    preferred_backend,
)
from engine.build import calibration
from engine.build.tensorrt import (
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
from services.cli.default_models import minilm_checkpoint
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
    assert calibrator.get_batch_shape() == (CALIBRATION_BATCH, CALIBRATION_LENGTH)
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
    calibrator.get_batch_shape.return_value = (CALIBRATION_BATCH, CALIBRATION_LENGTH)
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


def test_calibration_profile_is_the_shape_the_calibrator_feeds(
    tmp_path: Path,
) -> None:
    """TensorRT calibrates on the calibration profile's shape, so it must be
    the batches' own: shorter than CALIBRATION_LENGTH for a model with fewer
    positions (it was always CALIBRATION_LENGTH)."""
    trt: Any = mock.MagicMock()
    trt.Builder.return_value.build_serialized_network.return_value = b"plan"
    trt.OnnxParser.return_value.parse_from_file.return_value = True
    calibrator = mock.MagicMock()
    calibrator.get_batch_size.return_value = 32
    calibrator.get_batch_shape.return_value = (32, 64)
    build_serialized(
        trt, tmp_path / "m.onnx", bucket_profiles([32, 64]), "int8", calibrator
    )
    config = trt.Builder.return_value.create_builder_config.return_value
    config.set_calibration_profile.assert_called_once()
    shapes = trt.Builder.return_value.create_optimization_profile.return_value
    calls = shapes.set_shape.call_args_list
    assert mock.call("input_ids", (32, 64), (32, 64), (32, 64)) in calls
    assert mock.call("lengths", (32,), (32,), (32,)) in calls
    assert not [c for c in calls if c.args[1] == (32, CALIBRATION_LENGTH)]


def test_engine_cache_key_covers_the_calibration_data() -> None:
    """TensorRT leaves recalibrating on new data to the application: an INT8
    engine (and its calibration table, cached under the same key) built from
    other calibration batches is not reused."""
    from engine.build.tensorrt import calibration_digest

    tokenizer = minilm_checkpoint() / "tokenizer.json"
    texts = calibration.calibration_texts()[:40]
    first = calibration_digest(calibration_batches(tokenizer, texts))
    assert first == calibration_digest(calibration_batches(tokenizer, texts))
    others = [
        calibration_digest(calibration_batches(tokenizer, texts[1:])),
        calibration_digest(calibration_batches(tokenizer, texts, length=64)),
    ]
    assert len({first, *others}) == 3
    base = ("a" * 64, "NVIDIA H200", (9, 0), "10.9.0", "int8", bucket_profiles(BUCKETS))
    keys = {engine_cache_key(*base, calibration=c) for c in (first, *others)}
    assert len(keys) == 3


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


@pytest.mark.parametrize("version", ["11.0.0.10", "9.3.0", "10.0.1"])
def test_tensorrt_outside_10_1_to_10_x_is_skipped_with_a_reason(
    version: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TensorRT 11 removed implicit INT8 calibration and BuilderFlag.FP16/INT8;
    10.0 lacks set_device_memory(ptr, size): the backend must not start (to
    fail later, at load, with an AttributeError) but be skipped with the
    reason, so that the model falls back."""
    pytest.importorskip("engine.tensorrt_backend")
    fake = SimpleNamespace(__version__=version)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with (
        caplog.at_level(logging.WARNING, logger="berth.engine"),
        pytest.raises(BackendError, match="tensorrt"),
    ):
        create_backend("tensorrt", "cuda")
    assert f"TensorRT {version} is not supported" in caplog.text
    assert "10.1 to 10.x" in caplog.text


# A TensorRT 10 stand-in that runs on the CPU: enough of the runtime API for
# the backend's load, run and warmup, and the rules TensorRT sets on them.


class _Capture:
    """Stands in for the graph being captured (torch.cuda.graph)."""

    graph: _FakeGraph | None = None


class _FakeGraph:
    def __init__(self) -> None:
        self.launches: list[tuple[_FakeContext, tuple[Any, ...]]] = []

    def replay(self) -> None:
        for context, state in self.launches:
            # TensorRT: a graph is valid for the shapes and the state of the
            # execution context it was captured from, and only those.
            assert context.state() == state, (
                f"graph captured with {state} replayed on a context now in "
                f"{context.state()}"
            )
            context.compute()


class _FakeContext:
    def __init__(self, engine: _FakeEngine, strategy: str) -> None:
        self.engine, self.strategy = engine, strategy
        self.memory: tuple[int, int] | None = None
        self.profile: int | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.flushed: tuple[Any, ...] | None = None

    def state(self) -> tuple[Any, ...]:
        return (
            self.profile,
            tuple(sorted(self.shapes.items())),
            tuple(sorted(self.addresses.items())),
        )

    def set_device_memory(self, memory: int, size: int) -> None:
        assert size >= self.engine.device_memory_size_v2
        self.memory = (memory, size)

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        assert 0 <= index < len(self.engine.buckets)
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        assert self.profile is not None, "select a profile before shapes"
        bucket, most = self.engine.buckets[self.profile]
        if not 1 <= shape[0] <= most or (name == "input_ids" and shape[1] != bucket):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        self.addresses[name] = memory
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        assert self.strategy == "STATIC" or self.memory is not None
        graph = _Capture.graph
        if graph is None:
            self.compute()
            self.flushed = self.state()
        else:
            # TensorRT: enqueue once after the shapes change, then capture.
            assert self.flushed == self.state(), "captured before a flush"
            graph.launches.append((self, self.state()))
        return True

    def compute(self) -> None:
        """output[r, j] = sum of row r's ids + 1000 * its length + j."""
        rows, length = self.shapes["input_ids"]
        width = self.engine.width
        ids = np.ctypeslib.as_array(
            (ctypes.c_int32 * (rows * length)).from_address(self.addresses["input_ids"])
        ).reshape(rows, length)
        lengths = np.ctypeslib.as_array(
            (ctypes.c_int32 * rows).from_address(self.addresses["lengths"])
        )
        out = np.ctypeslib.as_array(
            (ctypes.c_float * (rows * width)).from_address(self.addresses["output"])
        ).reshape(rows, width)
        out[:] = (ids.sum(axis=1) + 1000 * lengths)[:, None] + np.arange(width)
        self.engine.runs.append((self.profile, rows, length))
        self.engine.ran_on.append(self)


class _FakeEngine:
    device_memory_size_v2 = 4096
    width = 3

    def __init__(self, buckets: list[tuple[int, int]]) -> None:
        self.buckets = buckets  # per profile: (length, largest batch)
        self.contexts: list[_FakeContext] = []
        self.runs: list[tuple[int | None, int, int]] = []
        self.ran_on: list[_FakeContext] = []

    def create_execution_context(self, strategy: str = "STATIC") -> _FakeContext:
        context = _FakeContext(self, strategy)
        self.contexts.append(context)
        return context

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        assert name == "output"
        return (-1, self.width)


class _FakeSlot:
    """engine/cuda/pinned.py's Slot in ordinary CPU memory."""

    def __init__(self, io: int, out: int, device: Any) -> None:
        self.io_cpu = torch.zeros(io, dtype=torch.int32)
        self.io = self.io_cpu.numpy()
        self.out_cpu = torch.zeros(out, dtype=torch.float32)
        self.out = self.out_cpu.numpy()
        self.events = [mock.MagicMock() for _ in range(4)]
        self.busy = False


@contextlib.contextmanager
def _capturing(graph: _FakeGraph, stream: Any = None, **_: Any) -> Iterator[None]:
    _Capture.graph = graph
    try:
        yield
    finally:
        _Capture.graph = None


def _trt_on_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, built: list[dict[str, Any]]
) -> Any:
    """A TensorRTBackend over the stand-in, on the CPU; ``built`` records the
    engines it builds, ``backend.engines`` the ones it loads."""
    tb = pytest.importorskip("engine.tensorrt_backend")
    engines: list[_FakeEngine] = []
    profiles: list[Profile] = []

    def build(trt: Any, onnx: Path, shapes: Any, precision: str, cal: Any) -> bytes:
        built.append({"precision": precision, "calibrator": cal})
        profiles[:] = shapes
        return b"plan"

    def deserialize(plan: bytes) -> _FakeEngine:
        engines.append(_FakeEngine([(p.bucket, p.max_batch) for p in profiles]))
        return engines[-1]

    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"graph")
    monkeypatch.setattr(tb, "export_entry", lambda entry, cache: onnx)
    monkeypatch.setattr(tb, "build_serialized", build)
    monkeypatch.setattr(tb, "Slot", _FakeSlot)
    props = SimpleNamespace(name="Fake GPU", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", _capturing)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    backend = object.__new__(tb.TensorRTBackend)  # its __init__ needs CUDA
    backend.trt = SimpleNamespace(
        __version__="10.9.0.34",
        ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED="USER_MANAGED"),
        IInt8EntropyCalibrator2=_FakeCalibratorBase,
    )
    backend.device, backend.torch_device = "cuda:0", torch.device("cpu")
    backend.cache, backend.token_budget, backend.max_batch = tmp_path, 256, 8
    backend.runtime = SimpleNamespace(deserialize_cuda_engine=deserialize)
    backend.stream = mock.MagicMock(cuda_stream=7)
    backend._models = {}
    backend.engines = engines
    return backend


def _expected(ids: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    sums = ids.sum(axis=1) + 1000 * lengths
    return (sums[:, None] + np.arange(width)).astype(np.float32)


def test_tensorrt_graphs_replay_on_the_context_they_were_captured_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each captured graph has an execution context of its own: with one
    context per profile, a second batch size (or any eager batch) of that
    profile changed the shapes of the context an earlier graph was captured
    from, and replaying that graph was undefined (TensorRT's CUDA graph rules:
    a graph is specific to the input shapes and the state of its context)."""
    backend = _trt_on_cpu(monkeypatch, tmp_path, built := [])
    entry = ModelEntry(
        name="m",
        task="embed",
        checkpoint=str(minilm_checkpoint()),
        root="/",
        buckets=[16, 32],
        max_tokens=32,
    )
    backend.load(entry)
    assert built == [{"precision": "fp16", "calibrator": None}]
    engine = backend.engines[0]
    m = backend.model("m")
    assert len(m.contexts) == 2 and [c.profile for c in m.contexts] == [0, 1]
    backend.warmup("m", [(1, 16), (2, 16), (1, 32), (2, 32)])
    assert sorted(m.graphs) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    rng = np.random.default_rng(0)
    for rows, length in [(3, 16), (1, 16), (2, 16), (5, 20), (1, 9), (2, 32)]:
        ids = rng.integers(1, 1000, (rows, length)).astype(np.int32)
        lengths = rng.integers(0, length + 1, rows).astype(np.int32)
        got = backend.run("m", ids, lengths)
        bucket = 16 if length <= 16 else 32
        padded = np.zeros((rows, bucket), dtype=np.int32)
        padded[:, :length] = ids
        np.testing.assert_array_equal(got, _expected(padded, lengths, engine.width))
    assert engine.runs[-6:] == [
        (0, 3, 16), (0, 1, 16), (0, 2, 16), (1, 5, 32), (0, 1, 16), (1, 2, 32)
    ]  # fmt: skip
    graph_contexts = [context for context, _ in m.graphs.values()]
    assert len({id(c) for c in [*graph_contexts, *m.contexts]}) == 4 + 2
    # (3, 16) and (5, 20) ran eagerly, on their profile's context; the others
    # are replays, each of its own graph's context.
    eager, captured = m.contexts, {shape: c for shape, (c, _) in m.graphs.items()}
    assert engine.ran_on[-6:] == [
        eager[0], captured[0, 1], captured[0, 2], eager[1], captured[0, 1],
        captured[1, 2],
    ]  # fmt: skip
    # One block of activation memory, shared by every context.
    assert {c.strategy for c in engine.contexts} == {"USER_MANAGED"}
    assert {c.memory for c in engine.contexts} == {
        (m.memory.data_ptr(), engine.device_memory_size_v2)
    }


def test_tensorrt_int8_calibrates_within_the_models_positions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Calibration batches are never longer than the model's max_tokens (they
    were always CALIBRATION_LENGTH = 128 tokens, past a 64-position model's
    table), and the engine's cache key covers them: other calibration data is
    a new engine, not the cached one (nor its cached calibration table)."""
    backend = _trt_on_cpu(monkeypatch, tmp_path, built := [])
    entry = ModelEntry(
        name="m",
        task="embed",
        checkpoint=str(minilm_checkpoint()),
        root="/",
        buckets=[32, 64],
        max_tokens=64,
        quantize="int8",
    )
    backend.load(entry)
    calibrator = built[0]["calibrator"]
    assert built[0]["precision"] == "int8"
    assert calibrator.get_batch(["input_ids", "lengths"]) is not None
    assert calibrator.held[0].shape == (CALIBRATION_BATCH, 64)
    assert calibrator.get_batch_shape() == (CALIBRATION_BATCH, 64)
    plans = sorted((tmp_path / "tensorrt").glob("*.plan"))
    assert len(plans) == 1 and plans[0].name.startswith("m-int8-")
    backend.load(entry)  # the same calibration data: the cached engine
    assert len(built) == 1
    tb = sys.modules["engine.tensorrt_backend"]
    fewer = calibration.calibration_texts()[:64]
    monkeypatch.setattr(tb, "calibration_texts", lambda: fewer)
    backend.load(entry)  # other calibration data: calibrated and built again
    assert len(built) == 2 and built[1]["calibrator"].get_batch_size() == 32
    assert len(sorted((tmp_path / "tensorrt").glob("*.plan"))) == 2
