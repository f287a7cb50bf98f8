"""Builds each model's level-3 fallback from its own primary encoder.

``berth build-models`` calls :func:`build_fallbacks` once the models are
built. For each entry it writes ``<repo>/<model>/fallback.safetensors``
(read at serve time by services/fallback_model.py) from installed files only:

1. Distil: every vocabulary id t runs through the primary as [CLS] t [SEP];
   the hidden state at t is its static vector. (The mean of all three
   states, Model2Vec's choice, did no better with the map of step 3 and far
   worse without it: 0.48 against 0.84 held-out intent agreement.)
   The same pass yields the primary's pooled embedding of each one-token
   text, reused as fitting targets in step 3.
2. Weight: SIF, a / (a + p(t)), with p(t) from Zipf's law on the vocabulary
   order (WordPiece and BPE vocabularies list words roughly by frequency).
   Special tokens weigh 0.
3. Map: an affine map fitted by ridge least squares from the unit weighted
   mean of a text's static vectors to the primary's unit embedding, scaled
   to the primary's mean norm. Fitting texts: data/fallback_texts.txt
   (shipped), spans and concatenations of them, and a sample of the
   one-token texts. It raises held-out cosine from about 0.63 to 0.77.
4. Classify: the primary's own head on that embedding. Fine-tuning the head
   on the fallback's embeddings did not raise held-out agreement. For a
   checkpoint's own ``*ForSequenceClassification`` head the embedding is
   what the head's last linear layer reads (the pooled vector through its
   hidden layers), and the fallback applies that layer.

Agreement with the primary on data/heldout_*.txt (never fitted) is measured
at build time, logged and stored in the artifact's metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save as save_safetensors
from tokenizers import Tokenizer
from torch import nn

from engine.checkpoint_heads import load_checkpoint_head
from engine.encoder import load_encoder
from engine.heads import load_classifier_head, load_dense, make_pooling, pooled_width
from services import files
from services.fallback_model import FORMAT, FallbackModel, fallback_path, zipf_weights
from services.repository import ModelEntry, load_repository

log = logging.getLogger("berth.models")

DATA = Path(__file__).parent.parent / "data"
FIT_TEXTS = DATA / "fallback_texts.txt"
HELDOUT_UTTERANCES = DATA / "heldout_utterances.txt"
HELDOUT_GENERAL = DATA / "heldout_general.txt"


@dataclass(frozen=True)
class Settings:
    """How fallbacks are fitted; any change changes every fingerprint."""

    sif: float = 1e-3  # SIF's a: smaller mutes frequent tokens more
    ridge: float = 2e-4  # per fitting text, on unit-length features
    spans: int = 1000  # random token spans of the shipped texts
    concatenations: int = 500  # 2-4 shipped texts joined
    single_tokens: int = 3000  # one-token texts from the distillation pass
    seed: int = 0


SETTINGS = Settings()
DISTIL_BATCH = 512
EMBED_BATCH = 64


def read_texts(path: Path) -> list[str]:
    """Non-empty lines that are not # comments."""
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def load_tokenizer(entry: ModelEntry) -> Tokenizer:
    """The gateway's tokenizer: no truncation, no padding."""
    return entry.tokenizer()


def tokenize(
    tokenizer: Tokenizer, texts: list[str], limit: int, prompt: str = ""
) -> list[np.ndarray]:
    """Token ids per text as the gateway sends them: ``prompt`` first."""
    prompted = [prompt + text for text in texts]
    encodings = tokenizer.encode_batch(prompted, add_special_tokens=True)
    return [np.asarray(e.ids[:limit], dtype=np.int32) for e in encodings]


