"""Level-3 fallback of a rerank model: lexical overlap, numpy only.

The static-vector fallback (services/fallback_model.py) embeds one text; a
cross-encoder scores a pair, and no static vector stands in for reading the
query and the text together. While a rerank model's circuit is open, the
gateway scores each pair by how much of the query the text holds, as BM25
does: each query token weighs its SIF weight (its frequency guessed from
the vocabulary's order: services.fallback_model.zipf_weights), a text's
count of it saturates (k1, and b over the text's length against the call's
mean length), and the score is the share of the query's weight the text
holds, from 0 to 1.

It takes the ids the gateway already produces for the pair (the query, a
separator, the text; the text's ids moved by the model's token-type offset)
and returns what the engines return, a raw score per pair: the logit of
that share, so that the model's sigmoid gives the share back (0.01 to 0.99).
Nothing is built or stored: it is made from the tokenizer when the gateway
loads the model. It ranks by words shared, not by meaning, and its scores
are not on the model's scale: the response says degraded.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from services.fallback_model import zipf_weights

# SIF's a, as the static-vector fallback's (engine/build/fallback.py).
SIF = 1e-3
# BM25's term saturation and length normalization.
K1, B = 1.2, 0.75
# The share a score stands for is kept in [CLIP, 1 - CLIP].
CLIP = 0.01


class PairFallback:
    """A rerank model's lexical stand-in (see the module's docstring)."""

    def __init__(self, name: str, tokenizer: Tokenizer, type_offset: int) -> None:
        self.name = name
        self.type_offset = type_offset
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        specials = sorted(
            i
            for i, token in tokenizer.get_added_tokens_decoder().items()
            if token.special
        )
        self.specials = np.zeros(vocab, dtype=bool)
        self.specials[[i for i in specials if i < vocab]] = True
        self.weights = zipf_weights(tokenizer, vocab, specials, SIF)

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The query's and the text's tokens of one pair, special tokens
        left out: the query runs from after the first token to the first
        special token after it, the text is everything after that."""
        if self.type_offset:
            ids = ids % self.type_offset
        ids = np.clip(ids, 0, len(self.specials) - 1)
        special = self.specials[ids]
        after_first = np.flatnonzero(special[1:])
        end = int(after_first[0]) + 1 if len(after_first) else len(ids)
        query, text = ids[1:end], ids[end:]
        return query[~self.specials[query]], text[~self.specials[text]]

    def run(self, ids_list: list[np.ndarray]) -> np.ndarray:
        """A raw score per pair, [N, 1] float32, as the engines answer."""
        pairs = [self.split(ids) for ids in ids_list]
        mean_length = max(1.0, float(np.mean([len(text) for _, text in pairs])))
        scores = np.empty((len(pairs), 1), dtype=np.float32)
        for row, (query, text) in enumerate(pairs):
            terms, counts = np.unique(text, return_counts=True)
            asked = np.unique(query)
            total = float(self.weights[asked].sum())
            found = np.isin(terms, asked)
            tf = counts[found].astype(np.float64)
            saturation = K1 * (1 - B + B * len(text) / mean_length)
            held = self.weights[terms[found]] * tf * (K1 + 1) / (tf + saturation)
            share = float(held.sum()) / ((K1 + 1) * total) if total > 0 else 0.0
            share = min(max(share, CLIP), 1 - CLIP)
            scores[row, 0] = np.log(share / (1 - share))
        return scores
