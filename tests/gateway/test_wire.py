"""The gateway's hand-built wire bytes parse to what protobuf itself builds."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.service import embeddings_wire
from services.proto.berth.v1 import berth_pb2


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
