"""The model repository: one directory per model, each with a berth.json.

A repository looks like::

    model_repository/
      minilm/berth.json
      intent/berth.json
      intent/head.safetensors      (classifier weights: weight [C, H], bias [C])
      intent/labels.json           (list of C label names, index order)

``berth.json`` holds one :class:`ModelEntry`. ``checkpoint`` is a Hugging Face
checkpoint directory (config.json, *.safetensors, tokenizer.json), absolute or
relative to the entry's own directory. A classify entry with neither head nor
labels serves the checkpoint's own ``*ForSequenceClassification`` head
(services/hf_classifier.py): its pooling, its id2label names.

A field is taken from, in order: ``berth.json`` where it is written there;
else the checkpoint's sentence-transformers configuration where it has one
(services/st_config.py: length, pooling, Dense layers, normalization,
lowercasing, prompts); else the field's default below.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from services import hf_classifier, st_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# The hard cap on tokens per text, whatever the model allows.
MAX_TOKENS_CAP = 1024
DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024)
# rerank: a cross-encoder (a one-label *ForSequenceClassification
# checkpoint) scoring (query, text) pairs.
TASKS = ("embed", "classify", "rerank")
# Several at once are written joined by "+" ("cls+mean"), and concatenated
# in that order, as sentence-transformers' Pooling does.
POOLINGS = ("mean", "cls", "max", "mean_sqrt_len", "weightedmean", "lasttoken")
QUANTIZE = ("none", "int8", "fp8")
# "auto" and engine/backend.py's BACKENDS (not imported: it imports this).
BACKENDS = ("auto", "torch", "torch-cuda", "torch-eager", "onnxruntime", "tensorrt")


class RepositoryError(ValueError):
    """The model repository or one of its entries is invalid."""


@dataclass
class ModelEntry:
    """One servable model, as written in ``<repo>/<name>/berth.json``."""

    name: str  # the entry's directory's name
    task: str  # one of TASKS
    checkpoint: str
    pooling: str = "mean"  # one of POOLINGS, or several joined by "+"
    # embed: default for the request's normalize option.
    # classify: normalize the embedding (pooled, through any Dense layers)
    # before the head (as the head was trained on normalized embeddings).
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
    # Tokens per text, 1..1024 (a sentence-transformers checkpoint's own
    # length where berth.json does not say); lowered to the checkpoint's
    # position limit.
    max_tokens: int = MAX_TOKENS_CAP
    # "auto": the measured-faster engine for the device (torch's fp16 CUDA
    # graphs on a GPU, onnxruntime on the CPU; engine/backends_by_model.py),
    # or a backend by name: torch, onnxruntime, tensorrt.
    backend: str = "auto"
    # "none", "int8" (CPU torch, onnxruntime, TensorRT) or "fp8" (CUDA torch);
    # calibrated on engine/data/calibration_texts.txt when the model loads.
    quantize: str = "none"
    # Lowercase each text before tokenizing (sentence-transformers'
    # do_lower_case: a Lowercase normalizer ahead of the tokenizer's own).
    lowercase: bool = False
    # Dense layers applied to the pooled vector, in order, in float32:
    # directories of sentence-transformers Dense modules (config.json,
    # model.safetensors), absolute or relative to the entry's directory.
    dense: list[str] = field(default_factory=list)
    # Prompts by name; the default one is prepended to every text.
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    # false: the prompt's tokens are left out of pooling.
    include_prompt: bool = True
    # The similarity function the checkpoint's authors name (cosine, dot,
    # euclidean, manhattan); kept in the entry, never applied by berth.
    similarity: str | None = None
    # embed: the embedding's default width, its first values (sentence-
    # transformers' truncate_dim); a call's options.dimensions wins.
    dimensions: int | None = None
    # Whether the checkpoint's sentence-transformers configuration is read.
    sentence_transformers: bool = True
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

    @property
    def prompt(self) -> str:
        """The prompt prepended to every text ("" for none)."""
        if self.default_prompt_name is None:
            return ""
        return self.prompts.get(self.default_prompt_name, "")

    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer as the gateway runs it."""
        return st_config.load_tokenizer(self.tokenizer_file, self.lowercase)

    def pooling_skip(self) -> int:
        """Leading tokens left out of pooling: the prompt's, where the entry
        says not to include it (0 otherwise)."""
        if self.include_prompt or not self.prompt:
            return 0
        return st_config.prompt_length(self.tokenizer(), self.prompt)

    def output_width(self) -> int:
        """An embedding's width: the hidden size per pooling mode, then
        each Dense layer's out_features."""
        width = checkpoint_shape(self.checkpoint_dir)[1]
        width *= len(self.pooling.split("+"))
        for directory in self.dense:
            width = st_config.read_dense(self.path(directory)).out_features
        return width

    @property
    def checkpoint_head(self) -> bool:
        """A classify entry without head and labels, or a rerank entry: the
        checkpoint's own ``*ForSequenceClassification`` head
        (services/hf_classifier.py)."""
        if self.task == "rerank":
            return True
        return self.task == "classify" and self.head is None and self.labels is None

    def token_type_offset(self) -> int:
        """How far the token ids of a pair's second text are moved (0: not
        at all). A rerank entry whose checkpoint embeds token types (BERT's
        type_vocab_size 2) sends token t of segment s as ``t + s * vocab``:
        its engines look both up in one table of ``types * vocab`` rows,
        each row the word's embedding plus its segment's
        (engine/architectures/bert.py), so no token type travels beside the
        ids. Checkpoints without token types (RoBERTa's single type, MPNet,
        ModernBERT, DistilBERT) get 0."""
        if self.task != "rerank":
            return 0
        config = json.loads((self.checkpoint_dir / "config.json").read_text())
        if int(config.get("type_vocab_size", 0) or 0) < 2:
            return 0
        return int(config["vocab_size"])

    def classifier(self) -> hf_classifier.CheckpointClassifier:
        """The checkpoint's own classifier (for a ``checkpoint_head`` entry)."""
        found = hf_classifier.read_classifier(self.checkpoint_dir)
        if found is None:
            raise RepositoryError(
                f"{self.name}: a classify model needs head and labels, or a "
                f"*ForSequenceClassification checkpoint ({self.checkpoint_dir} "
                "names none in config.json's architectures)"
            )
        return found

    def label_names(self) -> list[str]:
        if self.checkpoint_head:
            return self.classifier().labels
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
    """Tokens the checkpoint's positions allow: RoBERTa's first real token
    sits at pad_token_id + 1, MPNet's at 2 (transformers fixes its padding
    index at 1); ModernBERT's rotary positions stop at the maximum too."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    limit = int(config.get("max_position_embeddings", MAX_TOKENS_CAP))
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(config.get("pad_token_id", 1)) + 1
    elif config.get("model_type") == "mpnet":
        limit -= 2
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
    for key in ("normalize", "lowercase", "include_prompt", "sentence_transformers"):
        if not isinstance(getattr(entry, key), bool):
            refuse(key, "true or false (a JSON boolean)")
    if not isinstance(entry.dense, list) or not all(
        isinstance(d, str) for d in entry.dense
    ):
        refuse("dense", "a list of paths (strings)")
    if not isinstance(entry.prompts, dict) or not all(
        isinstance(v, str) for v in entry.prompts.values()
    ):
        refuse("prompts", "an object of prompt names to strings")
    for key in ("default_prompt_name", "similarity"):
        value = getattr(entry, key)
        if value is not None and not isinstance(value, str):
            refuse(key, "a string or null")
    if entry.dimensions is not None and not positive(entry.dimensions):
        refuse("dimensions", "a positive integer or null")
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
        ("backend", BACKENDS),
        ("quantize", QUANTIZE),
    ):
        value = getattr(entry, key)
        if value not in allowed:
            raise RepositoryError(
                f"{config_file}: {key} must be one of {', '.join(allowed)}, "
                f"not {value!r}"
            )
    if entry.task == "rerank" and (entry.head is not None or entry.labels is not None):
        raise RepositoryError(
            f"{config_file}: a rerank model scores with its checkpoint's own "
            "*ForSequenceClassification head: leave head and labels out"
        )
    if entry.task == "classify" and (entry.head is None) != (entry.labels is None):
        raise RepositoryError(
            f"{config_file}: a classify model needs both head and labels, or "
            "neither (the checkpoint's own *ForSequenceClassification head)"
        )
    if not entry.tokenizer_file.is_file():
        raise RepositoryError(
            f"{config_file}: no tokenizer.json in {entry.checkpoint_dir}"
        )
    if entry.checkpoint_head:
        _apply_checkpoint_head(entry, set(data), config_file)
    else:
        _apply_sentence_config(entry, set(data), config_file)
    _check_pipeline(entry, config_file)
    _check_dimensions(entry, "dimensions" in data, config_file)
    if entry.task == "classify" and not entry.checkpoint_head:
        _check_classifier(entry, config_file)
    try:
        positions = position_limit(entry.checkpoint_dir)
    except (OSError, ValueError, TypeError) as exc:
        raise RepositoryError(
            f"{config_file}: checkpoint {entry.checkpoint_dir}: config.json: {exc}"
        ) from exc
    # The effective limit: the entry's own (at most our cap) or the
    # checkpoint's sentence-transformers length, within the position
    # embeddings.
    entry.max_tokens = min(entry.max_tokens, positions)
    entry.buckets = _capped(entry.buckets, entry.max_tokens)
    if entry.gpu_buckets is not None:
        entry.gpu_buckets = _capped(entry.gpu_buckets, entry.max_tokens)
    return entry


def _apply_sentence_config(
    entry: ModelEntry, explicit: set[str], config_file: Path
) -> None:
    """The checkpoint's sentence-transformers configuration, for each field
    berth.json does not write itself (``sentence_transformers``: false reads
    none)."""
    if not entry.sentence_transformers:
        return
    try:
        config = st_config.read_sentence_config(entry.checkpoint_dir)
    except st_config.SentenceConfigError as exc:
        raise RepositoryError(
            f"{config_file}: checkpoint {entry.checkpoint_dir}: {exc} (set "
            '"sentence_transformers": false to serve the bare encoder instead)'
        ) from exc
    if config is None:
        return
    for key, value in config.entry_fields().items():
        if key not in explicit:
            setattr(entry, key, value)
    if "max_tokens" not in explicit:
        entry.max_tokens = min(entry.max_tokens, MAX_TOKENS_CAP)


def _apply_checkpoint_head(
    entry: ModelEntry, explicit: set[str], config_file: Path
) -> None:
    """The checkpoint's own classifier decides what comes after the encoder:
    its pooling, no normalization, no Dense layers; its sentence-transformers
    configuration, if any, is not read."""
    try:
        classifier = entry.classifier()
    except (RepositoryError, hf_classifier.ClassifierConfigError) as exc:
        raise RepositoryError(f"{config_file}: {exc}") from exc
    for key in ("pooling", "normalize", "dense"):
        if key in explicit:
            raise RepositoryError(
                f"{config_file}: {key} is set by the checkpoint's own "
                f"{classifier.architecture} head; leave it out of berth.json "
                "(or give head and labels to serve a head of your own)"
            )
    if entry.task == "rerank" and len(classifier.labels) != 1:
        raise RepositoryError(
            f"{config_file}: a rerank model gives one score per pair, and "
            f"{classifier.architecture} {entry.checkpoint_dir} has "
            f"{len(classifier.labels)} labels ({', '.join(classifier.labels)}); "
            'serve it with "task": "classify"'
        )
    entry.pooling = classifier.pooling
    entry.normalize = False


def _check_pipeline(entry: ModelEntry, config_file: Path) -> None:
    """Pooling modes, prompts and Dense layers that berth can serve."""
    unknown = [m for m in entry.pooling.split("+") if m not in POOLINGS]
    if unknown:
        raise RepositoryError(
            f"{config_file}: pooling must be one of {', '.join(POOLINGS)}, or "
            f"several joined by '+', not {entry.pooling!r}"
        )
    if entry.default_prompt_name not in (None, *entry.prompts):
        raise RepositoryError(
            f"{config_file}: default_prompt_name {entry.default_prompt_name!r} "
            f"is not one of the prompts {sorted(entry.prompts)}"
        )
    if entry.similarity not in (None, *st_config.SIMILARITIES):
        raise RepositoryError(
            f"{config_file}: similarity must be one of "
            f"{', '.join(st_config.SIMILARITIES)} or null, not {entry.similarity!r}"
        )
    if not entry.dense:
        return
    try:
        width = checkpoint_shape(entry.checkpoint_dir)[1]
        width *= len(entry.pooling.split("+"))
        for directory in entry.dense:
            layer = st_config.read_dense(entry.path(directory))
            if layer.in_features != width:
                raise st_config.SentenceConfigError(
                    f"Dense {layer.directory} takes {layer.in_features} features, "
                    f"the step before it gives {width}"
                )
            width = layer.out_features
    except (OSError, ValueError) as exc:
        raise RepositoryError(f"{config_file}: dense: {exc}") from exc


def _check_dimensions(entry: ModelEntry, written: bool, config_file: Path) -> None:
    """An embed entry's default width, within its embeddings'. Another task's
    is refused when berth.json writes it, and dropped when it is the
    checkpoint's truncate_dim (it shapes embeddings, not a head's input)."""
    if entry.dimensions is None:
        return
    if entry.task != "embed":
        if written:
            raise RepositoryError(
                f"{config_file}: dimensions applies to embed models, not {entry.task}"
            )
        entry.dimensions = None
        return
    width = entry.output_width()
    if entry.dimensions > width:
        raise RepositoryError(
            f"{config_file}: dimensions {entry.dimensions} is over the "
            f"embedding's width, {width}"
        )


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
