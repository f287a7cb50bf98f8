"""A checkpoint's sentence-transformers configuration, read as berth serves it.

A checkpoint saved by sentence-transformers has ``modules.json``: the modules
its ``SentenceTransformer.encode`` runs, in order. berth serves the pipeline
Transformer -> Pooling -> Dense (any number) -> Normalize (optional), and
reads each module's own configuration:

- Transformer (``sentence_bert_config.json``, or an older
  ``sentence_<model>_config.json``): ``max_seq_length`` and ``do_lower_case``.
  Without ``max_seq_length``, the length is the tokenizer's
  ``model_max_length`` (``tokenizer_config.json``), as the Transformer module
  reads it.
- Pooling (``<path>/config.json``): the modes (``pooling_mode``, or the older
  ``pooling_mode_*`` booleans) and ``include_prompt``.
- Dense (``<path>/config.json`` and ``<path>/model.safetensors``): the layer's
  shape, bias and activation.
- Normalize: embeddings at unit length.
- ``config_sentence_transformers.json``: ``prompts``, ``default_prompt_name``,
  ``similarity_fn_name`` and ``truncate_dim`` (the embedding's default
  width: its first ``truncate_dim`` values).

Anything berth would serve differently from sentence-transformers (another
module, a module in another place, a chat template, pickled Dense weights)
raises :class:`SentenceConfigError` naming the file and the setting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MODULES_FILE = "modules.json"
MODEL_CONFIG_FILE = "config_sentence_transformers.json"
TRANSFORMER_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
# berth's pooling modes, in the order sentence-transformers' older boolean
# keys concatenate them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
# sentence-transformers' name of each mode -> berth's.
ST_MODES = {
    "cls": "cls",
    "max": "max",
    "mean": "mean",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weightedmean",
    "lasttoken": "lasttoken",
}
LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# A Dense module's activation_function (a torch.nn class) -> berth's name.
ACTIVATIONS = {
    "Identity": "identity",
    "Tanh": "tanh",
    "ReLU": "relu",
    "GELU": "gelu",
    "Sigmoid": "sigmoid",
    "SiLU": "silu",
}
SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")
# The modules berth serves, by class name.
MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
# The output a module reads and writes (Dense, Normalize): berth serves the
# sentence embedding only.
SENTENCE_EMBEDDING = "sentence_embedding"


class SentenceConfigError(ValueError):
    """A sentence-transformers configuration berth cannot serve as written."""


@dataclass(frozen=True)
class DenseConfig:
    """One Dense module: activation(x @ weight.T + bias) [+ the residual]."""

    directory: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a key of ACTIVATIONS' values
    residual: bool  # use_residual: + x, or + x @ residual.T

    @property
    def weights(self) -> Path:
        return self.directory / "model.safetensors"


@dataclass(frozen=True)
class SentenceConfig:
    """What a checkpoint's sentence-transformers modules define."""

    max_tokens: int | None  # None: the module sets no length
    lowercase: bool
    pooling: str  # modes joined by "+", in concatenation order
    include_prompt: bool
    dense: list[str] = field(default_factory=list)  # module directories
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity: str | None = None
    dimensions: int | None = None  # truncate_dim

    def entry_fields(self) -> dict[str, Any]:
        """The model entry's fields this configuration gives a value."""
        fields: dict[str, Any] = {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "lowercase": self.lowercase,
            "include_prompt": self.include_prompt,
            "dense": list(self.dense),
            "prompts": dict(self.prompts),
            "default_prompt_name": self.default_prompt_name,
            "similarity": self.similarity,
        }
        if self.max_tokens is not None:
            fields["max_tokens"] = self.max_tokens
        if self.dimensions is not None:
            fields["dimensions"] = self.dimensions
        return fields


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SentenceConfigError(f"{path}: {exc}") from exc


def _object(path: Path) -> dict[str, Any]:
    """A config file that holds one JSON object ({} when the file is absent)."""
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise SentenceConfigError(f"{path} must hold a JSON object")
    return data


