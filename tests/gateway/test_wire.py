"""The gateway's wire work: hand-built response bytes, merged batcher writes."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as kserve_pb2

from gateway.batcher_client import merge_messages
from gateway.berth import embeddings_wire, packed_floats
from services.proto.berth.v1 import berth_pb2, internal_pb2


@pytest.mark.parametrize(
    ("width", "rows"), [(768, 1), (384, 3), (4, 2), (1, 1), (1024, 40)]
)
def test_embeddings_wire_equals_protobuf_serialization(width: int, rows: int) -> None:
    rng = np.random.default_rng(width * rows)
    vectors = rng.standard_normal((rows, width)).astype(np.float32)
    vectors[0, 0] = -0.0  # signs, zeros, extremes survive byte for byte
    vectors[-1, -1] = np.finfo(np.float32).max
    # Token counts across varint byte boundaries (1, 2 and 3 bytes).
    counts = [int(c) for c in rng.choice([0, 1, 127, 128, 16383, 16384], rows)]
    built = berth_pb2.EmbedResponse(model="m", request_id=7)
    built.embeddings.extend(
        berth_pb2.Embedding(values=v.tolist(), tokens=n)
        for v, n in zip(vectors, counts, strict=True)
    )
    merged = berth_pb2.EmbedResponse(model="m", request_id=7)
    merged.MergeFromString(embeddings_wire(vectors, counts))
    assert merged.SerializeToString() == built.SerializeToString()
    np.testing.assert_array_equal(
        np.array([e.values for e in merged.embeddings], dtype=np.float32), vectors
    )
    assert [e.tokens for e in merged.embeddings] == counts


def test_float64_vectors_are_sent_as_float32() -> None:
    vectors = np.array([[0.5, -1.25]], dtype=np.float64)
    merged = berth_pb2.EmbedResponse()
    merged.MergeFromString(embeddings_wire(vectors, [3]))
    assert list(merged.embeddings[0].values) == [0.5, -1.25]


@pytest.mark.parametrize("shape", [(256, 384), (1, 1), (3, 157), (0, 4)])
def test_packed_floats_equal_protobuf_serialization(shape: tuple[int, int]) -> None:
    # (tritonclient's stubs of the KServe messages: this process imports no
    # others, see tests/gateway/test_kserve.py)
    contents = kserve_pb2.InferTensorContents
    field = contents.DESCRIPTOR.fields_by_name["fp32_contents"].number
    values = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    built = contents(fp32_contents=values.ravel().tolist())
    merged = contents()
    merged.MergeFromString(packed_floats(field, values))
    assert merged.SerializeToString() == built.SerializeToString()
    np.testing.assert_array_equal(np.array(merged.fp32_contents), values.ravel())


def test_packed_floats_of_float64_and_of_a_two_byte_tag() -> None:
    merged = berth_pb2.Embedding()
    merged.MergeFromString(packed_floats(1, np.array([0.5, -2.0])))
    assert list(merged.values) == [0.5, -2.0]
    assert packed_floats(16, np.zeros(1))[:2] == bytes([0x82, 0x01])


def _request(first_id: int, texts: int, tokens: int) -> internal_pb2.GatewayMessage:
    offsets = np.arange(texts + 1, dtype="<i4") * tokens
    return internal_pb2.GatewayMessage(
        sequences=[
            internal_pb2.Sequences(
                model="minilm",
                ids=list(range(first_id, first_id + texts)),
                token_ids=np.ones(texts * tokens, dtype="<i4").tobytes(),
                offsets=offsets.tobytes(),
            )
        ]
    )


def test_merged_messages_keep_order_and_stay_under_the_limit() -> None:
    # (ids of one varint width, so every request has the same size)
    queued = [_request(1000 + 100 * i, texts=4, tokens=64) for i in range(10)]
    queued.insert(3, internal_pb2.GatewayMessage(cancel=internal_pb2.Cancel(ids=[7])))
    queued.append(_request(5000, texts=64, tokens=512))  # alone over the limit
    limit = 3 * queued[0].ByteSize()
    merged = merge_messages(queued, limit)
    # Nothing lost or reordered; cancels kept.
    assert [s.ids[0] for m in merged for s in m.sequences] == [
        1000 + 100 * i for i in range(10)
    ] + [5000]
    assert [i for m in merged for i in m.cancel.ids] == [7]
    # Every message fits, but for the one request that alone exceeds it.
    assert all(m.ByteSize() <= limit for m in merged[:-1])
    assert len(merged[-1].sequences) == 1 and merged[-1].ByteSize() > limit
    # Greedy: 3 requests; the cancel and 2; 3; 2; the big one.
    assert [len(m.sequences) for m in merged] == [3, 2, 3, 2, 1]
    # One message when everything fits.
    assert len(merge_messages(queued[:3], 10 * limit)) == 1