class Primary:
    """The primary's encoder, pooling and Dense layers, on CPU in float32,
    for distilling."""

    def __init__(self, entry: ModelEntry) -> None:
        self.encoder = load_encoder(entry.checkpoint_dir)
        self.pooling = make_pooling(entry.pooling, entry.pooling_skip())
        # The one-token texts of the distillation pass carry no prompt.
        self.bare_pooling = make_pooling(entry.pooling)
        dense: list[nn.Module] = [load_dense(entry.path(d)) for d in entry.dense]
        if entry.checkpoint_head:
            # A checkpoint's own head: the fallback maps into the space its
            # last linear layer reads, and applies that layer.
            head = load_checkpoint_head(entry.checkpoint_dir, entry.classifier())
            dense.append(head.transform)
        self.dense = nn.Sequential(*dense)
        hidden = self.encoder.hidden_size
        self.width = pooled_width(entry.pooling, hidden)
        if entry.dense:
            self.width = load_dense(entry.path(entry.dense[-1])).out_features

    @torch.inference_mode()
    def embed(self, ids_list: list[np.ndarray]) -> np.ndarray:
        """Pooled, not normalized, float32 [N, width]; batches by similar length."""
        out = np.zeros((len(ids_list), self.width), np.float32)
        order = np.argsort([len(ids) for ids in ids_list], kind="stable")
        for start in range(0, len(order), EMBED_BATCH):
            rows = order[start : start + EMBED_BATCH]
            lengths = torch.tensor([len(ids_list[i]) for i in rows])
            batch = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
            for j, i in enumerate(rows):
                batch[j, : len(ids_list[i])] = torch.from_numpy(ids_list[i])
            hidden = self.encoder(batch, lengths)
            out[rows] = self.dense(self.pooling(hidden, lengths)).numpy()
        return out

    @torch.inference_mode()
    def distil(self, template: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per id t, as [CLS] t [SEP]: t's hidden state and the pooled text."""
        vocab, hidden = self.encoder.config.vocab_size, self.encoder.hidden_size
        vectors = np.zeros((vocab, hidden), np.float32)
        pooled = np.zeros((vocab, self.width), np.float32)
        lengths = torch.full((DISTIL_BATCH,), 3)
        started, reported = time.monotonic(), 0
        for start in range(0, vocab, DISTIL_BATCH):
            ids = torch.arange(start, min(vocab, start + DISTIL_BATCH))
            batch = torch.tensor([template[0], 0, template[1]]).repeat(len(ids), 1)
            batch[:, 1] = ids
            states = self.encoder(batch, lengths[: len(ids)])
            vectors[ids] = states[:, 1].float().numpy()
            bare = self.bare_pooling(states, lengths[: len(ids)])
            pooled[ids] = self.dense(bare).numpy()
            done = start + len(ids)
            if done * 10 // vocab > reported or done == vocab:
                reported = done * 10 // vocab
                spent = time.monotonic() - started
                log.info(
                    "distilling %d token vectors: %d%% (%.0f s, %.0f s left)",
                    vocab,
                    100 * done // vocab,
                    spent,
                    spent * (vocab - done) / done,
                )
        return vectors, pooled


@dataclass
class Distillation:
    """What every fallback of one (checkpoint, pooling) shares."""

    vectors: np.ndarray  # float16 [V, H]
    weights: np.ndarray  # float32 [V]
    matrix: np.ndarray  # float32 [H, H]
    offset: np.ndarray  # float32 [H]


def augment(
    ids_list: list[np.ndarray], template: list[int], rng: np.random.Generator
) -> Iterator[np.ndarray]:
    """Spans and concatenations of tokenized texts, wrapped in ``template``."""
    inner = [ids[1:-1] for ids in ids_list if len(ids) > 3]
    first, last = np.array(template[:1], np.int32), np.array(template[1:], np.int32)
    for _ in range(SETTINGS.spans):
        ids = inner[rng.integers(len(inner))]
        size = int(rng.integers(1, len(ids) + 1))
        start = int(rng.integers(0, len(ids) - size + 1))
        yield np.concatenate([first, ids[start : start + size], last])
    for _ in range(SETTINGS.concatenations):
        picks = rng.integers(len(inner), size=int(rng.integers(2, 5)))
        yield np.concatenate([first, *(inner[i] for i in picks), last])


def weighted_means(
    vectors: np.ndarray, weights: np.ndarray, ids_list: list[np.ndarray]
) -> np.ndarray:
    """Unit weighted mean of each text's static vectors (as the runtime)."""
    identity = np.eye(vectors.shape[1], dtype=np.float32)
    zero = np.zeros(vectors.shape[1], np.float32)
    return FallbackModel("fit", "embed", vectors, weights, identity, zero).embed(
        ids_list
    )


def fit_map(
    features: np.ndarray, targets: np.ndarray, ridge: float
) -> tuple[np.ndarray, np.ndarray]:
    """Affine ridge least squares: features @ matrix + offset ≈ targets."""
    x, y = features.astype(np.float64), targets.astype(np.float64)
    x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
    xc, yc = x - x_mean, y - y_mean
    gram = xc.T @ xc + ridge * len(x) * np.eye(x.shape[1])
    matrix = np.linalg.solve(gram, xc.T @ yc)
    return matrix, y_mean - x_mean @ matrix


def distil(entry: ModelEntry) -> Distillation:
    """Steps 1-3 of the module docstring for ``entry``'s encoder."""
    started = time.monotonic()
    primary = Primary(entry)
    tokenizer = load_tokenizer(entry)
    template = tokenizer.encode("", add_special_tokens=True).ids
    if len(template) != 2:
        raise ValueError(
            f"{entry.name}: the tokenizer wraps text in {template}, not one "
            "start and one end token; berth cannot distil this model's fallback"
        )
    vectors, singles = primary.distil(template)
    weights = zipf_weights(tokenizer, len(vectors), template, SETTINGS.sif)
    # Fitting set: the shipped texts, their spans and concatenations.
    rng = np.random.default_rng(SETTINGS.seed)
    texts = tokenize(tokenizer, read_texts(FIT_TEXTS), entry.max_tokens, entry.prompt)
    texts += [ids[: entry.max_tokens] for ids in augment(texts, template, rng)]
    log.info("embedding %d fitting texts with the primary", len(texts))
    targets = primary.embed(texts)
    # ... and one-token texts, whose primary embeddings the distillation gave.
    vocab = len(vectors)
    candidates = np.setdiff1d(np.arange(vocab), template)
    picks = rng.choice(candidates, SETTINGS.single_tokens, replace=False)
    texts += [np.array([template[0], t, template[1]], np.int32) for t in picks]
    targets = np.concatenate([targets, singles[picks]])
    features = weighted_means(vectors, weights, texts)
    norms = np.linalg.norm(targets, axis=1, keepdims=True)
    matrix, offset = fit_map(features, targets / norms, SETTINGS.ridge)
    scale = float(norms.mean())  # the primary's typical norm, for normalize=False
    log.info(
        "fallback map fitted on %d texts in %.0f s (primary norm %.2f)",
        len(texts),
        time.monotonic() - started,
        scale,
    )
    return Distillation(
        vectors=vectors.astype(np.float16),
        weights=weights,
        matrix=(matrix * scale).astype(np.float32),
        offset=(offset * scale).astype(np.float32),
    )


def assemble(entry: ModelEntry, distilled: Distillation) -> FallbackModel:
    """``entry``'s fallback: the shared distillation plus its head, if any."""
    head_weight = head_bias = None
    probability = "softmax"
    if entry.task == "classify":
        head = (
            load_checkpoint_head(entry.checkpoint_dir, entry.classifier())
            if entry.checkpoint_head
            else load_classifier_head(entry.path(entry.head or ""))
        )
        head_weight = head.linear.weight.detach().numpy().astype(np.float32)
        head_bias = head.linear.bias.detach().numpy().astype(np.float32)
        probability = head.probability
    return FallbackModel(
        name=entry.name,
        task=entry.task,
        vectors=distilled.vectors,
        weights=distilled.weights,
        matrix=distilled.matrix,
        offset=distilled.offset,
        normalize=entry.normalize,
        head_weight=head_weight,
        head_bias=head_bias,
        probability=probability,
        labels=entry.label_names(),
    )


def measure(entry: ModelEntry, fallback: FallbackModel) -> dict[str, float | int]:
    """Held-out cosine with the primary (all texts) and, for a classifier,
    top-1 agreement (the assistant utterances)."""
    tokenizer = load_tokenizer(entry)
    limit, prompt = entry.max_tokens, entry.prompt
    utterances = tokenize(tokenizer, read_texts(HELDOUT_UTTERANCES), limit, prompt)
    texts = utterances + tokenize(tokenizer, read_texts(HELDOUT_GENERAL), limit, prompt)
    primary = Primary(entry).embed(texts)
    cosine = np.sum(_unit(primary) * _unit(fallback.embed(texts)), axis=1)
    metrics = {
        "texts": len(texts),
        "cosine_mean": round(float(cosine.mean()), 4),
        "cosine_min": round(float(cosine.min()), 4),
    }
    if fallback.head_weight is not None and fallback.head_bias is not None:
        pooled = primary[: len(utterances)]
        pooled = _unit(pooled) if entry.normalize else pooled
        expected = (pooled @ fallback.head_weight.T + fallback.head_bias).argmax(1)
        agreement = fallback.classify(utterances).argmax(1) == expected
        metrics["utterances"] = len(utterances)
        metrics["agreement"] = round(float(agreement.mean()), 4)
    return metrics


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def fingerprint(entry: ModelEntry) -> str:
    """A digest of everything a fallback is made from; it changes -> rebuild."""
    digest = hashlib.sha256(
        f"{FORMAT} {json.dumps(asdict(SETTINGS), sort_keys=True)}".encode()
    )
    digest.update(f"{entry.task} {entry.pooling} {entry.normalize}".encode())
    served = served_spec(entry)
    if served:  # only where the entry has them: other fallbacks stay built
        digest.update(served.encode())
    checkpoint = entry.checkpoint_dir
    files = [
        FIT_TEXTS,
        HELDOUT_UTTERANCES,
        HELDOUT_GENERAL,
        checkpoint / "config.json",
        entry.tokenizer_file,
    ]
    files += sorted(checkpoint.glob("*.safetensors"))
    files += [entry.path(p) for p in (entry.head, entry.labels) if p is not None]
    files += [entry.path(d) / "model.safetensors" for d in entry.dense]
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def served_spec(entry: ModelEntry) -> str:
    """What else shapes the primary's embeddings, where the entry sets it
    ("" for none): Dense layers, lowercasing, the prompt, a checkpoint's own
    head (whose hidden layers the embeddings then pass)."""
    spec = {
        "dense": entry.dense,
        "lowercase": entry.lowercase,
        "prompt": entry.prompt,
        "include_prompt": entry.include_prompt,
        "checkpoint_head": entry.checkpoint_head,
    }
    defaults = {
        "dense": [],
        "lowercase": False,
        "prompt": "",
        "include_prompt": True,
        "checkpoint_head": False,
    }
    return "" if spec == defaults else json.dumps(spec, sort_keys=True)


def built_fingerprint(path: Path) -> str | None:
    """The fingerprint an existing artifact was built from, if readable."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return (f.metadata() or {}).get("fingerprint")
    except Exception:  # missing or damaged: either way it must be rebuilt
        return None


def write_fallback(
    path: Path, fallback: FallbackModel, metadata: dict[str, str]
) -> None:
    """Atomically: a server starting meanwhile never reads half a file."""
    data = save_safetensors(fallback.tensors(), metadata=metadata)
    files.write_bytes(path, data)


def build_fallbacks(
    root: Path, force: bool = False, names: list[str] | None = None
) -> list[Path]:
    """Write every model's fallback under ``root`` (those of ``names`` only,
    where given); returns their paths.

    Idempotent: an artifact whose fingerprint matches its inputs is left
    alone unless ``force``. Models sharing a checkpoint share one distillation.
    A model whose fallback cannot be made is logged and skipped.
    """
    built: list[Path] = []
    shared: dict[tuple[str, str], Distillation] = {}
    for entry in load_repository(root).values():
        if names is not None and entry.name not in names:
            continue
        if entry.task == "rerank":
            log.info(
                "%s is a rerank model: nothing to build, its CPU fallback "
                "scores pairs by lexical overlap (services/pair_fallback.py)",
                entry.name,
            )
            continue
        path = fallback_path(entry)
        digest = fingerprint(entry)
        if not force and built_fingerprint(path) == digest:
            log.info("fallback of %s already built in %s", entry.name, path)
            built.append(path)
            continue
        started = time.monotonic()
        key = (
            str(entry.checkpoint_dir.resolve()),
            f"{entry.pooling} {served_spec(entry)}",
        )
        try:
            if key not in shared:
                log.info("distilling %s's fallback from %s", entry.name, key[0])
                shared[key] = distil(entry)
            fallback = assemble(entry, shared[key])
            metrics = measure(entry, fallback)
        except (ValueError, OSError) as exc:  # one odd model must not stop the rest
            # An artifact made from its earlier inputs would answer for it.
            path.unlink(missing_ok=True)
            log.warning(
                "no fallback for %s (%s): while its circuit is open it cannot answer",
                entry.name,
                exc,
            )
            continue
        metadata = {
            "format": FORMAT,
            "model": entry.name,
            "task": entry.task,
            "probability": fallback.probability,
            "labels": json.dumps(fallback.labels),
            "fingerprint": digest,
            "heldout": json.dumps(metrics),
            "settings": json.dumps(asdict(SETTINGS)),
        }
        write_fallback(path, fallback, metadata)
        log.info(
            "fallback of %s written to %s (%.1f MB, %.0f s); held out: %s",
            entry.name,
            path,
            path.stat().st_size / 1e6,
            time.monotonic() - started,
            metrics,
        )
        built.append(path)
    return built