def read_sentence_config(checkpoint: Path) -> SentenceConfig | None:
    """The checkpoint's configuration, or None when it has no modules.json."""
    modules_file = checkpoint / MODULES_FILE
    if not modules_file.is_file():
        return None
    modules = _modules(modules_file)
    kinds = [kind for kind, _ in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or "Normalize" in kinds[2:-1]:
        raise SentenceConfigError(
            f"{modules_file}: berth serves Transformer, Pooling, any Dense, then "
            f"an optional Normalize, in that order; this lists {kinds}"
        )
    if modules[0][1] != "":
        raise SentenceConfigError(
            f"{modules_file}: the Transformer module is in {modules[0][1]!r}; berth "
            'reads it from the checkpoint directory itself (path "")'
        )
    hidden = _hidden_size(checkpoint)
    max_tokens, lowercase = _transformer(checkpoint)
    modes, include_prompt = _pooling(checkpoint / modules[1][1], hidden)
    width = hidden * len(modes)
    dense = []
    for kind, path in modules[2:]:
        if kind == "Dense":
            layer = read_dense(checkpoint / path)
            if layer.in_features != width:
                raise SentenceConfigError(
                    f"{layer.directory / 'config.json'}: in_features "
                    f"{layer.in_features}, but the module before it gives {width}"
                )
            width = layer.out_features
            dense.append(str(layer.directory))
        else:
            _normalize(checkpoint / path)
    prompts, default_prompt, similarity, dimensions = _model_config(
        checkpoint / MODEL_CONFIG_FILE
    )
    return SentenceConfig(
        max_tokens=max_tokens,
        lowercase=lowercase,
        pooling="+".join(modes),
        include_prompt=include_prompt,
        dense=dense,
        normalize=kinds[-1] == "Normalize",
        prompts=prompts,
        default_prompt_name=default_prompt,
        similarity=similarity,
        dimensions=dimensions,
    )


def _modules(modules_file: Path) -> list[tuple[str, str]]:
    """(class name, path) of each module, in modules.json's order."""
    data = _read_json(modules_file)
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise SentenceConfigError(f"{modules_file} must hold a JSON list of objects")
    modules = []
    for module in sorted(data, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", ""))
        name = kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") or name not in MODULES:
            raise SentenceConfigError(
                f"{modules_file}: module {kind!r} is not one berth serves "
                f"(sentence-transformers' {', '.join(MODULES)})"
            )
        path = str(module.get("path", ""))
        if Path(path).is_absolute() or ".." in Path(path).parts:
            raise SentenceConfigError(
                f"{modules_file}: module path {path!r} is not inside the checkpoint"
            )
        modules.append((name, path))
    return modules


def _hidden_size(checkpoint: Path) -> int:
    config = _object(checkpoint / "config.json")
    return int(config.get("hidden_size", config.get("dim", 0)))


def _transformer(checkpoint: Path) -> tuple[int | None, bool]:
    """(max tokens, lowercase) as sentence-transformers' Transformer reads them."""
    found = [checkpoint / n for n in TRANSFORMER_CONFIG_FILES]
    path = next((p for p in found if p.is_file()), found[0])
    config = _object(path)
    refused = {
        "transformer_task": "feature-extraction",
        "module_output_name": "token_embeddings",
    }
    for key, wanted in refused.items():
        if config.get(key, wanted) != wanted:
            raise SentenceConfigError(
                f"{path}: {key} {config[key]!r}; berth serves {wanted!r} only"
            )
    modalities = config.get("modality_config")
    if modalities is not None and (
        not isinstance(modalities, dict) or set(modalities) != {"text"}
    ):
        raise SentenceConfigError(
            f"{path}: modality_config {modalities!r}; berth serves text only "
            "(no chat template, no other modality)"
        )
    for key in ("processing_kwargs", "config_kwargs", "config_args", "query_expansion"):
        if config.get(key):
            raise SentenceConfigError(
                f"{path}: {key} {config[key]!r} would change what the model "
                "computes; berth serves the checkpoint without it only"
            )
    tokenizer_args = config.get("processor_kwargs") or config.get("tokenizer_args")
    tokenizer_args = tokenizer_args or {}
    if set(tokenizer_args) - {"model_max_length"}:
        raise SentenceConfigError(
            f"{path}: tokenizer arguments {sorted(tokenizer_args)}; berth reads "
            "model_max_length only"
        )
    length = tokenizer_args.get("model_max_length", config.get("max_seq_length"))
    if length is None:
        tokenizer = _object(checkpoint / "tokenizer_config.json")
        length = tokenizer.get("model_max_length")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length < 1
    ):
        raise SentenceConfigError(f"{path}: max_seq_length {length!r}")
    lowercase = config.get("do_lower_case", False)
    if not isinstance(lowercase, bool):
        raise SentenceConfigError(f"{path}: do_lower_case {lowercase!r}")
    return length, lowercase


def _pooling(directory: Path, hidden: int) -> tuple[list[str], bool]:
    """(modes in concatenation order, include_prompt) of a Pooling module."""
    path = directory / "config.json"
    config = _object(path)
    if "pooling_mode" in config:
        raw = config["pooling_mode"]
        names = [raw] if isinstance(raw, str) else raw
        if not isinstance(names, list) or not all(n in ST_MODES for n in names):
            raise SentenceConfigError(
                f"{path}: pooling_mode {raw!r}; berth pools by {', '.join(ST_MODES)}"
            )
        modes = [ST_MODES[n] for n in names]
    else:
        unknown = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
        unknown = [k for k in unknown if k not in LEGACY_MODE_KEYS]
        if unknown:
            raise SentenceConfigError(f"{path}: {unknown} is not a mode berth pools by")
        modes = [m for k, m in LEGACY_MODE_KEYS.items() if config.get(k)]
    modes = modes or ["mean"]
    dimension = config.get(
        "embedding_dimension", config.get("word_embedding_dimension")
    )
    if dimension is not None and dimension != hidden:
        raise SentenceConfigError(
            f"{path}: embedding_dimension {dimension}, but the encoder's hidden "
            f"size is {hidden}"
        )
    include_prompt = config.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise SentenceConfigError(f"{path}: include_prompt {include_prompt!r}")
    return modes, include_prompt


def read_dense(directory: Path) -> DenseConfig:
    """A Dense module's configuration; its weights must be safetensors."""
    path = directory / "config.json"
    config = _object(path)
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, SENTENCE_EMBEDDING) != SENTENCE_EMBEDDING:
            raise SentenceConfigError(
                f"{path}: {key} {config[key]!r}; berth serves Dense on the "
                f"{SENTENCE_EMBEDDING!r} only"
            )
    try:
        in_features, out_features = (
            int(config[k]) for k in ("in_features", "out_features")
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SentenceConfigError(
            f"{path}: in_features and out_features: {exc}"
        ) from exc
    # sentence-transformers' default activation, when the config names none.
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    activation = ACTIVATIONS.get(name.rsplit(".", 1)[-1])
    if not name.startswith("torch.nn.") or activation is None:
        raise SentenceConfigError(
            f"{path}: activation_function {name!r}; berth applies torch.nn's "
            f"{', '.join(ACTIVATIONS)}"
        )
    if not (directory / "model.safetensors").is_file():
        pickled = (directory / "pytorch_model.bin").is_file()
        raise SentenceConfigError(
            f"{directory}: no model.safetensors"
            + (
                " (pytorch_model.bin is a pickle, which berth never loads: "
                "save the module with safe_serialization=True, or convert it "
                "with safetensors.torch.save_file)"
                if pickled
                else ""
            )
        )
    return DenseConfig(
        directory=directory,
        in_features=in_features,
        out_features=out_features,
        bias=bool(config.get("bias", True)),
        activation=activation,
        residual=bool(config.get("use_residual", False)),
    )


def _normalize(directory: Path) -> None:
    path = directory / "config.json"
    config = _object(path)
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, SENTENCE_EMBEDDING) not in (SENTENCE_EMBEDDING, None):
            raise SentenceConfigError(
                f"{path}: {key} {config[key]!r}; berth normalizes the "
                f"{SENTENCE_EMBEDDING!r} only"
            )


