"""Model repository loading: every field of berth.json is checked, and a bad
one is refused with the file, the field and what it must be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save as save_safetensors

from services.cli.default_models import minilm_checkpoint
from services.repository import RepositoryError, load_repository


def write_entry(root: Path, **fields: Any) -> Path:
    checkpoint = str(minilm_checkpoint())
    data = {"name": "m", "task": "embed", "checkpoint": checkpoint, **fields}
    (root / "m").mkdir(parents=True)
    config = root / "m" / "berth.json"
    config.write_text(json.dumps(data))
    return config


def test_a_good_entry_loads(tmp_path: Path) -> None:
    write_entry(tmp_path, normalize=False, buckets=[16, 8], max_tokens=32)
    entry = load_repository(tmp_path)["m"]
    assert entry.normalize is False
    assert entry.buckets == [8, 16, 32] and entry.max_tokens == 32


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("normalize", "false"),  # a string: it would read as True
        ("normalize", 0),
        ("buckets", 32),
        ("buckets", ["32", "64"]),
        ("buckets", [0, 32]),
        ("buckets", [-16]),
        ("buckets", [16.5]),
        ("max_tokens", "512"),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("name", ""),
        ("name", 7),
        ("checkpoint", None),
        ("head", 3),
        ("backend", ["torch"]),
    ],
)
def test_a_bad_field_is_refused_by_name(
    tmp_path: Path, field: str, value: object
) -> None:
    refused(tmp_path, field, value)


def refused(tmp_path: Path, field: str, value: object) -> str:
    """The error of an entry with ``field`` set to value: it names the file
    and the field."""
    config = write_entry(tmp_path, **{field: value})
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    message = str(info.value)
    assert str(config) in message and field in message, message
    return message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("task", "embedd"),
        ("pooling", "maximum"),
        ("quantize", "int4"),
        ("backend", "onnx"),  # a typo served on the engine's own backend
        ("max_tokens", 4096),  # over the 1024 cap: it served 512, silently
    ],
)
def test_a_bad_value_is_refused_with_the_value(
    tmp_path: Path, field: str, value: object
) -> None:
    message = refused(tmp_path, field, value)
    assert repr(value) in message, message


def test_every_backend_is_accepted(tmp_path: Path) -> None:
    from engine.backend import BACKENDS

    for backend in ("auto", *BACKENDS):
        write_entry(tmp_path / backend, backend=backend)
        assert load_repository(tmp_path / backend)["m"].backend == backend


def test_a_directory_not_named_after_its_model_is_refused(tmp_path: Path) -> None:
    config = write_entry(tmp_path)
    config.parent.rename(tmp_path / "other")
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "other" / "berth.json") in message, message
    assert "'m'" in message and "'other'" in message, message


def test_a_name_used_twice_names_both_files(tmp_path: Path) -> None:
    first = write_entry(tmp_path)
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "berth.json").write_text(first.read_text())  # a copy
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    message = str(info.value)
    assert str(first) in message, message
    assert str(tmp_path / "n" / "berth.json") in message, message


def test_a_checkpoint_without_config_json_is_named(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    tokenizer = minilm_checkpoint() / "tokenizer.json"
    (checkpoint / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    config = write_entry(tmp_path / "repo", checkpoint="../../checkpoint")
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path / "repo")
    message = str(info.value)
    assert str(config) in message and "config.json" in message, message


def write_classifier(root: Path, classes: int, labels: object, **fields: Any) -> Path:
    """A classify entry beside a real head [classes, 384] and labels.json
    (relative paths: they resolve against the entry's own directory)."""
    config = write_entry(
        root, task="classify", head="head.safetensors", labels="labels.json", **fields
    )
    tensors = {
        "weight": np.zeros((classes, 384), np.float32),
        "bias": np.zeros(classes, np.float32),
    }
    (config.parent / "head.safetensors").write_bytes(save_safetensors(tensors))
    if labels is not None:
        text = labels if isinstance(labels, str) else json.dumps(labels)
        (config.parent / "labels.json").write_text(text)
    return config


def test_a_classifier_loads(tmp_path: Path) -> None:
    write_classifier(tmp_path, 3, ["a", "b", "c"])
    assert load_repository(tmp_path)["m"].label_names() == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        (["a", "b"], "2 names for the 3 classes"),
        (None, "labels.json"),  # missing
        ("['a', 'b', 'c']", "labels.json"),  # not JSON
        ([1, 2, 3], "list of strings"),
    ],
)
def test_a_classifier_with_bad_labels_is_refused(
    tmp_path: Path, labels: object, expected: str
) -> None:
    """Refused when the repository loads, naming the entry, not later in
    an engine (or as a traceback in the gateway)."""
    config = write_classifier(tmp_path, 3, labels)
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    message = str(info.value)
    assert str(config) in message and expected in message, message


def test_a_classifier_without_its_head_is_refused(tmp_path: Path) -> None:
    config = write_classifier(tmp_path, 3, ["a", "b", "c"])
    (config.parent / "head.safetensors").unlink()
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    message = str(info.value)
    assert str(config) in message and "head.safetensors" in message, message


def test_gpu_buckets_are_capped_like_buckets_and_served_on_gpus(
    tmp_path: Path,
) -> None:
    write_entry(tmp_path, buckets=[12, 24], gpu_buckets=[64, 16, 2048], max_tokens=128)
    cpu = load_repository(tmp_path)["m"]
    assert cpu.buckets == [12, 24, 128] and cpu.gpu_buckets == [16, 64, 128]
    gpu = load_repository(tmp_path, gpu=True)["m"]
    assert gpu.buckets == [16, 64, 128]
    assert gpu.for_gpu() == gpu  # (the swap is idempotent)


def test_without_gpu_buckets_gpus_serve_the_buckets(tmp_path: Path) -> None:
    write_entry(tmp_path, buckets=[12, 24], max_tokens=128)
    assert load_repository(tmp_path, gpu=True)["m"].buckets == [12, 24, 128]


@pytest.mark.parametrize("value", [32, ["16"], [0, 32], [16.5]])
def test_bad_gpu_buckets_are_refused_by_name(tmp_path: Path, value: object) -> None:
    config = write_entry(tmp_path, gpu_buckets=value)
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    assert str(config) in str(info.value) and "gpu_buckets" in str(info.value)
