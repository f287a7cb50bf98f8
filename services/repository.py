"""The model repository: one directory per model, each with a berth.json.

A repository looks like::

    model_repository/
      minilm/berth.json
      intent/berth.json
      intent/head.safetensors      (classifier weights: weight [C, H], bias [C])
      intent/labels.json           (list of C label names, index order)

``berth.json`` holds one :class:`ModelEntry`. ``checkpoint`` is a Hugging Face
checkpoint directory (config.json, *.safetensors, tokenizer.json), absolute or
relative to the entry's own directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The hard cap on tokens per text, whatever the model allows.
MAX_TOKENS_CAP = 1024
DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024)
TASKS = ("embed", "classify")
POOLINGS = ("mean", "cls")
QUANTIZE = ("none", "int8", "fp8")


class RepositoryError(ValueError):
    """The model repository or one of its entries is invalid."""


@dataclass
class ModelEntry:
    """One servable model, as written in ``<repo>/<name>/berth.json``."""

    name: str
    task: str  # "embed" or "classify"
    checkpoint: str
    pooling: str = "mean"
    # embed: default for the request's normalize option.
    # classify: normalize the pooled vector before the head (as the head was
    # trained on normalized embeddings).
    normalize: bool = True
    head: str | None = None  # classify: safetensors with weight/bias
    labels: str | None = None  # classify: JSON list of label names
    buckets: list[int] = field(default_factory=lambda: list(DEFAULT_BUCKETS))
    max_tokens: int = MAX_TOKENS_CAP
    # "auto": the measured-faster engine for the device (torch's fp16 CUDA
    # graphs on a GPU, onnxruntime on the CPU; engine/backends_by_model.py),
    # or a backend by name: torch, onnxruntime, tensorrt.
    backend: str = "auto"
    # "none", "int8" (CPU torch, onnxruntime, TensorRT) or "fp8" (CUDA torch);
    # calibrated on engine/data/calibration_texts.txt when the model loads.
    quantize: str = "none"
    # Filled in by load_repository, never written.
    root: str = ""

    def path(self, relative: str) -> Path:
        p = Path(relative)
        return p if p.is_absolute() else Path(self.root) / p

    @property
    def checkpoint_dir(self) -> Path:
        return self.path(self.checkpoint)

    @property
    def tokenizer_file(self) -> Path:
        return self.checkpoint_dir / "tokenizer.json"

    def label_names(self) -> list[str]:
        if self.labels is None:
            return []
        names = json.loads(self.path(self.labels).read_text())
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RepositoryError(f"{self.name}: labels must be a JSON list of strings")
        return names

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("root")
        return json.dumps(data, indent=2) + "\n"


def position_limit(checkpoint_dir: Path) -> int:
    """Tokens the checkpoint's position embeddings allow (RoBERTa keeps 2)."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    limit = int(config.get("max_position_embeddings", MAX_TOKENS_CAP))
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(config.get("pad_token_id", 1)) + 1
    return limit


def _check_types(entry: ModelEntry, config_file: Path) -> None:
    """Each field of the JSON as its type: "normalize": "false" is no False."""

    def refuse(key: str, must: str) -> None:
        value = getattr(entry, key)
        raise RepositoryError(f"{config_file}: {key} must be {must}, not {value!r}")

    def positive(n: object) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n > 0

    if not isinstance(entry.name, str) or not entry.name:
        refuse("name", "a non-empty string")
    for key in ("task", "checkpoint", "pooling", "backend", "quantize"):
        if not isinstance(getattr(entry, key), str):
            refuse(key, "a string")
    for key in ("head", "labels"):
        value = getattr(entry, key)
        if value is not None and not isinstance(value, str):
            refuse(key, "a path (a string) or null")
    if not isinstance(entry.normalize, bool):
        refuse("normalize", "true or false (a JSON boolean)")
    if not positive(entry.max_tokens):
        refuse("max_tokens", "a positive integer")
    if not isinstance(entry.buckets, list) or not all(map(positive, entry.buckets)):
        refuse("buckets", "a list of positive integers (sequence lengths)")


def load_entry(entry_dir: Path) -> ModelEntry:
    config_file = entry_dir / "berth.json"
    try:
        data = json.loads(config_file.read_text())
        entry = ModelEntry(**data, root=str(entry_dir.resolve()))
    except (OSError, TypeError, json.JSONDecodeError) as exc:
        raise RepositoryError(f"{config_file}: {exc}") from exc
    _check_types(entry, config_file)
    if entry.task not in TASKS:
        raise RepositoryError(f"{config_file}: task must be one of {TASKS}")
    if entry.pooling not in POOLINGS:
        raise RepositoryError(f"{config_file}: pooling must be one of {POOLINGS}")
    if entry.quantize not in QUANTIZE:
        raise RepositoryError(f"{config_file}: quantize must be one of {QUANTIZE}")
    if entry.task == "classify" and (entry.head is None or entry.labels is None):
        raise RepositoryError(f"{config_file}: a classify model needs head and labels")
    if not entry.tokenizer_file.is_file():
        raise RepositoryError(
            f"{config_file}: no tokenizer.json in {entry.checkpoint_dir}"
        )
    # The effective limit: our cap, the entry's own, the position embeddings.
    entry.max_tokens = min(
        MAX_TOKENS_CAP, entry.max_tokens, position_limit(entry.checkpoint_dir)
    )
    capped = sorted(b for b in set(entry.buckets) if b < entry.max_tokens)
    entry.buckets = [*capped, entry.max_tokens]
    return entry


def load_repository(root: Path | str) -> dict[str, ModelEntry]:
    """Every model under ``root``, by name."""
    root = Path(root)
    if not root.is_dir():
        raise RepositoryError(
            f"model repository {root} does not exist; build it with "
            "`berth build-models` or set --model-repository"
        )
    entries = {}
    for entry_dir in sorted(p for p in root.iterdir() if (p / "berth.json").is_file()):
        entry = load_entry(entry_dir)
        if entry.name in entries:
            raise RepositoryError(f"model {entry.name!r} is defined twice in {root}")
        entries[entry.name] = entry
    if not entries:
        raise RepositoryError(f"model repository {root} holds no berth.json entries")
    return entries
