"""The blocking client of berth's gateway (berth.v1.Berth)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc
from google.protobuf import message as _message
from google.protobuf import message_factory

from berth_client._proto.berth.v1 import berth_pb2, berth_pb2_grpc
from berth_client.channel import (
    DEFAULT_ADDRESS,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    Retry,
    Settings,
    Tls,
)
from berth_client.errors import BerthError, from_rpc_error
from berth_client.pipeline import Answer, Pipeline, stream_request
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

CallMetadata = Sequence[tuple[str, str | bytes]]
_END = object()
STREAM_WINDOW = 32


def unary_method(name: str) -> tuple[str, Any, Any]:
    """(path, request class, response class) of a unary berth.v1 method."""
    service = berth_pb2.DESCRIPTOR.services_by_name["Berth"]
    method = service.methods_by_name.get(name)
    if method is None or method.client_streaming or method.server_streaming:
        unary = [m.name for m in service.methods if not m.client_streaming]
        raise ValueError(f"{name!r} is no unary berth.v1 method; there are {unary}")
    return (
        f"/{service.full_name}/{name}",
        message_factory.GetMessageClass(method.input_type),
        message_factory.GetMessageClass(method.output_type),
    )


def answered(answer: Answer, return_exceptions: bool) -> StreamResult | BerthError:
    if isinstance(answer, BerthError) and not return_exceptions:
        raise answer
    return answer


class Client:
    """A client of one gateway or several (each call goes to one of them).

    ``address``: 'host:port', any gRPC target ('dns:///name:port': every
    address of the name), or a list of IP:port addresses. ``timeout``: each
    call's deadline in seconds unless the call gives its own (None: none).
    ``api_key``: sent as ``authorization: Bearer KEY`` on every call.
    ``tls``: True (the system's CAs) or a :class:`Tls`; False: plaintext.
    ``retry``: gRPC's retry policy (None: no retries). ``load_balancing``:
    'round_robin' (each call to the next gateway that is connected) or
    'pick_first'. ``keepalive_s``, ``keepalive_timeout_s``: ping a quiet
    connection after this long, drop it when the ping is not answered in
    time (None: no pings). ``wait_for_ready``: calls wait, until their
    deadline, for a gateway to be reachable instead of failing UNAVAILABLE
    at once. ``options``: more gRPC channel arguments.

    Use as a context manager, or call :meth:`close`. Safe to share between
    threads."""

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
        self.channel: grpc.Channel = (
            grpc.secure_channel(s.target, s.credentials, options=s.options)
            if s.credentials is not None
            else grpc.insecure_channel(s.target, options=s.options)
        )
        # The generated stub: its calls carry no API key or default deadline.
        self.stub = berth_pb2_grpc.BerthStub(self.channel)
        self._methods: dict[str, Any] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def call(
        self,
        method: str,
        request: _message.Message,
        *,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
    ) -> Any:
        """Any unary berth.v1 method by name ('Embed', 'ModelInfo', ...):
        its response message. The API key, deadline and retries apply, and
        errors are raised as :class:`BerthError`."""
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
            return multicallable(
                request,
                timeout=s.call_timeout(timeout),
                metadata=s.call_metadata(metadata),
                wait_for_ready=s.call_ready(wait_for_ready),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def embed(
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
        """Embed ``texts`` with ``model``. ``normalize``: L2-normalize (None:
        the model's default); ``truncate``: cut texts over the model's token
        limit instead of failing InvalidInput; ``fields``: any other field of
        EmbedRequest or its Options."""
        request = embed_request(
            texts, model=model, normalize=normalize, truncate=truncate, **fields
        )
        response = self.call(
            "Embed",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return EmbedResult.of(response)

    def classify(
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
        """The ``top_k`` best labels of each text with ``model``."""
        request = classify_request(
            texts, model=model, top_k=top_k, truncate=truncate, **fields
        )
        response = self.call(
            "Classify",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return ClassifyResult.of(response)

    def rerank(
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
        """Score each of ``texts`` against ``query`` with the rerank model
        ``model`` (a cross-encoder), as sentence-transformers' CrossEncoder
        does: the results in the order of the texts, or best first with
        ``sort``, or the best ``top_k`` only (0: all). ``raw_scores``: the
        model's logits, without its activation; ``return_text``: each
        result carries its text; ``truncate``: cut a pair over the model's
        token limit instead of failing InvalidInput."""
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
        response = self.call(
            "Rerank",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return RerankResult.of(response)

    def tokenize(
        self,
        texts: Sequence[str],
        *,
        model: str,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
        **fields: Any,
    ) -> TokenizeResult:
        """How ``model``'s tokenizer splits each text."""
        request = berth_pb2.TokenizeRequest(model=model, texts=list(texts), **fields)
        response = self.call(
            "Tokenize",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return TokenizeResult.of(response)

    def model_info(
        self,
        model: str = "",
        *,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        wait_for_ready: bool | None = None,
    ) -> list[berth_pb2.ModelDescription]:
        """The description of ``model``, or of every model served (those the
        API key may use) when ``model`` is ''."""
        request = berth_pb2.ModelInfoRequest(model=model)
        response = self.call(
            "ModelInfo",
            request,
            timeout=timeout,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        return list(response.models)

    def stream(
        self,
        requests: Iterable[Any],
        *,
        window: int = STREAM_WINDOW,
        timeout: float | None = None,
        metadata: CallMetadata = (),
        return_exceptions: bool = False,
    ) -> Iterator[StreamResult | BerthError]:
        """The answers of many requests, in the order of ``requests``
        (EmbedRequest, ClassifyRequest or RerankRequest messages:
        :func:`embed_request`, :func:`classify_request`,
        :func:`rerank_request`), sent over one Stream call with up to
        ``window`` of them sent and not yet handed back.

        ``requests`` is read as the window allows (on a gRPC thread), so it
        may be a long generator. Their request_id is set here. A request's
        error is raised where its answer would come (``return_exceptions``:
        handed back in its place instead), and ends the stream. ``timeout``:
        a deadline for the whole stream (None: none; not the client's
        default). A stream that ends UNAVAILABLE after answering some
        requests (a gateway restarting, or closing a connection at its
        maximum age) is opened again and the unanswered requests resent."""
        return _SyncStream(self, metadata).run(
            Pipeline(window), requests, timeout, return_exceptions
        )


class _SyncStream:
    """One Client.stream call: gRPC's sending thread takes requests from a
    generator per stream opened (:meth:`sender`); the caller's thread reads
    the answers."""

    def __init__(self, client: Client, metadata: CallMetadata) -> None:
        self.client = client
        self.metadata = client.settings.call_metadata(metadata)
        self.lock = threading.Condition()
        self.closed = False

    def run(
        self,
        pipe: Pipeline,
        requests: Iterable[Any],
        timeout: float | None,
        return_exceptions: bool,
    ) -> Iterator[StreamResult | BerthError]:
        source = iter(requests)
        deadline = None if timeout is None else time.monotonic() + timeout
        call = None
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                call = self.client.stub.Stream(
                    self.sender(pipe, source, pipe.generation),
                    timeout=remaining,
                    metadata=self.metadata,
                    wait_for_ready=self.client.settings.wait_for_ready,
                )
                try:
                    for response in call:
                        with self.lock:
                            due = pipe.take(response)
                            self.lock.notify_all()
                        for answer in due:
                            yield answered(answer, return_exceptions)
                    break
                except grpc.RpcError as exc:
                    error = from_rpc_error(exc)
                    with self.lock:
                        again = error.code == grpc.StatusCode.UNAVAILABLE
                        if not (again and pipe.reopen()):
                            raise error from exc
                        self.lock.notify_all()
            pipe.finished()
        finally:
            with self.lock:
                self.closed = True
                self.lock.notify_all()
            if call is not None:
                call.cancel()

    def sender(
        self, pipe: Pipeline, source: Iterator[Any], generation: int
    ) -> Iterator[berth_pb2.StreamRequest]:
        """The requests of the stream opened as ``generation``: the pending
        ones, then more from ``source`` as the window allows; it ends when
        the source does, or when a newer stream replaced this one."""
        while True:
            with self.lock:
                self.lock.wait_for(
                    lambda: self.closed or pipe.generation != generation or pipe.ready()
                )
                if self.closed or pipe.generation != generation:
                    return
                action, message = pipe.step()
            if action == "end":
                return
            if message is not None:
                yield message
            elif action == "pull":
                self._pull(pipe, source)

    def _pull(self, pipe: Pipeline, source: Iterator[Any]) -> None:
        """Take the next request from ``source`` into the pipeline; what the
        source raises (or a request of the wrong type) ends the requests and
        is raised to the caller once the stream has answered those before."""
        message = None
        failure: BaseException | None = None
        try:
            item = next(source, _END)
            message = None if item is _END else stream_request(item)
        except Exception as exc:
            failure = exc
        with self.lock:
            pipe.pulling = False
            if message is None:
                pipe.exhausted = True
                pipe.failure = failure
            else:
                pipe.add(message)
            self.lock.notify_all()
