"""Tokenization and input validation, run off the event loop.

Every rejection is an InvalidInput whose message names the limit and the
value, so a caller can fix the request without reading our code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        prepared = []
        for i, text in enumerate(texts):
            if not text:
                raise InvalidInput(
                    f"texts[{i}] is empty: every text needs characters",
                    field=f"texts[{i}]",
                )
            if len(text) > self.max_chars:
                if not truncate:
                    raise self._too_long(i, text, "shorten it or set options.truncate")
                text = text[: self.max_chars]
            prepared.append(prompt + text)
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

    def tokens(self, texts: list[str]) -> list[tuple[list[int], list[str]]]:
        """Ids and token strings per text as the model sees it, [CLS] ...
        [SEP], the prompt included. A text over the token limit is tokenized
        whole (that is how a caller learns how far over it is); one over the
        character guard is refused untokenized."""
        self.check_count(texts)
        for i, text in enumerate(texts):
            if len(text) > self.max_chars:
                raise self._too_long(i, text, "shorten it")
        prompted = [self.prompt + text for text in texts]
        return [
            (e.ids, e.tokens)
            for e in self.tokenizer.encode_batch(prompted, add_special_tokens=True)
        ]

    def _too_long(self, i: int, text: str, advice: str) -> InvalidInput:
        """texts[i] is over the character guard (refused before tokenizing)."""
        return InvalidInput(
            f"texts[{i}] has {len(text)} characters, over the limit of "
            f"{self.max_chars} for model {self.model!r}; {advice}",
            field=f"texts[{i}]",
        )
