"""The public berth.v1 gRPC service: calls in, statuses and answers out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

import grpc

from gateway.berth import Berth, Response, Served
from gateway.calls import (
    STREAM_WINDOW,
    AbortOnError,
    serve_requests,
    serve_unary,
    tenant_of,
)
from gateway.pipeline import Gateway
from services.errors import BerthError
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc

DEGRADED_METADATA = (("x-berth-degraded", "true"),)
# What a Stream message refused unread keeps (gateway.intake): enough for
# its answer to name its request.
STREAM_CAPTURES = frozenset(
    {
        "embed",
        "embed.model",
        "embed.request_id",
        "classify",
        "classify.model",
        "classify.request_id",
        "rerank",
        "rerank.model",
        "rerank.request_id",
    }
)


def _inner(
    request: berth_pb2.StreamRequest,
) -> berth_pb2.EmbedRequest | berth_pb2.ClassifyRequest | berth_pb2.RerankRequest:
    """The call a Stream request carries."""
    kind = request.WhichOneof("request")
    if kind == "embed":
        return request.embed
    if kind == "rerank":
        return request.rerank
    return request.classify


def _stream_error(
    request: berth_pb2.StreamRequest, error: BerthError
) -> berth_pb2.StreamResponse:
    """A Stream request's error, answered in the stream by its request id."""
    return berth_pb2.StreamResponse(
        error=berth_pb2.StreamError(
            request_id=_inner(request).request_id,
            code=error.code.name,
            message=str(error),
        )
    )


class BerthService(berth_pb2_grpc.BerthServicer):
    """gRPC adapter: maps berth errors onto status codes."""

    def __init__(self, gateway: Gateway, stream_window: int = STREAM_WINDOW) -> None:
        self.berth = Berth(gateway)
        self.stream_window = stream_window

    async def Embed(
        self, request: berth_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.EmbedResponse:
        work = self.berth.embed(request, context.time_remaining(), tenant_of(context))
        texts = len(request.texts)
        return await self._unary("Embed", "embed", request.model, texts, work, context)

    async def Classify(
        self, request: berth_pb2.ClassifyRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.ClassifyResponse:
        tenant = tenant_of(context)
        work = self.berth.classify(request, context.time_remaining(), tenant)
        texts = len(request.texts)
        return await self._unary(
            "Classify", "classify", request.model, texts, work, context
        )

    async def Rerank(
        self, request: berth_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.RerankResponse:
        tenant = tenant_of(context)
        work = self.berth.rerank(request, context.time_remaining(), tenant)
        texts = len(request.texts)
        return await self._unary(
            "Rerank", "rerank", request.model, texts, work, context
        )

    async def _unary(
        self,
        method: str,
        api: str,
        model: str,
        texts: int,
        work: Awaitable[Served[Response]],
        context: grpc.aio.ServicerContext,
    ) -> Response:
        """One traced, counted call; degraded answers say so in the trailer."""
        counted = self.berth.counted(api, model, texts, work)
        response = await serve_unary(
            context, f"berth.v1.Berth/{method}", model, counted
        )
        if response.degraded:
            context.set_trailing_metadata(DEGRADED_METADATA)
        return response

    async def Tokenize(
        self, request: berth_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.TokenizeResponse:
        async with AbortOnError(context):
            return await self.berth.tokenize(request)

    async def ModelInfo(
        self, request: berth_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.ModelInfoResponse:
        async with AbortOnError(context):
            return self.berth.describe(request.model)

    async def Stream(
        self,
        request_iterator: AsyncIterator[berth_pb2.StreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[berth_pb2.StreamResponse]:
        tenant = tenant_of(context)

        def call(
            request: berth_pb2.StreamRequest,
        ) -> Awaitable[berth_pb2.StreamResponse]:
            return self.berth.stream(request, context.time_remaining(), tenant)

        responses = serve_requests(
            request_iterator,
            context,
            "berth.v1.Berth/Stream",
            call,
            _stream_error,
            model_of=lambda request: _inner(request).model,
            named=lambda request: f"Stream request {_inner(request).request_id!r}",
            window=self.stream_window,
        )
        async for response in responses:
            yield response
