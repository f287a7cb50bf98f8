"""The public berth.v1 service: validate, tokenize, run, shape the answer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from gateway.batcher_client import BatcherClient
from gateway.tokenize import Limits, TextEncoder
from services.errors import BerthError, InvalidInput, Overloaded, abort
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import ModelEntry

log = logging.getLogger("berth.gateway")


class Admission:
    """A bound on requests in flight; past it, refuse at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def __enter__(self) -> None:
        if self.in_flight >= self.limit:
            raise Overloaded(
                f"gateway has {self.in_flight} requests in flight, the limit "
                f"(--max-in-flight) is {self.limit}; retry later"
            )
        self.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self.in_flight -= 1


class Model:
    """What the gateway knows of one served model."""

    def __init__(self, entry: ModelEntry, limits: Limits) -> None:
        self.entry = entry
        self.encoder = TextEncoder(entry, limits)
        self.labels = entry.label_names()
        config = json.loads((entry.checkpoint_dir / "config.json").read_text())
        self.dimension = int(config.get("hidden_size", config.get("dim", 0)))


class Gateway:
    """The request path shared by unary and streaming calls."""

    def __init__(
        self,
        entries: dict[str, ModelEntry],
        batcher: BatcherClient,
        limits: Limits,
        max_in_flight: int,
    ) -> None:
        self.models = {name: Model(e, limits) for name, e in entries.items()}
        self.batcher = batcher
        self.admission = Admission(max_in_flight)
        self._tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    def model(self, name: str, task: str) -> Model:
        model = self.models.get(name)
        if model is None:
            raise InvalidInput(
                f"unknown model {name!r}; this gateway serves "
                f"{', '.join(sorted(self.models))}"
            )
        if model.entry.task != task:
            verb = "Embed" if model.entry.task == "embed" else "Classify"
            raise InvalidInput(
                f"model {name!r} is a {model.entry.task} model: call {verb}"
            )
        return model

    async def _run(
        self,
        model: Model,
        texts: list[str],
        options: berth_pb2.Options,
        timeout_s: float | None,
        timings: berth_pb2.Timings,
    ) -> tuple[np.ndarray, list[int]]:
        """Tokenize and run texts; returns outputs [N, width] and token counts."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._tokenize_pool, model.encoder.encode, list(texts), options.truncate
        )
        t1 = time.perf_counter()
        timeout_ms = max(1, int(timeout_s * 1000)) if timeout_s is not None else 0
        results = await self.batcher.run(model.entry.name, ids, timeout_ms)
        outputs = np.stack([np.frombuffer(r.output, dtype="<f4") for r in results])
        t2 = time.perf_counter()
        timings.tokenize_us = int((t1 - t0) * 1e6)
        timings.queue_us = max(r.queue_us for r in results)
        timings.inference_us = max(r.inference_us for r in results)
        timings.total_us = int((t2 - t0) * 1e6)
        return outputs, [len(x) for x in ids]

    async def embed(
        self, request: berth_pb2.EmbedRequest, timeout_s: float | None
    ) -> berth_pb2.EmbedResponse:
        with self.admission:
            model = self.model(request.model, "embed")
            response = berth_pb2.EmbedResponse(
                model=model.entry.name, request_id=request.request_id
            )
            vectors, counts = await self._run(
                model, list(request.texts), request.options, timeout_s, response.timings
            )
            normalize = (
                request.options.normalize
                if request.options.HasField("normalize")
                else model.entry.normalize
            )
            if normalize:
                norms = np.linalg.norm(vectors, axis=1, keepdims=True)
                vectors = vectors / np.maximum(norms, 1e-12)
            response.embeddings.extend(
                berth_pb2.Embedding(values=v.tolist(), tokens=n)
                for v, n in zip(vectors, counts, strict=True)
            )
            return response

    async def classify(
        self, request: berth_pb2.ClassifyRequest, timeout_s: float | None
    ) -> berth_pb2.ClassifyResponse:
        with self.admission:
            model = self.model(request.model, "classify")
            top_k = max(1, min(request.top_k or 1, len(model.labels)))
            response = berth_pb2.ClassifyResponse(
                model=model.entry.name, request_id=request.request_id
            )
            probs, counts = await self._run(
                model, list(request.texts), request.options, timeout_s, response.timings
            )
            best = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
            for row, (order, n) in enumerate(zip(best, counts, strict=True)):
                response.results.append(
                    berth_pb2.Classification(
                        labels=[
                            berth_pb2.LabelScore(
                                label=model.labels[i], score=float(probs[row, i])
                            )
                            for i in order
                        ],
                        tokens=n,
                    )
                )
            return response

    def describe(self, name: str) -> berth_pb2.ModelInfoResponse:
        if name and name not in self.models:
            raise InvalidInput(
                f"unknown model {name!r}; this gateway serves "
                f"{', '.join(sorted(self.models))}"
            )
        return berth_pb2.ModelInfoResponse(
            models=[
                berth_pb2.ModelDescription(
                    name=m.entry.name,
                    task=m.entry.task,
                    dimension=m.dimension,
                    labels=m.labels,
                    max_tokens=m.entry.max_tokens,
                    buckets=m.entry.buckets,
                    backend=m.entry.backend,
                    default_normalize=m.entry.normalize,
                )
                for m in self.models.values()
                if not name or m.entry.name == name
            ]
        )


class BerthService(berth_pb2_grpc.BerthServicer):
    """gRPC adapter: maps berth errors onto status codes."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Embed(
        self, request: berth_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.EmbedResponse:
        try:
            return await self.gateway.embed(request, context.time_remaining())
        except BerthError as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    async def Classify(
        self, request: berth_pb2.ClassifyRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.ClassifyResponse:
        try:
            return await self.gateway.classify(request, context.time_remaining())
        except BerthError as exc:
            await abort(context, exc)
            raise

    async def Tokenize(
        self, request: berth_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.TokenizeResponse:
        try:
            model = self.gateway.models.get(request.model)
            if model is None:
                raise InvalidInput(f"unknown model {request.model!r}")
            pairs = model.encoder.tokens(list(request.texts))
        except BerthError as exc:
            await abort(context, exc)
            raise
        return berth_pb2.TokenizeResponse(
            model=request.model,
            results=[berth_pb2.TokenizedText(ids=i, tokens=t) for i, t in pairs],
        )

    async def ModelInfo(
        self, request: berth_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> berth_pb2.ModelInfoResponse:
        try:
            return self.gateway.describe(request.model)
        except BerthError as exc:
            await abort(context, exc)
            raise

    async def Stream(
        self,
        request_iterator: AsyncIterator[berth_pb2.StreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[berth_pb2.StreamResponse]:
        out: asyncio.Queue[berth_pb2.StreamResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def answer(request: berth_pb2.StreamRequest) -> None:
            kind = request.WhichOneof("request")
            inner = request.embed if kind == "embed" else request.classify
            try:
                if kind == "embed":
                    e = await self.gateway.embed(
                        request.embed, context.time_remaining()
                    )
                    out.put_nowait(berth_pb2.StreamResponse(embed=e))
                elif kind == "classify":
                    c = await self.gateway.classify(
                        request.classify, context.time_remaining()
                    )
                    out.put_nowait(berth_pb2.StreamResponse(classify=c))
                else:
                    raise InvalidInput("StreamRequest holds neither embed nor classify")
            except BerthError as exc:
                out.put_nowait(
                    berth_pb2.StreamResponse(
                        error=berth_pb2.StreamError(
                            request_id=inner.request_id,
                            code=exc.code.name,
                            message=str(exc),
                        )
                    )
                )

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(set(tasks))
            out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await out.get()) is not None:
                yield response
        finally:
            reader.cancel()
            for task in tasks:
                task.cancel()
