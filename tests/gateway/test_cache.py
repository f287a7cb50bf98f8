"""The gateway's response cache: the LRU itself, then through `berth serve`."""

from __future__ import annotations

import re
import sys
import urllib.request
import uuid
from typing import Any

import grpc
import numpy as np
import pytest

from gateway.cache import ENTRY_OVERHEAD_BYTES, ModelCache, ResponseCache
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.stack import Stack


def row(value: float, width: int = 4) -> np.ndarray:
    return np.full(width, value, dtype=np.float32)


def test_lru_counts_hits_and_misses_and_evicts_oldest() -> None:
    cache = ModelCache(max_entries=2, max_bytes=1 << 20)
    assert cache.get("", False, "a") is None
    cache.put("", False, "a", row(1), 3)
    cache.put("", False, "b", row(2), 4)
    hit = cache.get("", False, "a")  # "a" is now the most recent
    assert hit is not None and hit[1] == 3 and hit[0][0] == 1
    cache.put("", False, "c", row(3), 5)  # evicts "b"
    assert cache.get("", False, "b") is None
    assert cache.get("", False, "c") is not None
    assert (cache.hits, cache.misses, cache.evictions, len(cache)) == (2, 2, 1, 2)


def test_truncate_is_part_of_the_key() -> None:
    cache = ModelCache(max_entries=10, max_bytes=1 << 20)
    cache.put("", True, "long text", row(1), 512)
    assert cache.get("", False, "long text") is None
    assert cache.get("", True, "long text") is not None


def test_tenants_never_see_each_others_entries() -> None:
    cache = ResponseCache(max_entries=10, max_bytes=1 << 20)
    cache.insert("m", "tenant a", False, ["shared"], [row(1)], [3], (1, 2, 3, 4))
    assert cache.lookup("m", "tenant b", False, ["shared"]) == [None]
    assert cache.lookup("m", "", False, ["shared"]) == [None]
    (found,) = cache.lookup("m", "tenant a", False, ["shared"])
    assert found is not None and found[1] == 3 and found[2] == (1, 2, 3, 4)


# Texts that agree on a long prefix, differ only in case, whitespace or one
# character at either end, or are equal only after Unicode normalization: a
# key made of less than the whole exact text answers one with another's row.
NEAR_DUPLICATES = [
    "the quarterly report is due on friday, please send it to finance " * 3,
    "the quarterly report is due on friday, please send it to finance " * 3 + "!",
    "the quarterly report is due on friday, please send it to finance " * 3 + " ",
    "The quarterly report is due on friday, please send it to finance " * 3,
    "the quarterly report is due on friday, please send it to finance " * 2,
    "café au lait",  # composed é
    "cafe\u0301 au lait",  # e + combining accent: the same text once normalized
    "word " * 200,
    "word " * 199 + "worm",
]


def test_near_duplicates_have_entries_of_their_own() -> None:
    cache = ModelCache(max_entries=100, max_bytes=1 << 20)
    for i, text in enumerate(NEAR_DUPLICATES):
        assert cache.get("", False, text) is None, f"{i} hit before it was put"
        cache.put("", False, text, row(i), i + 1)
    assert len(cache) == len(NEAR_DUPLICATES)
    for i, text in enumerate(NEAR_DUPLICATES):
        found = cache.get("", False, text)
        assert found is not None and found[0][0] == i and found[1] == i + 1, i


def test_byte_bound_evicts_and_too_big_entries_are_skipped() -> None:
    one = row(0, 256).nbytes + ENTRY_OVERHEAD_BYTES + 100
    cache = ModelCache(max_entries=100, max_bytes=3 * one)
    for i in range(10):
        cache.put("", False, f"t{i}", row(i, 256), 1)
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 3 and cache.evictions == 7
    cache.put("", False, "huge", row(0, 100_000), 1)
    assert cache.get("", False, "huge") is None and len(cache) == 3


def test_cached_rows_are_private_copies() -> None:
    cache = ModelCache(max_entries=10, max_bytes=1 << 20)
    batch = np.ones((4, 8), dtype=np.float32)
    cache.put("", False, "x", batch[1], 2)
    batch[1] = 7  # the caller's array changes; the cache's does not
    found = cache.get("", False, "x")
    assert found is not None and found[0].base is None and found[0][0] == 1
    with pytest.raises(ValueError):
        found[0][0] = 5


def test_disabled_cache_stores_nothing() -> None:
    for entries, size in ((0, 1 << 20), (10, 0)):
        cache = ResponseCache(entries, size)
        cache.insert("m", "", False, ["a"], [row(1)], [2])
        assert cache.lookup("m", "", False, ["a"]) == [None]
        assert not cache.enabled and cache.hits == cache.misses == 0


def test_entries_are_sized_as_stored_whatever_dtype_they_come_in() -> None:
    """A row is stored as float32: a float64 row must not count double (nor a
    float16 one half, letting the cache outgrow its byte bound)."""
    cache = ModelCache(max_entries=10, max_bytes=1 << 20)
    for dtype in (np.float64, np.float16, np.float32):
        cache.put("", False, str(np.dtype(dtype)), row(1, 384).astype(dtype), 3)
    stored = sum(
        found[0].nbytes + sys.getsizeof(text) + sys.getsizeof("") + ENTRY_OVERHEAD_BYTES
        for text in ("float64", "float16", "float32")
        if (found := cache.get("", False, text)) is not None
    )
    assert len(cache) == 3 and cache.bytes == stored


