"""The asyncio client of berth's gateway (grpc.aio): :class:`Client`'s
methods, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Sequence,
)
from types import TracebackType
from typing import Any

import grpc
from google.protobuf import message as _message

from berth_client._proto.berth.v1 import berth_pb2, berth_pb2_grpc
from berth_client.channel import (
    DEFAULT_ADDRESS,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    Retry,
    Settings,
    Tls,
)
from berth_client.client import STREAM_WINDOW, CallMetadata, answered, unary_method
from berth_client.errors import BerthError, from_rpc_error
from berth_client.pipeline import Pipeline, stream_request
from berth_client.results import (
    ClassifyResult,
    EmbedResult,
    RerankResult,
    StreamResult,
    TokenizeResult,
    classify_request,
    embed_request,
    rerank_request,
)

_END = object()
# What writing to a call that has ended raises.
_WRITE_FAILED = (grpc.RpcError, asyncio.InvalidStateError)


class AsyncClient:
    """:class:`berth_client.Client` for asyncio: the same arguments, and the
    same methods as coroutines; :meth:`stream` is an async iterator. Make it
    inside the event loop that uses it; ``async with`` closes it."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        timeout: float | None = 30.0,
        api_key: str | None = None,
        tls: Tls | bool = False,
        retry: Retry | None = Retry(),  # noqa: B008 (frozen: shared safely)
        load_balancing: str = "round_robin",
        keepalive_s: float | None = KEEPALIVE_S,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
        wait_for_ready: bool = False,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.settings = Settings(
            address,
            timeout=timeout,
            api_key=api_key,
            tls=tls,
            retry=retry,
            load_balancing=load_balancing,
            keepalive_s=keepalive_s,
            keepalive_timeout_s=keepalive_timeout_s,
            wait_for_ready=wait_for_ready,
            options=options,
        )
        s = self.settings
        self.channel: grpc.aio.Channel = (
            grpc.aio.secure_channel(s.target, s.credentials, options=s.options)
            if s.credentials is not None
            else grpc.aio.insecure_channel(s.target, options=s.options)
        )
        self.stub = berth_pb2_grpc.BerthStub(self.channel)
        self._methods: dict[str, Any] = {}

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def call(
        self,
        method: str,
        request: _message.Message,
        *,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
    ) -> Any:
        """:meth:`Client.call`: any unary berth.v1 method by name."""
        if method not in self._methods:
            path, request_class, response_class = unary_method(method)
            self._methods[method] = (
                self.channel.unary_unary(
                    path,
                    request_serializer=request_class.SerializeToString,
                    response_deserializer=response_class.FromString,
                ),
                request_class,
            )
        multicallable, request_class = self._methods[method]
        if not isinstance(request, request_class):
            raise TypeError(f"{method} takes a {request_class.__name__}")
        s = self.settings
        try:
            return await multicallable(
                request,
                timeout=s.call_timeout(timeout),
                metadata=s.call_metadata(metadata),
                wait_for_ready=s.call_ready(wait_for_ready),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    async def embed(
        self,
        texts: Sequence[str],
        *,
        model: str,
        normalize: bool | None = None,
        truncate: bool = False,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
        **fields: Any,
    ) -> EmbedResult:
        """:meth:`Client.embed`."""
        request = embed_request(
            texts, model=model, normalize=normalize, truncate=truncate, **fields
        )
        response = await self.call(
            "Embed",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return EmbedResult.of(response)

    async def classify(
        self,
        texts: Sequence[str],
        *,
        model: str,
        top_k: int = 1,
        truncate: bool = False,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
        **fields: Any,
    ) -> ClassifyResult:
        """:meth:`Client.classify`."""
        request = classify_request(
            texts, model=model, top_k=top_k, truncate=truncate, **fields
        )
        response = await self.call(
            "Classify",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return ClassifyResult.of(response)

    async def rerank(
        self,
        query: str,
        texts: Sequence[str],
        *,
        model: str,
        top_k: int = 0,
        sort: bool = False,
        raw_scores: bool = False,
        return_text: bool = False,
        truncate: bool = False,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
        **fields: Any,
    ) -> RerankResult:
        """:meth:`Client.rerank`."""
        request = rerank_request(
            query,
            texts,
            model=model,
            top_k=top_k,
            sort=sort,
            raw_scores=raw_scores,
            return_text=return_text,
            truncate=truncate,
            **fields,
        )
        response = await self.call(
            "Rerank",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return RerankResult.of(response)

    async def tokenize(
        self,
        texts: Sequence[str],
        *,
        model: str,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
        **fields: Any,
    ) -> TokenizeResult:
        """:meth:`Client.tokenize`."""
        request = berth_pb2.TokenizeRequest(model=model, texts=list(texts), **fields)
        response = await self.call(
            "Tokenize",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return TokenizeResult.of(response)

    async def model_info(
        self,
        model: str = "",
        *,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
    ) -> list[berth_pb2.ModelDescription]:
        """:meth:`Client.model_info`."""
        request = berth_pb2.ModelInfoRequest(model=model)
        response = await self.call(
            "ModelInfo",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return list(response.models)

    def stream(
        self,
        requests: Iterable[Any] | AsyncIterable[Any],
        *,
        window: int = STREAM_WINDOW,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        return_exceptions: bool = False,
    ) -> AsyncIterator[StreamResult | BerthError]:
        """:meth:`Client.stream`, as an async iterator; ``requests`` may be
        an async iterable too (a plain one is read on the event loop)."""
        pipe = Pipeline(window)
        streamer = _AsyncStream(self, metadata)
        return streamer.run(pipe, _aiter(requests), timeout, return_exceptions)


async def _aiter(
    requests: Iterable[Any] | AsyncIterable[Any],
) -> AsyncGenerator[Any, None]:
    if isinstance(requests, AsyncIterable):
        async for request in requests:
            yield request
    else:
        for request in requests:
            yield request


class _AsyncStream:
    """One AsyncClient.stream call: a task per stream opened writes the
    requests (:meth:`send`); the caller's task reads the answers."""

    def __init__(self, client: AsyncClient, metadata: CallMetadata) -> None:
        self.client = client
        self.metadata = client.settings.call_metadata(metadata)
        self.lock = asyncio.Condition()
        self.closed = False
        self.senders: list[asyncio.Task[None]] = []

    async def run(
        self,
        pipe: Pipeline,
        source: AsyncGenerator[Any, None],
        timeout: float | None,
        return_exceptions: bool,
    ) -> AsyncIterator[StreamResult | BerthError]:
        deadline = None if timeout is None else time.monotonic() + timeout
        call = None
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                call = self.client.stub.Stream(
                    timeout=remaining,
                    metadata=self.metadata,
                    wait_for_ready=self.client.settings.wait_for_ready,
                )
                sender = self.send(call, pipe, source, pipe.generation)
                self.senders.append(asyncio.ensure_future(sender))
                try:
                    while (response := await call.read()) is not grpc.aio.EOF:
                        async with self.lock:
                            due = pipe.take(response)
                            self.lock.notify_all()
                        for answer in due:
                            yield answered(answer, return_exceptions)
                    break
                except grpc.RpcError as exc:
                    error = from_rpc_error(exc)
                    async with self.lock:
                        again = error.code == grpc.StatusCode.UNAVAILABLE
                        if not (again and pipe.reopen()):
                            raise error from exc
                        self.lock.notify_all()
            pipe.finished()
        finally:
            self.closed = True
            if call is not None:
                call.cancel()
            for task in self.senders:
                task.cancel()
            await asyncio.gather(*self.senders, return_exceptions=True)
            await source.aclose()

    async def send(
        self, call: Any, pipe: Pipeline, source: AsyncIterator[Any], generation: int
    ) -> None:
        """Write the requests of the stream opened as ``generation``: the
        pending ones, then more from ``source`` as the window allows; close
        the sending side when the source ends. Stops when a newer stream
        replaced this one, or when the call has ended (its reader sees
        why)."""
        while True:
            async with self.lock:
                await self.lock.wait_for(
                    lambda: self.closed or pipe.generation != generation or pipe.ready()
                )
                if self.closed or pipe.generation != generation:
                    return
                action, message = pipe.step()
            if action == "pull":
                await self.pull(pipe, source)
                continue
            try:
                if message is not None:
                    await call.write(message)
                elif action == "end":
                    await call.done_writing()
                    return
            except _WRITE_FAILED:
                return

    async def pull(self, pipe: Pipeline, source: AsyncIterator[Any]) -> None:
        """Take the next request from ``source`` into the pipeline (as the
        sync client does)."""
        message = None
        failure: BaseException | None = None
        try:
            item = await anext(source, _END)
            message = None if item is _END else stream_request(item)
        except Exception as exc:
            failure = exc
        async with self.lock:
            pipe.pulling = False
            if message is None:
                pipe.exhausted = True
                pipe.failure = failure
            else:
                pipe.add(message)
            self.lock.notify_all()