def _model_config(
    path: Path,
) -> tuple[dict[str, str], str | None, str | None, int | None]:
    """(prompts, default prompt name, similarity function name, truncate_dim)."""
    config = _object(path)
    kind = config.get("model_type", "SentenceTransformer")
    if kind != "SentenceTransformer":
        raise SentenceConfigError(
            f"{path}: model_type {kind!r}; berth serves SentenceTransformer models"
        )
    raw = config.get("prompts") or {}
    if not isinstance(raw, dict) or not all(
        isinstance(v, (str, type(None))) for v in raw.values()
    ):
        raise SentenceConfigError(f"{path}: prompts must map names to strings")
    prompts = {str(k): v or "" for k, v in raw.items()}
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise SentenceConfigError(
            f"{path}: default_prompt_name {default!r} is not one of the prompts "
            f"{sorted(prompts)}"
        )
    similarity = config.get("similarity_fn_name")
    if similarity is not None and similarity not in SIMILARITIES:
        raise SentenceConfigError(
            f"{path}: similarity_fn_name {similarity!r}, not one of {SIMILARITIES}"
        )
    dimensions = config.get("truncate_dim")
    if dimensions is not None and (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or dimensions < 1
    ):
        raise SentenceConfigError(
            f"{path}: truncate_dim {dimensions!r}, not a positive integer"
        )
    return prompts, default, similarity, dimensions


def load_tokenizer(tokenizer_file: Path, lowercase: bool = False) -> Tokenizer:
    """A checkpoint's tokenizer as berth runs it: no truncation, no padding
    (berth applies its own limits), and with ``lowercase``, a Lowercase
    normalizer first unless it has one, as sentence-transformers'
    Transformer module does for ``do_lower_case``."""
    from tokenizers import Tokenizer, normalizers

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    if lowercase:
        current: Any = tokenizer.normalizer
        sequence = isinstance(current, normalizers.Sequence)
        steps: list[Any] = list(current) if sequence else [current]
        if not any(isinstance(step, normalizers.Lowercase) for step in steps):
            kept = [step for step in steps if step is not None]
            tokenizer.normalizer = normalizers.Sequence(
                [normalizers.Lowercase(), *kept]
            )
    return tokenizer


def prompt_length(tokenizer: Tokenizer, prompt: str) -> int:
    """Tokens of ``prompt`` as sentence-transformers counts them to leave
    them out of pooling: its special tokens included, but for a trailing
    special token ([SEP], </s>)."""
    ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    special = {
        i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special
    }
    return len(ids) - 1 if ids and ids[-1] in special else len(ids)
