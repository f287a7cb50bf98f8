"""``*ForSequenceClassification`` checkpoints served with their own heads,
against transformers' own models.

Each case writes a tiny random classifier with transformers (every
parameter scrambled, the head's included), serves it as a classify entry
with no head file (torch, and onnxruntime through berth's ONNX export, the
CPU default) and compares the outputs with transformers' logits through
softmax (single-label), a sigmoid per label (multi-label) or as they are
(regression), in float32; then the CPU fallback's build, and the real stack.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from engine.build.fallback import build_fallbacks
from engine.model import load_served_model
from engine.onnx_backend import OnnxRuntimeBackend
from services.cli.default_models import minilm_checkpoint
from services.fallback_model import FallbackModel
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import ModelEntry, RepositoryError, load_entry, load_repository
from tests.gpu.reference import FIXTURES_ENV
from tests.stack import Stack, serving

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
VOCAB = 30522  # the minilm tokenizer's
SMALL = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 48}
LABELS = ["negative", "neutral", "positive"]
TEXTS = [
    "Hello World",
    "The Quick Brown FOX jumps over the Lazy Dog.",
    "a",
    "Naïve Café Façade — Résumé, numbers 12345 and symbols #@!",
    "berth serves transformer encoders over gRPC " * 4,
]
TOLERANCE = 1e-5
# (name, architecture, problem_type)
CASES = [
    (f"{arch}-{problem}", arch, problem)
    for arch in ("bert", "distilbert", "roberta", "xlm-roberta", "mpnet",
                 "modernbert", "modernbert-mean")
    for problem in ("single", "multi")
] + [("bert-regression", "bert", "regression")]  # fmt: skip
PROBLEMS = {
    "single": "single_label_classification",
    "multi": "multi_label_classification",
    "regression": "regression",
}


def tokenizer_dir() -> Path:
    """The minilm tokenizer's files: the GPU fixtures' checkpoint
    (tests/gpu/reference.py) where a GPU machine carries them, else the
    package's."""
    carried = os.environ.get(FIXTURES_ENV)
    return Path(carried) / "checkpoint" if carried else minilm_checkpoint()


def encoder_config(arch: str, **fields: Any) -> Any:
    """A tiny ``arch`` configuration (64 positions) for MiniLM's tokenizer,
    with ``fields`` besides: ModernBERT's special ids are its [CLS] and
    [SEP]; RoBERTa's pad id, 1 ([unused0]), never occurs in a text."""
    import transformers as tf

    if arch == "distilbert":
        return tf.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
            max_position_embeddings=64, **fields,
        )  # fmt: skip
    if arch.startswith("modernbert"):  # 3 layers, the middle one local
        return tf.ModernBertConfig(
            vocab_size=VOCAB, num_hidden_layers=3, max_position_embeddings=64,
            local_attention=8, global_attn_every_n_layers=2,
            pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101,
            sep_token_id=102, **SMALL, **fields,
        )  # fmt: skip
    if arch == "mpnet":
        return tf.MPNetConfig(
            vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64,
            **SMALL, **fields,
        )  # fmt: skip
    kinds = {
        "bert": tf.BertConfig,
        "roberta": tf.RobertaConfig,
        "xlm-roberta": tf.XLMRobertaConfig,
    }
    return kinds[arch](
        vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64,
        pad_token_id=0 if arch == "bert" else 1, **SMALL, **fields,
    )  # fmt: skip


def _config(arch: str, problem: str) -> Any:
    labels = ["score"] if problem == "regression" else LABELS
    common: dict[str, Any] = {
        "id2label": dict(enumerate(labels)),
        "label2id": {name: i for i, name in enumerate(labels)},
        "problem_type": PROBLEMS[problem],
    }
    if arch.startswith("modernbert"):
        common["classifier_activation"] = "gelu"
        common["classifier_pooling"] = "mean" if arch.endswith("mean") else "cls"
    return encoder_config(arch, **common)


def write_classifier(directory: Path, arch: str, problem: str = "single") -> Any:
    """A tiny random ``*ForSequenceClassification`` checkpoint with the minilm
    tokenizer; returns transformers' model (eager attention, eval)."""
    import transformers as tf

    torch.manual_seed(0)
    config = _config(arch, problem)
    config._attn_implementation = "eager"
    model = tf.AutoModelForSequenceClassification.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir() / name, directory / name)
    return model


def add_entry(root: Path, name: str, checkpoint: Path, **fields: Any) -> Path:
    entry_dir = root / name
    entry_dir.mkdir(parents=True)
    spec = {"name": name, "task": "classify", "checkpoint": str(checkpoint), **fields}
    (entry_dir / "berth.json").write_text(json.dumps(spec))
    return entry_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A repository of every case, and transformers' model of each."""
    root = tmp_path_factory.mktemp("classifiers")
    checkpoints = tmp_path_factory.mktemp("classifier_checkpoints")
    models = {}
    for name, arch, problem in CASES:
        models[name] = write_classifier(checkpoints / name, arch, problem)
        add_entry(root, name, checkpoints / name)
    return root, models


