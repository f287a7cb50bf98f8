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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# The hard cap on tokens per text, whatever the model allows.
MAX_TOKENS_CAP = 1024
DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024)
TASKS = ("embed", "classify")
POOLINGS = ("mean", "cls")
QUANTIZE = ("none", "int8", "fp8")
# "auto" and engine/backend.py's BACKENDS (not imported: it imports this).
BACKENDS = ("auto", "torch", "torch-cuda", "torch-eager", "onnxruntime", "tensorrt")


class RepositoryError(ValueError):
    """The model repository or one of its entries is invalid."""


@dataclass
class ModelEntry:
    """One servable model, as written in ``<repo>/<name>/berth.json``."""

    name: str  # the entry's directory's name
    task: str  # "embed" or "classify"
    checkpoint: str
    pooling: str = "mean"
    # embed: default for the request's normalize option.
    # classify: normalize the pooled vector before the head (as the head was
    # trained on normalized embeddings).
    normalize: bool = True
    head: str | None = None  # classify: safetensors with weight/bias
    labels: str | None = None  # classify: JSON list of label names
    # Padded sequence lengths the batcher groups texts by (positive; read
    # sorted, those at or over the limit dropped, the limit itself added).
    buckets: list[int] = field(default_factory=lambda: list(DEFAULT_BUCKETS))
    # The buckets when the model's engines run on GPUs (null: ``buckets``).
    # There a batch of a few thousand tokens costs little more than one of
    # a few (a forward is ~90 latency-bound kernels), so fewer, fuller
    # batches beat less padding; on a CPU padding is what costs. An engine
    # whose backend runs the model on a GPU uses them; batchers and gateways
    # do when started with --gpu-buckets (`berth serve` passes it when its
    # engines are GPUs).
    gpu_buckets: list[int] | None = None
    # Tokens per text, 1..1024; lowered to the checkpoint's position limit.
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
        labels_file = self.path(self.labels)
        try:
            names = json.loads(labels_file.read_text())
        except (OSError, ValueError) as exc:
            raise RepositoryError(f"{self.name}: labels {labels_file}: {exc}") from exc
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RepositoryError(
                f"{self.name}: labels {labels_file} must be a JSON list of strings"
            )
        return names

    def for_gpu(self) -> ModelEntry:
        """This entry as its engines on GPUs serve it: gpu_buckets as buckets."""
        if self.gpu_buckets is None:
            return self
        return replace(self, buckets=list(self.gpu_buckets))

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("root")
        return json.dumps(data, indent=2) + "\n"


def head_classes(head_file: Path) -> int:
    """Rows of a classifier head's ``weight`` [C, H], read from the header."""
    from safetensors import safe_open

    with safe_open(str(head_file), framework="numpy") as f:
        names = f.keys()
        if "weight" not in names:
            raise ValueError("no tensor 'weight' [C, H]")
        shape = f.get_slice("weight").get_shape()
    if len(shape) != 2:
        raise ValueError(f"weight is {list(shape)}, not [C, H]")
    return int(shape[0])


def _check_classifier(entry: ModelEntry, config_file: Path) -> None:
    """head and labels exist, and there is one label per class of the head."""
    assert entry.head is not None and entry.labels is not None
    head_file = entry.path(entry.head)
    try:
        classes = head_classes(head_file)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise RepositoryError(
            f"{config_file}: head {entry.head!r} ({head_file}) is not a "
            f"safetensors file with weight [C, H]: {exc}"
        ) from exc
    try:
        names = entry.label_names()
    except RepositoryError as exc:
        raise RepositoryError(f"{config_file}: {exc}") from exc
    if len(names) != classes:
        raise RepositoryError(
            f"{config_file}: labels {entry.labels!r} lists {len(names)} names for "
            f"the {classes} classes of head {entry.head!r}"
        )


