"""A Python client of berth's gateway: embeddings, classification,
reranking and tokenization over gRPC (berth.v1.Berth).

    from berth_client import Client

    with Client("127.0.0.1:50051") as berth:
        vectors = berth.embed(["hello world"], model="minilm").vectors

Needs only grpcio and protobuf. :class:`AsyncClient` is the asyncio
counterpart; ``berth_pb2`` and ``berth_pb2_grpc`` are the generated
messages and stub.
"""

from berth_client._proto.berth.v1 import berth_pb2, berth_pb2_grpc
from berth_client.aio import AsyncClient
from berth_client.channel import Retry, Tls
from berth_client.client import Client
from berth_client.errors import (
    BerthError,
    Cancelled,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    Overloaded,
    PermissionDenied,
    ServerError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from berth_client.results import (
    ClassifyResult,
    EmbedResult,
    Label,
    Ranked,
    RerankResult,
    TokenizeResult,
    classify_request,
    embed_request,
    rerank_request,
)

__all__ = [
    "AsyncClient",
    "BerthError",
    "Cancelled",
    "ClassifyResult",
    "Client",
    "DeadlineExceeded",
    "EmbedResult",
    "InvalidInput",
    "Label",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "Ranked",
    "RerankResult",
    "Retry",
    "ServerError",
    "Tls",
    "TokenizeResult",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "berth_pb2",
    "berth_pb2_grpc",
    "classify_request",
    "embed_request",
    "rerank_request",
]
