"""Inputs and fp32 CPU references for the GPU tests.

Where the default-model packages are installed, the references are computed
in-process: berth's torch backend, float32, on the CPU.

The device machine has neither those packages nor room for the fp32
checkpoint (91 MB, over the 64 MiB a call may carry), so
``python -m tests.gpu.reference DIR`` writes, on a machine that has them:

- ``DIR/checkpoint``: all-MiniLM-L6-v2 with float16 weights (exactly what
  the GPU backend loads: it casts to float16 anyway), its config and tokenizer;
- ``DIR/repo``: a model repository (minilm, intent) using that checkpoint;
- ``DIR/reference.npz``: the float32 references, computed from the original
  float32 weights, with a digest of the token ids they belong to.

``BERTH_GPU_FIXTURES=DIR`` points the tests at it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from services.repository import ModelEntry, load_repository
from tests.texts import UTTERANCES, VARIED

FIXTURES_ENV = "BERTH_GPU_FIXTURES"
# MiniLM's position limit: the fixtures' entries are raised to it (the
# default minilm serves its max_seq_length, 256), so that the engine is
# tested at every length its positions allow.
MAX_TOKENS = 512

_SENTENCES = (
    "berth serves transformer encoders over gRPC at GPU speed while the batcher "
    "packs requests by length and the gateway tokenizes text from many clients "
    "le modèle répond vite même quand la file est longue und die Antwort kommt "
    "schnell 我们 今天 去 公园 散步 天气 非常 好 🙂 🚀 12345 #@! naïve café"
)
_WORDS = _SENTENCES.split()
_SLOTS = {
    "time": ["7 am", "six thirty", "noon", "9 pm tonight", "5:45 tomorrow"],
    "city": ["paris", "new york", "tokyo", "berlin", "sao paulo", "cairo"],
    "day": ["today", "tomorrow", "next friday", "this weekend", "on monday"],
    "money": ["200 dollars", "50 euros", "a thousand bucks", "$75"],
    "account": ["savings", "checking", "my joint account", "my credit card"],
    "lang": ["french", "spanish", "german", "japanese", "italian"],
    "phrase": ["thank you", "good morning", "where is the station", "cheers"],
    "music": ["some jazz", "my workout playlist", "taylor swift", "lofi beats"],
    "task": ["call mom", "pay rent", "water the plants", "buy milk"],
    "food": ["lasagna", "pancakes", "an apple", "a banana", "sushi"],
    "place": ["the italian place", "joe's diner", "the sushi bar"],
    "duration": ["10 minutes", "half an hour", "90 seconds", "2 hours"],
}
_TEMPLATES = [
    "set an alarm for {time}",
    "wake me up at {time}",
    "what's the weather like in {city} {day}",
    "will it rain in {city} {day}",
    "transfer {money} to {account}",
    "how do you say {phrase} in {lang}",
    "play {music}",
    "book a flight to {city} {day}",
    "what is the balance of {account}",
    "remind me to {task} {day}",
    "add {food} to my shopping list",
    "how many calories are in {food}",
    "give me a recipe for {food}",
    "what time is it in {city}",
    "cancel my reservation at {place}",
    "book a table at {place} for {time}",
    "set a timer for {duration}",
    "translate {phrase} to {lang}",
    "my card was declined in {city}",
    "how long will it take to drive to {city}",
]


def texts() -> list[str]:
    """Varied texts: scripts, emoji, whitespace, 1 to ~500 tokens."""
    rng = np.random.default_rng(7)
    made = []
    for i in range(240):
        words = int(rng.integers(1, 8)) if i % 3 else int(rng.integers(8, 400))
        made.append(" ".join(rng.choice(_WORDS, size=words)))
    return [*VARIED, *UTTERANCES, *made]


def utterances() -> list[str]:
    """Assistant requests (intent-classifier style), 400 of them."""
    rng = np.random.default_rng(11)
    made = []
    for _ in range(400 - len(UTTERANCES)):
        template = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
        slots = {k: v[int(rng.integers(len(v)))] for k, v in _SLOTS.items()}
        made.append(template.format(**slots))
    return [*UTTERANCES, *made]


def tokenize(tokenizer_file: Path, batch: list[str]) -> list[np.ndarray]:
    """int32 ids per text, cut at MAX_TOKENS."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return [
        np.asarray(e.ids[:MAX_TOKENS], dtype=np.int32)
        for e in tokenizer.encode_batch(batch)
    ]


