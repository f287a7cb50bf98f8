"""What an engine takes in a batch, checked as if a stranger sent it.

A batch is refused (INVALID_ARGUMENT, never an engine failure) before any
work or allocation that grows with the size it claims: its byte counts must
match batch_size x length, its shape must be one the engine serves (rows and
tokens within --max-batch and --token-budget, the batcher's own rule; a
length within the model's max tokens), its lengths within [1, length], and
its token ids within the model's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.repository import ModelEntry, checkpoint_shape, position_limit

WIRE_INT32 = np.dtype("<i4")


class BadBatch(ValueError):
    """A batch the engine will never compute: the sender's fault, not the
    engine's (answered INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ModelLimits:
    """What one served model takes."""

    vocab_size: int  # token ids lie in [0, vocab_size); 0: not checked here
    max_tokens: int  # the longest padded length


def model_limits(entry: ModelEntry) -> ModelLimits:
    """A model's limits, read from its checkpoint's config.json (what its
    backend builds the embedding table from) and its repository entry."""
    directory = entry.checkpoint_dir
    if not (directory / "config.json").is_file():
        return ModelLimits(0, entry.max_tokens)
    # A rerank model's pairs: the second text's ids moved past the vocabulary.
    vocab = checkpoint_shape(directory)[0] + entry.token_type_offset()
    return ModelLimits(vocab, min(entry.max_tokens, position_limit(directory)))


def max_rows(length: int, max_batch: int, token_budget: int) -> int:
    """The most rows a batch of this padded length may have (the batcher's
    rule: batch/_core_py.py, engine/cuda/graphs.py bucket_shapes)."""
    return max(1, min(max_batch, token_budget // max(length, 1)))


def check_shape(
    batch_size: int,
    length: int,
    token_bytes: int,
    length_bytes: int,
    limits: ModelLimits,
    max_batch: int,
    token_budget: int,
) -> None:
    """The claimed shape against the bytes and the engine's limits: O(1)."""
    if batch_size < 1 or length < 1:
        raise BadBatch(f"batch is {batch_size} x {length}; both must be at least 1")
    if length > limits.max_tokens:
        raise BadBatch(
            f"padded length {length} is over the model's {limits.max_tokens} tokens"
        )
    cap = max_rows(length, max_batch, token_budget)
    if batch_size > cap:
        raise BadBatch(
            f"batch of {batch_size} rows of {length} tokens is over the "
            f"{cap} rows this engine takes at that length (--max-batch "
            f"{max_batch}, --token-budget {token_budget}; start the engine with "
            "the batcher's values)"
        )
    if token_bytes != 4 * batch_size * length or length_bytes != 4 * batch_size:
        raise BadBatch(
            f"batch {batch_size} x {length} needs {4 * batch_size * length} bytes "
            f"of token ids and {4 * batch_size} of lengths, got {token_bytes} and "
            f"{length_bytes}"
        )


def check_lengths(lengths: np.ndarray, length: int) -> None:
    """Every row's real length in [1, length]."""
    if lengths.size and (lengths.min() < 1 or lengths.max() > length):
        raise BadBatch(
            f"lengths must lie in [1, {length}], got {lengths.min()} to {lengths.max()}"
        )


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Every token id in [0, vocab_size); one pass (negatives are huge as
    uint32). The first bad one is named by row and position."""
    if not vocab_size or not ids.size:
        return
    flat = ids.reshape(-1)
    unsigned = flat.view(np.uint32) if flat.dtype == WIRE_INT32 else None
    if unsigned is not None and int(unsigned.max()) < vocab_size:
        return
    if unsigned is None and flat.min() >= 0 and flat.max() < vocab_size:
        return
    where = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
    row, column = divmod(where, ids.shape[-1]) if ids.ndim == 2 else (0, where)
    raise BadBatch(
        f"token ids must lie in [0, {vocab_size}) (the model's vocabulary), got "
        f"{int(flat[where])} in row {row} at position {column}"
    )
