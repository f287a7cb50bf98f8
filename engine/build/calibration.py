"""Real texts for calibrating quantized variants, and padded batches of them.

``engine/data/calibration_texts.txt`` ships with berth (its header says how
it was built). Its first :data:`CALIBRATION_COUNT` texts calibrate (FP8
activation scales, TensorRT's INT8 entropy calibrator); the rest, disjoint
from them, measure accuracy. Batches are padded per length bucket exactly as
the batcher pads them: int32 ids padded with 0, int32 lengths.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

log = logging.getLogger("berth.engine")

TEXTS_FILE = Path(__file__).parent.parent / "data" / "calibration_texts.txt"
CALIBRATION_COUNT = 256


# What a text of the file is: a request to an assistant, or prose from a
# package's description (an intent classifier's answer to prose is a near tie).
KINDS = ("utterance", "prose")


def read_labelled(path: Path = TEXTS_FILE) -> list[tuple[str, str]]:
    """(kind, text) of every line: "<kind>\\t<text>", '#' comment lines skipped."""
    labelled = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        kind, tab, text = line.partition("\t")
        if not tab or kind not in KINDS or not text.strip():
            raise ValueError(f"{path}:{number}: not '<{'|'.join(KINDS)}>\\t<text>'")
        labelled.append((kind, text))
    return labelled


def read_texts(path: Path = TEXTS_FILE) -> list[str]:
    """Every text of the file, in its order."""
    return [text for _, text in read_labelled(path)]


def calibration_texts(path: Path = TEXTS_FILE) -> list[str]:
    return read_texts(path)[:CALIBRATION_COUNT]


def evaluation_texts(path: Path = TEXTS_FILE) -> list[str]:
    """The texts after the calibration ones: never seen by a calibrator."""
    return read_texts(path)[CALIBRATION_COUNT:]


def evaluation_kinds(path: Path = TEXTS_FILE) -> list[str]:
    """The kind of each of :func:`evaluation_texts`."""
    return [kind for kind, _ in read_labelled(path)[CALIBRATION_COUNT:]]


def intent_agreement(
    probs: np.ndarray, reference: np.ndarray, kinds: Sequence[str]
) -> dict[str, float | int | None]:
    """Top-1 agreement of a variant's intent probabilities [texts, labels] with
    the reference's, over every text and over the utterances alone (prose
    gets a near tie of the 157 labels, which any rounding may flip)."""
    agree = probs.argmax(axis=1) == reference.argmax(axis=1)
    on_utterances = agree[np.asarray(kinds) == "utterance"]
    return {
        "intent_agreement": round(float(agree.mean()), 5),
        "intent_disagreements": int((~agree).sum()),
        "intent_agreement_utterances": (
            round(float(on_utterances.mean()), 5) if on_utterances.size else None
        ),
        "intent_disagreements_utterances": int((~on_utterances).sum()),
    }


def load_tokenizer(tokenizer_file: Path, max_tokens: int) -> Tokenizer:
    """The checkpoint's tokenizer, truncating at ``max_tokens``, never padding."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_tokens)
    return tokenizer


def tokenize(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch(list(texts))]


@dataclass(frozen=True)
class TokenBatch:
    """One padded batch: ids int32 [B, L], lengths int32 [B], and which texts."""

    ids: np.ndarray
    lengths: np.ndarray
    index: np.ndarray  # int64 [B]: positions of the rows in the input list


def pad_batches(
    sequences: Sequence[Sequence[int]], buckets: Sequence[int], batch_size: int
) -> list[TokenBatch]:
    """Group sequences by the smallest bucket that holds them; pad each group.

    Sequences longer than the last bucket are an error (truncate first).
    Batches come bucket by bucket, rows in input order within a bucket.
    """
    lengths = sorted(buckets)
    groups: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        b = bisect_left(lengths, len(seq))
        if b == len(lengths):
            raise ValueError(
                f"sequence {i} has {len(seq)} tokens, over the last bucket "
                f"{lengths[-1]}; truncate it first"
            )
        groups.setdefault(lengths[b], []).append(i)
    batches = []
    for bucket in sorted(groups):
        rows = groups[bucket]
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            ids = np.zeros((len(chunk), bucket), dtype=np.int32)
            lens = np.zeros(len(chunk), dtype=np.int32)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = sequences[i]
                lens[row] = len(sequences[i])
            batches.append(TokenBatch(ids, lens, np.asarray(chunk, dtype=np.int64)))
    return batches


def text_batches(
    tokenizer_file: Path,
    texts: Sequence[str],
    buckets: Sequence[int],
    batch_size: int,
) -> list[TokenBatch]:
    """``texts`` tokenized by the model's tokenizer and padded per bucket."""
    tokenizer = load_tokenizer(tokenizer_file, max(buckets))
    batches = pad_batches(tokenize(tokenizer, texts), buckets, batch_size)
    log.info(
        "%d texts tokenized into %d batches (buckets %s)",
        len(texts),
        len(batches),
        sorted({b.ids.shape[1] for b in batches}),
    )
    return batches


def gather_rows(
    batches: Sequence[TokenBatch], outputs: Iterator[np.ndarray]
) -> np.ndarray:
    """Per-batch outputs [B, W] put back in the input order of the texts."""
    parts = list(outputs)
    total = sum(len(b.index) for b in batches)
    result = np.empty((total, parts[0].shape[1]), dtype=parts[0].dtype)
    for batch, out in zip(batches, parts, strict=True):
        result[batch.index] = out
    return result
