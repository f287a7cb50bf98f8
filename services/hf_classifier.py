"""A Hugging Face ``*ForSequenceClassification`` checkpoint's own head, as
berth serves it: which head its ``architectures`` name, its labels
(``id2label``) and how its scores become the outputs (``problem_type``).

The head's weights are read by engine/checkpoint_heads.py; this module reads
``config.json`` only, so that every process can check an entry without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The architecture a checkpoint's config.json names -> the head's kind.
SEQUENCE_CLASSIFIERS = {
    "BertForSequenceClassification": "bert",
    "DistilBertForSequenceClassification": "distilbert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    "CamembertForSequenceClassification": "roberta",
    "MPNetForSequenceClassification": "mpnet",
    "ModernBertForSequenceClassification": "modernbert",
}
SUFFIX = "ForSequenceClassification"
# sentence-transformers' CrossEncoder activation_fn (config.json's
# sentence_transformers.activation_fn, or sbert_ce_default_activation_function
# of older saves) -> berth's name for it. Without one, CrossEncoder applies a
# sigmoid to a one-label model's score.
CROSS_ENCODER_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.Tanh": "tanh",
}
# How the head's scores become a classify response's outputs: softmax over
# the labels (single-label), a sigmoid per label (multi-label), or the raw
# score (regression).
OUTPUTS = ("softmax", "sigmoid", "none")


class ClassifierConfigError(ValueError):
    """A checkpoint's classifier berth cannot serve as transformers runs it."""


@dataclass(frozen=True)
class CheckpointClassifier:
    """What a ``*ForSequenceClassification`` config.json says about its head."""

    architecture: str  # e.g. BertForSequenceClassification
    kind: str  # SEQUENCE_CLASSIFIERS' value
    labels: list[str]  # id2label, in id order
    probability: str  # one of OUTPUTS
    pooling: str  # "cls" or (ModernBERT's classifier_pooling) "mean"
    # A cross-encoder's activation on its score (CROSS_ENCODER_ACTIVATIONS'
    # values): what sentence-transformers' CrossEncoder applies in predict.
    activation: str = "sigmoid"
    # Whether the checkpoint names itself a sentence-transformers
    # CrossEncoder (config.json's "sentence_transformers" section).
    cross_encoder: bool = False


def read_config(checkpoint_dir: Path) -> dict[str, Any]:
    config_file = checkpoint_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ClassifierConfigError(f"{config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise ClassifierConfigError(f"{config_file} is not a JSON object")
    return config


def read_classifier(checkpoint_dir: Path) -> CheckpointClassifier | None:
    """The checkpoint's sequence classifier; None when its ``architectures``
    name none. ClassifierConfigError for one berth does not serve."""
    config = read_config(checkpoint_dir)
    names = config.get("architectures") or []
    heads = [n for n in names if isinstance(n, str) and n.endswith(SUFFIX)]
    if not heads:
        return None
    architecture = heads[0]
    if architecture not in SEQUENCE_CLASSIFIERS:
        raise ClassifierConfigError(
            f"{checkpoint_dir}: architecture {architecture} is not supported; "
            f"berth serves {', '.join(SEQUENCE_CLASSIFIERS)}"
        )
    kind = SEQUENCE_CLASSIFIERS[architecture]
    pooling = "cls"
    if kind == "modernbert":
        pooling = str(config.get("classifier_pooling", "cls"))
        if pooling not in ("cls", "mean"):
            raise ClassifierConfigError(
                f"{checkpoint_dir}: classifier_pooling {pooling!r}, not cls or mean"
            )
    labels = _labels(checkpoint_dir, config)
    problem = config.get("problem_type")
    if problem == "multi_label_classification":
        probability = "sigmoid"
    elif problem == "regression" or len(labels) == 1:
        probability = "none"
    elif problem in (None, "single_label_classification"):
        probability = "softmax"
    else:
        raise ClassifierConfigError(
            f"{checkpoint_dir}: problem_type {problem!r} is not one of "
            "single_label_classification, multi_label_classification, regression"
        )
    activation, cross_encoder = _cross_encoder(checkpoint_dir, config)
    return CheckpointClassifier(
        architecture, kind, labels, probability, pooling, activation, cross_encoder
    )


def _cross_encoder(checkpoint_dir: Path, config: dict[str, Any]) -> tuple[str, bool]:
    """The activation sentence-transformers' CrossEncoder applies to the
    scores, and whether config.json names the checkpoint a CrossEncoder."""
    section = config.get("sentence_transformers")
    named = isinstance(section, dict)
    path = section.get("activation_fn") if isinstance(section, dict) else None
    path = path or config.get("sbert_ce_default_activation_function")
    if path is None:
        return "sigmoid", named
    if path not in CROSS_ENCODER_ACTIVATIONS:
        raise ClassifierConfigError(
            f"{checkpoint_dir}: the cross-encoder activation {path!r} is not "
            f"supported; berth applies {', '.join(CROSS_ENCODER_ACTIVATIONS)}"
        )
    return CROSS_ENCODER_ACTIVATIONS[path], True


def _labels(checkpoint_dir: Path, config: dict[str, Any]) -> list[str]:
    """id2label in id order; without it, num_labels names LABEL_0 ...
    (transformers' default; 2 without num_labels either)."""
    id2label = config.get("id2label")
    if not id2label:
        count = int(config.get("num_labels", 2))
        return [f"LABEL_{i}" for i in range(count)]
    try:
        by_id = {int(k): str(v) for k, v in dict(id2label).items()}
    except (TypeError, ValueError) as exc:
        raise ClassifierConfigError(
            f"{checkpoint_dir}: id2label {id2label!r}: {exc}"
        ) from exc
    if sorted(by_id) != list(range(len(by_id))):
        raise ClassifierConfigError(
            f"{checkpoint_dir}: id2label ids {sorted(by_id)} are not 0 to "
            f"{len(by_id) - 1}"
        )
    return [by_id[i] for i in range(len(by_id))]


def checkpoint_task(checkpoint_dir: Path) -> str:
    """rerank for a cross-encoder, classify for another sequence classifier,
    embed for anything else. A cross-encoder is a classifier of one label
    that config.json names a sentence-transformers CrossEncoder, or whose
    problem_type is unset (ms-marco's rerankers); a one-label classifier
    with problem_type regression is served by Classify."""
    classifier = read_classifier(checkpoint_dir)
    if classifier is None:
        return "embed"
    if len(classifier.labels) == 1 and (
        classifier.cross_encoder
        or read_config(checkpoint_dir).get("problem_type") is None
    ):
        return "rerank"
    return "classify"
