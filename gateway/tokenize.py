"""Tokenization and input validation, run off the event loop.

Every rejection is an InvalidInput whose message names the limit and the
value, so a caller can fix the request without reading our code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from services.errors import InvalidInput
from services.repository import ModelEntry

# Characters allowed per token of the model's limit before tokenizing: no
# text of real words comes near it, and a 50 MB string never reaches the
# tokenizer.
CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Limits:
    """Per-call limits of the gateway (flags --max-texts, --max-chars)."""

    max_texts: int = 256
    chars_per_token: int = CHARS_PER_TOKEN


class TextEncoder:
    """One model's tokenizer, with berth's limits applied."""

    def __init__(self, entry: ModelEntry, limits: Limits) -> None:
        self.model = entry.name
        self.max_tokens = entry.max_tokens
        self.max_chars = entry.max_tokens * limits.chars_per_token
        self.max_texts = limits.max_texts
        # We apply limits ourselves: the checkpoint's own truncation/padding
        # (all-MiniLM ships truncation at 128, padding to 128) must not apply.
        # Lowercasing, where the entry asks for it, is in its normalizer.
        self.tokenizer = entry.tokenizer()
        # Prepended to every text of a call that names no prompt of its own,
        # as sentence-transformers' encode prepends the default prompt; a
        # prompt's tokens count towards the limit.
        self.prompt = entry.prompt
        # A rerank model's pairs: how far the second text's ids move
        # (ModelEntry.token_type_offset), and a copy of the tokenizer that
        # cuts a pair over the limit as transformers does (longest_first:
        # a token at a time off the longer text), for calls that truncate.
        self.type_offset = entry.token_type_offset()
        self._pair_cutter: Tokenizer | None = None
        if entry.task == "rerank":
            self._pair_cutter = Tokenizer.from_str(self.tokenizer.to_str())
            self._pair_cutter.enable_truncation(
                self.max_tokens, strategy="longest_first"
            )

    def check_count(self, texts: list[str]) -> None:
        if not texts:
            raise InvalidInput("texts is empty: send at least 1 text", field="texts")
        if len(texts) > self.max_texts:
            raise InvalidInput(
                f"too many texts: {len(texts)} in one call, the limit is "
                f"{self.max_texts} (gateway flag --max-texts)",
                field="texts",
            )

    def encode(
        self, texts: list[str], truncate: bool, prompt: str | None = None
    ) -> list[np.ndarray]:
        """int32 token ids per text, [CLS] ... [SEP], each text after
        ``prompt`` (None: the model's default prompt); raises InvalidInput."""
        self.check_count(texts)
        prompt = self.prompt if prompt is None else prompt
        prepared = [prompt + self._guarded(i, t, truncate) for i, t in enumerate(texts)]
        # encode_batch_fast: encode_batch's ids without the character offsets,
        # which berth never reads: one text of benchmarks/e2e.py's mix (~100
        # characters) takes 23.1 µs against encode's 27.2 on the dev
        # machine. A batch of one is encoded on the calling thread, not the
        # tokenizer's thread pool.
        encodings = self.tokenizer.encode_batch_fast(prepared, add_special_tokens=True)
        out = []
        for i, encoding in enumerate(encodings):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            if not len(ids):
                # A tokenizer that adds no special tokens (no post-processor)
                # gives none for a text of whitespace alone. Sent on, the
                # batcher refused it as a malformed entry, naming an internal
                # sequence id and offsets instead of the caller's text.
                raise InvalidInput(
                    f"texts[{i}] has no tokens for model {self.model!r} (its "
                    f"{len(texts[i])} characters are all ones its tokenizer "
                    "drops, such as whitespace); every text needs a token",
                    field=f"texts[{i}]",
                )
            if len(ids) > self.max_tokens:
                if not truncate:
                    prompted = " (its prompt's included)" if prompt else ""
                    raise InvalidInput(
                        f"texts[{i}] has {len(ids)} tokens{prompted}, over the "
                        f"limit of {self.max_tokens} for model {self.model!r}; "
                        "shorten it or set options.truncate",
                        field=f"texts[{i}]",
                    )
                # Keep the closing special token ([SEP] / </s>).
                ids = np.concatenate([ids[: self.max_tokens - 1], ids[-1:]])
            out.append(ids)
        return out

    def encode_pairs(
        self, query: str, texts: list[str], truncate: bool
    ) -> list[np.ndarray]:
        """int32 token ids of (query, text) per text, joined as the model's
        tokenizer joins a pair ([CLS] query [SEP] text [SEP]), the text's
        ids moved by ``type_offset`` where the model embeds token types;
        raises InvalidInput. The query's tokens count toward each pair's
        limit; over it a pair is refused, or with ``truncate`` cut as
        transformers' tokenizer cuts it (longest_first)."""
        self.check_count(texts)
        if not query:
            raise InvalidInput(
                "query is empty: a rerank call needs a query", field="query"
            )
        if len(query) > self.max_chars:
            if not truncate:
                raise InvalidInput(
                    f"query has {len(query)} characters, over the limit of "
                    f"{self.max_chars} for model {self.model!r}; shorten it or "
                    "set options.truncate",
                    field="query",
                )
            query = query[: self.max_chars]
        pairs = [(query, self._guarded(i, t, truncate)) for i, t in enumerate(texts)]
        encodings = self.tokenizer.encode_batch_fast(pairs, add_special_tokens=True)
        over = [i for i, e in enumerate(encodings) if len(e.ids) > self.max_tokens]
        if over and not truncate:
            i = over[0]
            raise InvalidInput(
                f"query and texts[{i}] have {len(encodings[i].ids)} tokens together, "
                f"over the limit of {self.max_tokens} for model {self.model!r}; "
                "shorten them or set options.truncate",
                field=f"texts[{i}]",
            )
        if over:
            assert self._pair_cutter is not None
            cut = self._pair_cutter.encode_batch_fast([pairs[i] for i in over])
            for i, encoding in zip(over, cut, strict=True):
                encodings[i] = encoding
        out = []
        for encoding in encodings:
            ids = np.asarray(encoding.ids, dtype=np.int32)
            if self.type_offset:
                ids += np.asarray(encoding.type_ids, dtype=np.int32) * self.type_offset
            out.append(ids)
        return out

    def tokens(
        self, texts: list[str], prompt: str | None = None, query: str = ""
    ) -> list[tuple[list[int], list[str]]]:
        """Ids and token strings per text as the model sees it, [CLS] ...
        [SEP], after ``prompt`` (None: the default prompt), or as the pair
        (``query``, text) where a query is given (the ids the tokenizer
        gives, before any token-type offset). A text over the token limit is
        tokenized whole (that is how a caller learns how far over it is);
        one over the character guard is refused untokenized."""
        self.check_count(texts)
        for i, text in enumerate(texts):
            if len(text) > self.max_chars:
                raise self._too_long(i, text, "shorten it")
        inputs: list[Any]
        if query:
            if len(query) > self.max_chars:
                raise InvalidInput(
                    f"query has {len(query)} characters, over the limit of "
                    f"{self.max_chars} for model {self.model!r}; shorten it",
                    field="query",
                )
            inputs = [(query, text) for text in texts]
        else:
            prompt = self.prompt if prompt is None else prompt
            inputs = [prompt + text for text in texts]
        return [
            (e.ids, e.tokens)
            for e in self.tokenizer.encode_batch(inputs, add_special_tokens=True)
        ]

    def _guarded(self, i: int, text: str, truncate: bool) -> str:
        """texts[i], refused when empty or over the character guard (cut to
        it with ``truncate``)."""
        if not text:
            raise InvalidInput(
                f"texts[{i}] is empty: every text needs characters",
                field=f"texts[{i}]",
            )
        if len(text) > self.max_chars:
            if not truncate:
                raise self._too_long(i, text, "shorten it or set options.truncate")
            return text[: self.max_chars]
        return text

    def _too_long(self, i: int, text: str, advice: str) -> InvalidInput:
        """texts[i] is over the character guard (refused before tokenizing)."""
        return InvalidInput(
            f"texts[{i}] has {len(text)} characters, over the limit of "
            f"{self.max_chars} for model {self.model!r}; {advice}",
            field=f"texts[{i}]",
        )
