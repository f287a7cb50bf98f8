"""The gateway's response cache: the LRU itself, Gateway._run around it, e2e."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

from gateway.cache import ENTRY_OVERHEAD_BYTES, ModelCache, ResponseCache
from gateway.service import Gateway
from gateway.tokenize import Limits
from services.errors import InvalidInput
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc, internal_pb2
from services.repository import load_repository


def row(value: float, width: int = 4) -> np.ndarray:
    return np.full(width, value, dtype=np.float32)


def test_lru_counts_hits_and_misses_and_evicts_oldest() -> None:
    cache = ModelCache(max_entries=2, max_bytes=1 << 20)
    assert cache.get(False, "a") is None
    cache.put(False, "a", row(1), 3)
    cache.put(False, "b", row(2), 4)
    hit = cache.get(False, "a")  # "a" is now the most recent
    assert hit is not None and hit[1] == 3 and hit[0][0] == 1
    cache.put(False, "c", row(3), 5)  # evicts "b"
    assert cache.get(False, "b") is None
    assert cache.get(False, "c") is not None
    assert (cache.hits, cache.misses, cache.evictions, len(cache)) == (2, 2, 1, 2)


def test_truncate_is_part_of_the_key() -> None:
    cache = ModelCache(max_entries=10, max_bytes=1 << 20)
    cache.put(True, "long text", row(1), 512)
    assert cache.get(False, "long text") is None
    assert cache.get(True, "long text") is not None


def test_byte_bound_evicts_and_too_big_entries_are_skipped() -> None:
    one = row(0, 256).nbytes + ENTRY_OVERHEAD_BYTES + 100
    cache = ModelCache(max_entries=100, max_bytes=3 * one)
    for i in range(10):
        cache.put(False, f"t{i}", row(i, 256), 1)
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 3 and cache.evictions == 7
    cache.put(False, "huge", row(0, 100_000), 1)
    assert cache.get(False, "huge") is None and len(cache) == 3


def test_cached_rows_are_private_copies() -> None:
    cache = ModelCache(max_entries=10, max_bytes=1 << 20)
    batch = np.ones((4, 8), dtype=np.float32)
    cache.put(False, "x", batch[1], 2)
    batch[1] = 7  # the caller's array changes; the cache's does not
    found = cache.get(False, "x")
    assert found is not None and found[0].base is None and found[0][0] == 1
    with pytest.raises(ValueError):
        found[0][0] = 5


def test_disabled_cache_stores_nothing() -> None:
    for entries, size in ((0, 1 << 20), (10, 0)):
        cache = ResponseCache(entries, size)
        cache.insert("m", False, ["a"], [row(1)], [2])
        assert cache.lookup("m", False, ["a"]) == [None]
        assert not cache.enabled and cache.hits == cache.misses == 0


class FakeBatcher:
    """Answers every sequence with a row derived from its token ids."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    async def run(
        self, model: str, ids: list[np.ndarray], timeout_ms: int
    ) -> list[internal_pb2.SequenceResult]:
        self.calls.append(len(ids))
        return [
            internal_pb2.SequenceResult(
                output=row(float(seq.sum()), 384).tobytes(),
                queue_us=5,
                inference_us=7,
            )
            for seq in ids
        ]


@pytest.fixture
def gateway(repository: Path) -> tuple[Gateway, FakeBatcher]:
    batcher = FakeBatcher()
    entries = load_repository(repository)
    cache = ResponseCache(max_entries=100, max_bytes=1 << 20)
    return Gateway(entries, cast(Any, batcher), Limits(), 10, cache), batcher


def run(gw: Gateway, texts: list[str], truncate: bool = False) -> Any:
    timings = berth_pb2.Timings()
    options = berth_pb2.Options(truncate=truncate)
    out = asyncio.run(gw._run(gw.models["minilm"], texts, options, 10.0, timings))
    return out, timings


def test_hits_skip_the_batcher_and_misses_run_once(
    gateway: tuple[Gateway, FakeBatcher],
) -> None:
    gw, batcher = gateway
    (first, counts), _ = run(gw, ["hello", "world", "hello"])
    assert batcher.calls == [2]  # the duplicate "hello" ran once
    (again, counts2), timings = run(gw, ["world", "hello"])
    assert batcher.calls == [2]  # all hits: the batcher never saw the call
    assert timings.tokenize_us == timings.inference_us == 0
    np.testing.assert_array_equal(again, first[[1, 0]])
    assert counts2 == [counts[1], counts[0]]
    run(gw, ["hello", "new text"])
    assert batcher.calls == [2, 1]  # only the miss went out
    cache = gw.cache.models["minilm"]
    assert (cache.hits, cache.misses) == (3, 4)


def test_errors_name_the_callers_index_despite_hits(
    gateway: tuple[Gateway, FakeBatcher],
) -> None:
    gw, _ = gateway
    run(gw, ["cached"])
    with pytest.raises(InvalidInput, match=r"texts\[1\] is empty"):
        run(gw, ["cached", ""])
    long = "word " * 600
    run(gw, [long], truncate=True)
    with pytest.raises(InvalidInput, match=r"texts\[1\] has 602 tokens"):
        run(gw, ["cached", long])


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
    assert hit.timings.inference_us == 0 and hit.timings.tokenize_us == 0
    assert list(hit.embeddings[0].values) == list(miss.embeddings[0].values)
    assert hit.embeddings[0].tokens == miss.embeddings[0].tokens
    # Normalization happens after the cache: a hit can be unnormalized too.
    raw = embed(client, [text], normalize=False)
    assert raw.timings.inference_us == 0
    vector = np.array(raw.embeddings[0].values)
    assert abs(np.linalg.norm(vector) - 1.0) > 1e-3
    np.testing.assert_allclose(
        vector / np.linalg.norm(vector), miss.embeddings[0].values, atol=1e-6
    )


def test_cached_truncation_does_not_skip_the_limit(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    long = "cache " * 700
    assert embed(client, [long], truncate=True).embeddings[0].tokens == 512
    with pytest.raises(grpc.RpcError) as info:
        embed(client, ["fine", long])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "texts[1] has" in (info.value.details() or "")