def checkpoint_shape(checkpoint_dir: Path) -> tuple[int, int]:
    """Vocabulary size and hidden width (DistilBERT: ``dim``) of a checkpoint."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    width = config.get("hidden_size", config.get("dim", 0))
    return int(config.get("vocab_size", 0)), int(width)


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
    if not positive(entry.max_tokens) or entry.max_tokens > MAX_TOKENS_CAP:
        refuse("max_tokens", f"a positive integer, at most {MAX_TOKENS_CAP}")
    if not isinstance(entry.buckets, list) or not all(map(positive, entry.buckets)):
        refuse("buckets", "a list of positive integers (sequence lengths)")
    if entry.gpu_buckets is not None and (
        not isinstance(entry.gpu_buckets, list)
        or not all(map(positive, entry.gpu_buckets))
    ):
        refuse("gpu_buckets", "null or a list of positive integers (sequence lengths)")


def load_entry(entry_dir: Path) -> ModelEntry:
    config_file = entry_dir / "berth.json"
    try:
        data = json.loads(config_file.read_text())
        entry = ModelEntry(**data, root=str(entry_dir.resolve()))
    except (OSError, TypeError, json.JSONDecodeError) as exc:
        raise RepositoryError(f"{config_file}: {exc}") from exc
    _check_types(entry, config_file)
    for key, allowed in (
        ("task", TASKS),
        ("pooling", POOLINGS),
        ("backend", BACKENDS),
        ("quantize", QUANTIZE),
    ):
        value = getattr(entry, key)
        if value not in allowed:
            raise RepositoryError(
                f"{config_file}: {key} must be one of {', '.join(allowed)}, "
                f"not {value!r}"
            )
    if entry.task == "classify" and (entry.head is None or entry.labels is None):
        raise RepositoryError(f"{config_file}: a classify model needs head and labels")
    if not entry.tokenizer_file.is_file():
        raise RepositoryError(
            f"{config_file}: no tokenizer.json in {entry.checkpoint_dir}"
        )
    if entry.task == "classify":
        _check_classifier(entry, config_file)
    try:
        positions = position_limit(entry.checkpoint_dir)
    except (OSError, ValueError, TypeError) as exc:
        raise RepositoryError(
            f"{config_file}: checkpoint {entry.checkpoint_dir}: config.json: {exc}"
        ) from exc
    # The effective limit: the entry's own (at most our cap), the position
    # embeddings.
    entry.max_tokens = min(entry.max_tokens, positions)
    entry.buckets = _capped(entry.buckets, entry.max_tokens)
    if entry.gpu_buckets is not None:
        entry.gpu_buckets = _capped(entry.gpu_buckets, entry.max_tokens)
    return entry


def _capped(buckets: list[int], max_tokens: int) -> list[int]:
    """Sorted, those at or over the limit dropped, the limit itself added."""
    return [*sorted(b for b in set(buckets) if b < max_tokens), max_tokens]


def load_repository(root: Path | str, gpu: bool = False) -> dict[str, ModelEntry]:
    """Every model under ``root``, by name; ``gpu``: as served by engines on
    GPUs (each entry's gpu_buckets, where it has them, as its buckets)."""
    root = Path(root)
    if not root.is_dir():
        raise RepositoryError(
            f"model repository {root} does not exist; build it with "
            "`berth build-models` or set --model-repository"
        )
    entries: dict[str, ModelEntry] = {}
    for entry_dir in sorted(p for p in root.iterdir() if (p / "berth.json").is_file()):
        entry = load_entry(entry_dir)
        config_file = entry_dir / "berth.json"
        if entry.name in entries:
            first = Path(entries[entry.name].root) / "berth.json"
            raise RepositoryError(
                f"{config_file}: name {entry.name!r} is taken by {first}; "
                "each model needs a name of its own"
            )
        if entry.name != entry_dir.name:
            raise RepositoryError(
                f"{config_file}: name must be its directory's, {entry_dir.name!r}, "
                f"not {entry.name!r} (<repository>/<name>/berth.json)"
            )
        entries[entry.name] = entry.for_gpu() if gpu else entry
    if not entries:
        raise RepositoryError(f"model repository {root} holds no berth.json entries")
    return entries
