"""Export a served model (encoder, pooling, head) to ONNX, cached on disk.

The graph takes ``input_ids`` int32 [batch, length] and ``lengths`` int32
[batch] and returns ``output`` float32 [batch, width], exactly as a backend's
``run``; batch and length are dynamic axes, so one file serves every bucket
(TensorRT then builds one optimization profile per bucket from it).

Files are cached under ``$BERTH_CACHE_DIR`` (default ``~/.cache/berth``) by a
fingerprint of everything that shapes the graph: the checkpoint's config and
weights, the head, the entry's task/pooling/normalize, its Dense layers, the
prompt tokens left out of pooling, and the opset. A large
model's weights (over the exporter's threshold, 1.5 GB in torch 2.13) are
external data, ``<file>.onnx.data`` beside it, named in the graph.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from engine import settings as engine_settings
from engine.model import ServedModel, load_served_model
from services import files
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")

OPSET = 18
INPUT_NAMES = ("input_ids", "lengths")
OUTPUT_NAME = "output"
MAX_BATCH = 65536


def cache_dir() -> Path:
    """BERTH_CACHE_DIR (engine/settings.py)."""
    return engine_settings.current().cache_dir


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(entry: ModelEntry) -> str:
    """sha256 over the entry's graph-shaping fields and the files it reads."""
    parts = {
        "task": entry.task,
        "pooling": entry.pooling,
        "normalize": entry.normalize,
        "opset": OPSET,
        "files": {},
    }
    files = sorted(entry.checkpoint_dir.glob("*.safetensors"))
    files.append(entry.checkpoint_dir / "config.json")
    if entry.head is not None:
        files.append(entry.path(entry.head))
    parts["files"] = {p.name: file_sha256(p) for p in files if p.is_file()}
    # Only where the entry has them: other models keep their fingerprints.
    if entry.dense:
        parts["dense"] = [
            [
                file_sha256(entry.path(d) / n)
                for n in ("config.json", "model.safetensors")
            ]
            for d in entry.dense
        ]
    skip = entry.pooling_skip()
    if skip:
        parts["skip"] = skip
    if entry.checkpoint_head:
        parts["head"] = "checkpoint"
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def export_onnx(model: ServedModel, path: Path, max_length: int) -> Path:
    """Write ``model`` (float32, CPU) to ``path`` with dynamic batch and length."""
    start = time.perf_counter()
    ids = torch.ones((2, min(8, max_length)), dtype=torch.int32)
    lengths = torch.tensor([ids.shape[1], 3], dtype=torch.int32)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    length = torch.export.Dim("length", min=2, max=max_length)
    dynamic = {"input_ids": {0: batch, 1: length}, "lengths": {0: batch}}
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written under its final name in a private directory, then moved: the
    # graph names its external data file (if any) after its own file name.
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    log.info("exporting %s to ONNX (opset %d)", model.name, OPSET)
    # The exporter's own deprecation notices are not ours to fix.
    try:
        with warnings.catch_warnings(), torch.inference_mode(False):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                model,
                (ids, lengths),
                input_names=list(INPUT_NAMES),
                output_names=[OUTPUT_NAME],
                dynamic_shapes=dynamic,
                opset_version=OPSET,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            if program is None:  # only the legacy exporter returns None
                raise RuntimeError("torch.onnx.export returned no program")
            program.save(str(staging / path.name))
        # External data first, the graph last: a reader checks for the graph.
        parts = sorted(staging.iterdir(), key=lambda f: f.name == path.name)
        files.move_into_place(parts, path.parent)
        files.seal(path, [path.parent / p.name for p in parts if p.name != path.name])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info(
        "exported %s to %s (%.1f MB) in %.1f s",
        model.name,
        path,
        path.stat().st_size / 1e6,
        time.perf_counter() - start,
    )
    return path


def export_entry(entry: ModelEntry, directory: Path | None = None) -> Path:
    """The entry's ONNX file, exported once per fingerprint and then reused."""
    directory = directory or cache_dir()
    fingerprint = model_fingerprint(entry)
    path = directory / "onnx" / f"{entry.name}-{fingerprint[:16]}.onnx"
    if files.verified(path, "ONNX export"):
        log.info("ONNX for %s found in cache: %s", entry.name, path)
        return path
    # Engines starting together (`berth serve` runs one per core) export once:
    # the first takes the lock, the others wait for its file.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's ONNX export of %s", entry.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if files.verified(path, "ONNX export"):
            log.info("ONNX for %s exported by another process: %s", entry.name, path)
            return path
        model = load_served_model(entry, "cpu", torch.float32)
        return export_onnx(model, path, entry.max_tokens)


def compare_with_torch(
    model: ServedModel,
    onnx_path: Path,
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
) -> tuple[float, float]:
    """(max |diff|, min row cosine) of onnxruntime (CPU) against ``model``.

    Rows of length 0 (batch padding) count in the difference, not the cosine.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    worst_diff, worst_cos = 0.0, 1.0
    for ids, lengths in batches:
        got = session.run([OUTPUT_NAME], {"input_ids": ids, "lengths": lengths})[0]
        with torch.inference_mode():
            want = model(torch.from_numpy(ids), torch.from_numpy(lengths)).numpy()
        worst_diff = max(worst_diff, float(np.abs(got - want).max()))
        real = lengths > 0
        got, want = got[real], want[real]
        norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
        cos = (got * want).sum(axis=1) / np.maximum(norms, 1e-12)
        worst_cos = min([worst_cos, *cos.tolist()])
    return worst_diff, worst_cos