def batcher_sequences(stack: Stack) -> float:
    """Sequences the batcher has answered OK for minilm (its /metrics)."""
    text = urllib.request.urlopen(stack.metrics[1], timeout=10).read().decode()
    pattern = r'berth_batcher_sequences_total\{model="minilm",outcome="ok"\}'
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if re.fullmatch(pattern, line.rpartition(" ")[0])
    )


def test_hits_skip_the_batcher_and_misses_run_once(
    stack: Stack, client: berth_pb2_grpc.BerthStub
) -> None:
    tag = uuid.uuid4().hex  # texts no other test sent
    hello, world, new = f"hello {tag}", f"world {tag}", f"new text {tag}"
    before = batcher_sequences(stack)
    first = embed(client, [hello, world, hello])
    assert batcher_sequences(stack) - before == 2  # the duplicate ran once
    again = embed(client, [world, hello])
    assert batcher_sequences(stack) - before == 2  # all hits: batcher untouched
    assert again.timings == first.timings  # those of the call that filled them
    assert list(again.embeddings[0].values) == list(first.embeddings[1].values)
    assert list(again.embeddings[1].values) == list(first.embeddings[0].values)
    embed(client, [hello, new])
    assert batcher_sequences(stack) - before == 3  # only the miss went out


def test_errors_name_the_callers_index_despite_hits(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    cached = f"cached {uuid.uuid4().hex}"
    embed(client, [cached])
    with pytest.raises(grpc.RpcError, match=r"texts\[1\] is empty"):
        embed(client, [cached, ""])
    long = "word " * 600
    embed(client, [long], truncate=True)
    with pytest.raises(grpc.RpcError, match=r"texts\[1\] has 602 tokens"):
        embed(client, [cached, long])


# ---- end to end, through `berth serve` --------------------------------------


def embed(client: berth_pb2_grpc.BerthStub, texts: list[str], **options: Any) -> Any:
    request = berth_pb2.EmbedRequest(
        model="minilm", texts=texts, options=berth_pb2.Options(**options)
    )
    return client.Embed(request, timeout=60)


def test_repeated_text_is_a_hit_with_the_same_answer(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    text = "cache e2e: the first time this text is seen, it runs"
    miss = embed(client, [text])
    assert miss.timings.inference_us > 0
    hit = embed(client, [text])
    assert hit.timings == miss.timings  # a hit tells nothing by its timings
    assert list(hit.embeddings[0].values) == list(miss.embeddings[0].values)
    assert hit.embeddings[0].tokens == miss.embeddings[0].tokens
    # Normalization happens after the cache: a hit can be unnormalized too.
    raw = embed(client, [text], normalize=False)
    assert raw.timings == miss.timings
    vector = np.array(raw.embeddings[0].values)
    assert abs(np.linalg.norm(vector) - 1.0) > 1e-3
    np.testing.assert_allclose(
        vector / np.linalg.norm(vector), miss.embeddings[0].values, atol=1e-6
    )


def test_near_duplicate_texts_are_answered_as_themselves(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    """Each near-duplicate, sent after all the others are cached, gets the
    row it gets when it is the only text the cache has not seen."""
    tag = uuid.uuid4().hex
    texts = [f"{tag} {text}" for text in NEAR_DUPLICATES]
    first = embed(client, texts)  # every text a miss: each computed itself
    assert first.timings.inference_us > 0
    again = embed(client, texts)  # every text a hit
    assert again.timings == first.timings
    for i, (a, b) in enumerate(zip(first.embeddings, again.embeddings, strict=True)):
        assert list(a.values) == list(b.values), f"texts[{i}] got another's row"
        assert a.tokens == b.tokens
    # Texts the model tells apart (their token ids differ: the uncased
    # tokenizer folds case, accents and edge whitespace) got different rows.
    request = berth_pb2.TokenizeRequest(model="minilm", texts=texts)
    ids = [tuple(r.ids) for r in client.Tokenize(request, timeout=60).results]
    rows = [tuple(e.values) for e in first.embeddings]
    assert len(set(ids)) >= 5, "the near-duplicates must differ as tokens too"
    for i in range(len(texts)):
        for j in range(i):
            if ids[i] != ids[j]:
                assert rows[i] != rows[j], f"texts[{i}] and texts[{j}] share a row"


def test_cached_truncation_does_not_skip_the_limit(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    long = "cache " * 700
    assert embed(client, [long], truncate=True).embeddings[0].tokens == 256
    with pytest.raises(grpc.RpcError) as info:
        embed(client, ["fine", long])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "texts[1] has" in (info.value.details() or "")


def test_a_hit_reports_the_timings_of_the_miss_that_filled_it(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    """A hit's timings are those of the computation behind its entry: a
    caller cannot tell from them whether a text was cached."""
    text = f"timings of a hit {uuid.uuid4().hex}"
    miss = embed(client, [text])
    assert miss.timings.inference_us > 0 and miss.timings.tokenize_us > 0
    for _ in range(3):
        hit = embed(client, [text])
        assert hit.timings == miss.timings
    other = f"timings of a batch {uuid.uuid4().hex}"
    both = embed(client, [other, f"{other} too"])
    assert embed(client, [f"{other} too"]).timings == both.timings
