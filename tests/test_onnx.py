"""ONNX export of berth's models, checked with onnxruntime; the onnxruntime backend."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from engine.backend import BackendError, create_backend  # noqa: E402
from engine.build import calibration  # noqa: E402
from engine.build.onnx_export import (  # noqa: E402
    compare_with_torch,
    export_entry,
    model_fingerprint,
)
from engine.model import load_served_model  # noqa: E402
from engine.onnx_backend import OnnxRuntimeBackend  # noqa: E402
from engine.torch_backend import TorchBackend  # noqa: E402
from services.repository import ModelEntry, load_repository  # noqa: E402


@pytest.fixture(scope="module")
def entries(repository: Path) -> dict[str, ModelEntry]:
    return load_repository(repository)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("berth-cache")


def _batches(entry: ModelEntry, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    texts = calibration.evaluation_texts()[:count]
    batches = calibration.text_batches(entry.tokenizer_file, texts, [16, 64, 256], 24)
    return [(b.ids, b.lengths) for b in batches]


def test_export_matches_torch(entries: dict[str, ModelEntry], cache: Path) -> None:
    entry = entries["minilm"]
    path = export_entry(entry, cache)
    model = load_served_model(entry)
    batches = _batches(entry, 96)
    # Shapes the export never saw: one row, two tokens; padding rows (length 0).
    ids = np.zeros((3, 2), dtype=np.int32)
    ids[0] = [101, 102]
    batches.append((ids, np.array([2, 0, 0], dtype=np.int32)))
    # A length-1 input (under the export's example length) and a length-1 row.
    batches.append((np.array([[101], [0]], np.int32), np.array([1, 0], np.int32)))
    ids = np.zeros((4, 5), dtype=np.int32)
    ids[0], ids[1, 0], ids[3, :3] = [101, 2023, 2003, 1037, 102], 101, [101, 7, 102]
    batches.append((ids, np.array([5, 1, 0, 3], dtype=np.int32)))
    max_diff, min_cos = compare_with_torch(model, path, batches)
    print(
        f"onnxruntime vs torch (minilm): max |diff| {max_diff:.2e}, min cos {min_cos}"
    )
    assert min_cos >= 0.9999
    assert max_diff < 1e-4


def test_export_is_cached_by_fingerprint(
    entries: dict[str, ModelEntry], cache: Path
) -> None:
    entry = entries["minilm"]
    first = export_entry(entry, cache)
    mtime = first.stat().st_mtime_ns
    assert export_entry(entry, cache) == first
    assert first.stat().st_mtime_ns == mtime
    cls_pooled = dataclasses.replace(entry, pooling="cls")
    assert model_fingerprint(cls_pooled) != model_fingerprint(entry)


def test_onnx_backend_matches_torch_backend(
    entries: dict[str, ModelEntry], cache: Path
) -> None:
    entry = entries["intent"]
    onnx = OnnxRuntimeBackend("cpu", threads=2, cache=cache)
    onnx.load(entry)
    torch_backend = TorchBackend("cpu")
    torch_backend.load(entry)
    assert onnx.width("intent") == torch_backend.width("intent") == 157
    for ids, lengths in _batches(entry, 64):
        got = onnx.run("intent", ids, lengths)
        want = torch_backend.run("intent", ids, lengths)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_onnx_backend_selection() -> None:
    backend = create_backend("onnxruntime", "cpu")
    assert backend.name == "onnxruntime" and backend.device == "cpu"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(BackendError, match="CUDA execution provider"):
            create_backend("onnxruntime", "cuda")


def test_onnx_backend_rejects_unknown_model() -> None:
    backend = OnnxRuntimeBackend("cpu", threads=1)
    with pytest.raises(BackendError, match="not loaded"):
        backend.width("nope")


def test_onnx_backend_refuses_what_the_model_cannot_encode(
    tiny: ModelEntry, cache: Path
) -> None:
    """Ids outside the vocabulary and lengths over the position table fail
    the batch with the reason, as on torch, never a wrong answer (onnxruntime's
    Gather reads a negative id from the end of the table) or a kernel error."""
    onnx = OnnxRuntimeBackend("cpu", threads=1, cache=cache)
    onnx.load(tiny)
    lengths = np.array([3, 0], dtype=np.int32)
    for bad in (-5, 1000):  # tiny: 1,000 ids
        ids = np.array([[101, bad, 102], [0, 0, 0]], dtype=np.int32)
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, 1000\)"):
            onnx.run("tiny", ids, lengths)
    too_long = np.ones((1, 65), dtype=np.int32)  # tiny: 64 positions
    with pytest.raises(ValueError, match="65 is over the model's 64 positions"):
        onnx.run("tiny", too_long, np.array([65], dtype=np.int32))
    fits = np.ones((1, 64), dtype=np.int32)
    assert onnx.run("tiny", fits, np.array([64], dtype=np.int32)).shape == (1, 32)


def test_engines_starting_together_export_once(
    entries: dict[str, ModelEntry], tmp_path: Path
) -> None:
    """Two processes asking for the same uncached export: one exports, the
    other waits for its file (berth serve starts an engine per core)."""
    import json
    import subprocess
    import sys

    entry = json.dumps(dataclasses.asdict(entries["intent"]))
    code = (
        "import json, logging, sys\n"
        "from pathlib import Path\n"
        "from engine.build.onnx_export import export_entry\n"
        "from services.repository import ModelEntry\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "entry = ModelEntry(**json.loads(sys.argv[1]))\n"
        "print(export_entry(entry, Path(sys.argv[2])))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, entry, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    exported = [o for o in outputs if "exporting intent to ONNX" in o]
    assert len(exported) == 1, outputs  # the other waited (or, late, found it)
    paths = {o.strip().splitlines()[-1] for o in outputs}
    assert len(paths) == 1 and Path(paths.pop()).is_file()


def test_engines_starting_together_quantize_once(
    entries: dict[str, ModelEntry], tmp_path: Path
) -> None:
    """Two engines loading the same int8 model on onnxruntime at once: one
    quantizes, the other waits for its file (onnxruntime's quantizer writes
    beside the float32 file; two at once broke each other's files)."""
    import json
    import subprocess
    import sys

    entry = dataclasses.replace(entries["intent"], quantize="int8")
    export_entry(entry, tmp_path)  # the float32 file, as an earlier start left it
    code = (
        "import json, logging, sys\n"
        "from pathlib import Path\n"
        "from engine.onnx_backend import OnnxRuntimeBackend\n"
        "from services.repository import ModelEntry\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "entry = ModelEntry(**json.loads(sys.argv[1]))\n"
        "backend = OnnxRuntimeBackend('cpu', threads=1, cache=Path(sys.argv[2]))\n"
        "backend.load(entry)\n"
        "print(backend.model(entry.name).path)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(dataclasses.asdict(entry)),
             str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    quantized = [o for o in outputs if "-int8.onnx written in" in o]
    assert len(quantized) == 1, outputs  # the other waited (or, late, found it)
    paths = {o.strip().splitlines()[-1] for o in outputs}
    assert len(paths) == 1 and paths.pop().endswith("-int8.onnx")


def test_large_export_keeps_its_weights_beside_it_by_name(
    tiny: ModelEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model over the exporter's size threshold (1.5 GB) is saved with its
    weights as external data: that file must be named after the final .onnx
    (it was named after the temporary one, a hidden ``.…tmp.data`` file that
    a cleanup of leftovers would delete), and the export must still run."""
    import onnx
    import torch

    save = torch.onnx.ONNXProgram.save

    def save_external(self: torch.onnx.ONNXProgram, destination: str) -> None:
        save(self, destination, external_data=True)

    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", save_external)
    path = export_entry(tiny, tmp_path)
    graph = onnx.load(str(path), load_external_data=False)
    locations = {
        item.value
        for tensor in graph.graph.initializer
        for item in tensor.external_data
        if item.key == "location"
    }
    assert locations == {f"{path.name}.data"}
    assert (path.parent / f"{path.name}.data").is_file()
    assert not [p.name for p in path.parent.iterdir() if "tmp" in p.name]
    ids = np.array([[101, 7, 102], [101, 0, 0]], dtype=np.int32)
    model = load_served_model(tiny)
    diff, cos = compare_with_torch(model, path, [(ids, np.array([3, 1], np.int32))])
    assert diff < 1e-4 and cos > 0.9999
