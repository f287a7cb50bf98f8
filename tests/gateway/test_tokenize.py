"""The gateway's TextEncoder on the default model's tokenizer (no stack)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gateway.tokenize import Limits, TextEncoder
from services.cli.default_models import minilm_checkpoint
from services.errors import InvalidInput
from services.repository import ModelEntry

MAX_TOKENS = 16


def encoder(checkpoint: Path) -> TextEncoder:
    entry = ModelEntry(
        name="minilm",
        task="embed",
        checkpoint=str(checkpoint),
        max_tokens=MAX_TOKENS,
        root="/",
    )
    return TextEncoder(entry, Limits())


TEXTS = [
    "hello world",
    " ",
    "\t\n",
    "\x00",
    "\u200b",
    "[CLS]",
    "[SEP] [PAD] [MASK] [UNK]",
    "héllo wörld 中文 😀",
    "word " * 40,  # over MAX_TOKENS: truncated
    "a" * 500,
]


def test_encode_gives_the_tokenizer_s_own_ids() -> None:
    """encode_batch_fast (no character offsets) gives the ids encode does,
    special tokens and all; a text over the limit keeps its first tokens and
    the closing [SEP]."""
    checkpoint = minilm_checkpoint()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    got = encoder(checkpoint).encode(TEXTS, truncate=True)
    for text, ids in zip(TEXTS, got, strict=True):
        full = tokenizer.encode(text, add_special_tokens=True).ids
        want = full if len(full) <= MAX_TOKENS else full[: MAX_TOKENS - 1] + full[-1:]
        assert ids.tolist() == want, text
    one = encoder(checkpoint).encode(["[CLS] hello"], truncate=False)
    assert one[0].tolist() == tokenizer.encode("[CLS] hello").ids


def test_a_text_with_no_tokens_is_refused_naming_it(tmp_path: Path) -> None:
    """A tokenizer that adds no [CLS] / [SEP] (no post-processor) gives no
    token for whitespace alone: refused here, naming the caller's text. (It
    went to the batcher, which answered 'malformed Sequences ... sequence id
    17 has no tokens (offsets[0] = offsets[1] = 0)'.)"""
    source = json.loads((minilm_checkpoint() / "tokenizer.json").read_text())
    source["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(source))
    bare = encoder(tmp_path)
    assert bare.encode(["hello"], truncate=False)[0].size > 0
    with pytest.raises(InvalidInput) as info:
        bare.encode(["hello", " \t "], truncate=True)
    assert str(info.value).startswith(
        "texts[1] has no tokens for model 'minilm' (its 3 characters"
    ), str(info.value)


@pytest.mark.parametrize("extra", [-1, 0, 1, 2])
def test_the_token_limit_is_exact(extra: int) -> None:
    """A text of exactly MAX_TOKENS tokens ([CLS] and [SEP] counted) is taken
    as it is; one token more is refused, naming its count and the limit."""
    words = MAX_TOKENS - 2 + extra  # "word" is one token each
    text = " ".join(["word"] * words)
    enc = encoder(minilm_checkpoint())
    if extra <= 0:
        (ids,) = enc.encode([text], truncate=False)
        assert len(ids) == MAX_TOKENS + extra
        return
    with pytest.raises(InvalidInput) as info:
        enc.encode([text], truncate=False)
    assert f"texts[0] has {MAX_TOKENS + extra} tokens, over the limit of " in str(
        info.value
    )
    assert f"the limit of {MAX_TOKENS} " in str(info.value)
    (cut,) = enc.encode([text], truncate=True)
    assert len(cut) == MAX_TOKENS