def digest(sequences: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for ids in sequences:
        h.update(ids.tobytes() + b"|")
    return h.hexdigest()


@dataclass
class Fixtures:
    """The models, their inputs and the float32 CPU references."""

    entries: dict[str, ModelEntry]
    text_ids: list[np.ndarray]
    utterance_ids: list[np.ndarray]
    embeddings: np.ndarray  # float32 [texts, 384], not normalized
    intent_top1: np.ndarray  # int64 [utterances]


def padded_batches(
    sequences: list[np.ndarray], buckets: list[int], rows: int
) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """(indices, ids [B, L], lengths [B]) per batch: by bucket, up to rows each."""
    by_bucket: dict[int, list[int]] = {}
    for i, ids in enumerate(sequences):
        bucket = next(b for b in buckets if b >= len(ids))
        by_bucket.setdefault(bucket, []).append(i)
    batches = []
    for length, indices in sorted(by_bucket.items()):
        for start in range(0, len(indices), rows):
            chunk = indices[start : start + rows]
            ids = np.zeros((len(chunk), length), dtype=np.int32)
            lengths = np.zeros(len(chunk), dtype=np.int32)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = sequences[i]
                lengths[row] = len(sequences[i])
            batches.append((chunk, ids, lengths))
    return batches


def compute_references(entries: dict[str, ModelEntry]) -> tuple[np.ndarray, ...]:
    """float32 CPU outputs: (embeddings of texts(), intent top-1 of utterances())."""
    from engine.torch_backend import TorchBackend

    backend = TorchBackend("cpu")
    minilm, intent = entries["minilm"], entries["intent"]
    for entry in (minilm, intent):
        backend.load(entry)
    text_ids = tokenize(minilm.tokenizer_file, texts())
    utterance_ids = tokenize(intent.tokenizer_file, utterances())
    embeddings = np.zeros((len(text_ids), backend.width("minilm")), np.float32)
    for rows, ids, lengths in padded_batches(text_ids, minilm.buckets, 16):
        embeddings[rows] = backend.run("minilm", ids, lengths)
    top1 = np.zeros(len(utterance_ids), np.int64)
    for rows, ids, lengths in padded_batches(utterance_ids, intent.buckets, 64):
        top1[rows] = backend.run("intent", ids, lengths).argmax(axis=1)
    return embeddings, top1


def build_fixtures(root: Path) -> Fixtures:
    """From the installed default-model packages, references computed here."""
    from services.cli.default_models import build_default_repository

    build_default_repository(root)
    for config in root.glob("*/berth.json"):
        data = json.loads(config.read_text())
        config.write_text(json.dumps({**data, "max_tokens": MAX_TOKENS}))
    entries = load_repository(root)
    embeddings, top1 = compute_references(entries)
    return _fixtures(entries, embeddings, top1)


def load_fixtures(directory: Path) -> Fixtures:
    """What write_fixtures left in directory (the device machine's case)."""
    entries = load_repository(directory / "repo")
    saved = np.load(directory / "reference.npz")
    fixtures = _fixtures(entries, saved["embeddings"], saved["intent_top1"])
    ids = fixtures.text_ids + fixtures.utterance_ids
    if digest(ids) != str(saved["digest"]):
        raise RuntimeError(f"{directory} was written for other inputs: rewrite it")
    return fixtures


def _fixtures(
    entries: dict[str, ModelEntry], embeddings: np.ndarray, top1: np.ndarray
) -> Fixtures:
    text_ids = tokenize(entries["minilm"].tokenizer_file, texts())
    utterance_ids = tokenize(entries["intent"].tokenizer_file, utterances())
    return Fixtures(entries, text_ids, utterance_ids, embeddings, top1)


def fixtures(tmp: Path) -> Fixtures:
    """$BERTH_GPU_FIXTURES if set, else built here from the packages."""
    carried = os.environ.get(FIXTURES_ENV)
    return load_fixtures(Path(carried)) if carried else build_fixtures(tmp)


def write_fixtures(out: Path) -> None:
    """fp16 checkpoint, a repository using it, and fp32 references, into out."""
    with tempfile.TemporaryDirectory() as tmp:
        built = build_fixtures(Path(tmp))
        source = built.entries["minilm"].checkpoint_dir
        checkpoint = out / "checkpoint"
        checkpoint.mkdir(parents=True, exist_ok=True)
        weights = load_file(source / "model.safetensors")
        half = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
        save_file(half, checkpoint / "model.safetensors", metadata={"format": "pt"})
        # The tokenizer's files too: the GPU tests build checkpoints around it.
        for name in (
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
        ):
            shutil.copy(source / name, checkpoint / name)
        for name, entry in built.entries.items():
            entry_dir = out / "repo" / name
            entry_dir.mkdir(parents=True, exist_ok=True)
            entry.checkpoint = "../../checkpoint"
            entry.buckets = [b for b in entry.buckets if b <= MAX_TOKENS]
            (entry_dir / "berth.json").write_text(entry.to_json())
            for extra in (entry.head, entry.labels):
                if extra:
                    shutil.copy(Path(entry.root) / extra, entry_dir / extra)
        np.savez(
            out / "reference.npz",
            embeddings=built.embeddings,
            intent_top1=built.intent_top1,
            digest=digest(built.text_ids + built.utterance_ids),
        )


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    write_fixtures(Path(sys.argv[1]))
    print(f"GPU test fixtures written to {sys.argv[1]}", file=sys.stderr)