@pytest.fixture(scope="module")
def onnx(
    built: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> OnnxRuntimeBackend:
    backend = OnnxRuntimeBackend("cpu", threads=2, cache=tmp_path_factory.mktemp("c"))
    for entry in load_repository(built[0]).values():
        backend.load(entry)
    return backend


def token_batch(entry: ModelEntry) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    tokenizer = entry.tokenizer()
    ids = [tokenizer.encode(text).ids for text in TEXTS]
    lengths = np.array([len(row) for row in ids], np.int32)
    batch = np.zeros((len(ids), int(lengths.max())), np.int32)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = row
    return ids, batch, lengths


def reference(model: Any, ids: list[list[int]]) -> np.ndarray:
    """transformers' outputs, a text at a time (no padding)."""
    rows = []
    with torch.inference_mode():
        for row in ids:
            logits = model(input_ids=torch.tensor([row])).logits[0].float()
            problem = model.config.problem_type
            if problem == "multi_label_classification":
                logits = torch.sigmoid(logits)
            elif problem != "regression":
                logits = torch.softmax(logits, dim=-1)
            rows.append(logits.numpy())
    return np.stack(rows)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize(("name", "arch", "problem"), CASES)
def test_served_like_transformers(
    built: tuple[Path, dict[str, Any]],
    onnx: OnnxRuntimeBackend,
    name: str,
    arch: str,
    problem: str,
    backend: str,
) -> None:
    entry = load_entry(built[0] / name)
    assert entry.checkpoint_head and entry.normalize is False
    expected_labels = ["score"] if problem == "regression" else LABELS
    assert entry.label_names() == expected_labels
    assert entry.pooling == ("mean" if arch == "modernbert-mean" else "cls")
    ids, batch, lengths = token_batch(entry)
    if backend == "torch":
        model = load_served_model(entry)
        with torch.inference_mode():
            ours = model(torch.from_numpy(batch).long(), torch.from_numpy(lengths))
        ours_np = ours.numpy()
    else:
        ours_np = onnx.run(name, batch, lengths)
    theirs = reference(built[1][name], ids)
    assert ours_np.shape == theirs.shape == (len(TEXTS), len(expected_labels))
    diff = float(np.abs(ours_np - theirs).max())
    print(f"{name} on {backend}: max |diff| {diff:.1e}")
    assert diff <= TOLERANCE, diff
    assert (ours_np.argmax(1) == theirs.argmax(1)).all()


def test_refusals(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    write_classifier(checkpoint, "bert")
    entry_dir = add_entry(tmp_path / "repo", "c", checkpoint, pooling="mean")
    with pytest.raises(RepositoryError, match="pooling is set by the checkpoint"):
        load_entry(entry_dir)
    entry_dir = add_entry(tmp_path / "repo", "h", checkpoint, head="head.safetensors")
    with pytest.raises(RepositoryError, match="both head and labels, or neither"):
        load_entry(entry_dir)
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    entry_dir = add_entry(tmp_path / "repo", "e", checkpoint)
    with pytest.raises(RepositoryError, match="ForSequenceClassification checkpoint"):
        load_entry(entry_dir)
    config["architectures"] = ["AlbertForSequenceClassification"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(RepositoryError, match="AlbertForSequenceClassification is not"):
        load_entry(entry_dir)


def test_fallback_applies_the_checkpoint_head(tmp_path: Path) -> None:
    """The fallback's build maps into what the head's last layer reads."""
    root = tmp_path / "repo"
    write_classifier(tmp_path / "multi", "distilbert", "multi")
    add_entry(root, "multi", tmp_path / "multi")
    (path,) = build_fallbacks(root)
    entry = load_entry(root / "multi")
    fallback = FallbackModel.load(entry)
    assert fallback.probability == "sigmoid" and fallback.labels == LABELS
    ids, _, _ = token_batch(entry)
    out = fallback.run([np.array(row, np.int32) for row in ids])
    assert out.shape == (len(TEXTS), 3)
    assert ((out > 0) & (out < 1)).all()  # a sigmoid per label, not summing to 1


def test_the_stack_answers_with_id2label(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    model = write_classifier(tmp_path / "roberta", "roberta", "single")
    add_entry(root, "sentiment", tmp_path / "roberta")
    entry = load_entry(root / "sentiment")
    ids, _, _ = token_batch(entry)
    theirs = reference(model, ids)
    env = {"BERTH_CACHE_DIR": str(tmp_path / "cache")}
    with (
        serving(Stack(root, env=env)) as stack,
        grpc.insecure_channel(stack.gateway) as channel,
    ):
        stub = berth_pb2_grpc.BerthStub(channel)
        request = berth_pb2.ClassifyRequest(model="sentiment", texts=TEXTS, top_k=3)
        response = stub.Classify(request, timeout=60)
    assert not response.degraded
    for row, result in zip(theirs, response.results, strict=True):
        scores = {label.label: label.score for label in result.labels}
        assert set(scores) == set(LABELS)
        ours = np.array([scores[name] for name in LABELS])
        assert np.abs(ours - row).max() <= TOLERANCE
        assert result.labels[0].label == LABELS[int(row.argmax())]
