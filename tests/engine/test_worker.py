"""``python -m engine``, the worker process: what its flags accept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_an_unknown_model_in_models_is_named(repository: Path) -> None:
    """--models naming a model the repository lacks stops the worker with
    the name, the flag and what the repository has (not a bare KeyError)."""
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--models", "minilm,nope", "--port", "0",
         "--metrics-port", "0", "--model-repository", str(repository)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "--models" in last and "'nope'" in last and "intent" in last, last


def test_each_model_is_warmed_up_for_its_own_device() -> None:
    """An engine may serve one model on the CPU (onnxruntime) and another on
    a GPU: each gets its own backend's warm-up, a CUDA graph per batch shape
    on the GPU, one small eager batch per length on the CPU."""
    from engine.__main__ import warmup_shapes
    from engine.cuda.graphs import bucket_shapes
    from services.repository import ModelEntry

    entry = ModelEntry(name="m", task="embed", checkpoint="/x", buckets=[16, 64])
    assert warmup_shapes("cpu", entry, 8, 512) == [(1, 16), (1, 64)]
    on_gpu = warmup_shapes("cuda:0", entry, 8, 512)
    assert on_gpu == bucket_shapes([16, 64], 8, 512)
    assert (8, 16) in on_gpu and len(on_gpu) > 2


def test_a_model_on_the_cpu_is_served_in_its_buckets() -> None:
    """gpu_buckets are a GPU engine's (tests/gpu has that side): a model this
    engine runs on the CPU keeps the buckets its padding was tuned for."""
    from engine.__main__ import as_served
    from engine.backends_by_model import create_model_router
    from services.repository import ModelEntry

    entry = ModelEntry(
        name="m", task="embed", checkpoint="/x", backend="torch",
        buckets=[12, 24, 512], gpu_buckets=[16, 512],
    )  # fmt: skip
    router = create_model_router({"m": entry}, "torch", "cpu")
    assert as_served({"m": entry}, router)["m"].buckets == [12, 24, 512]
