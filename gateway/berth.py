"""The berth.v1 calls over the gateway's request path: their answers' shapes."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np

from gateway import auth, metrics
from gateway.pipeline import INLINE_TOKENIZE_CHARS, Answer, Gateway, Model
from services.errors import InvalidInput
from services.proto.berth.v1 import berth_pb2

Response = TypeVar(
    "Response",
    berth_pb2.EmbedResponse,
    berth_pb2.ClassifyResponse,
    berth_pb2.RerankResponse,
)
# A call's response, and the timings it took itself (Answer.measured).
Served = tuple[Response, berth_pb2.Timings]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# EmbedResponse.embeddings is field 2, Embedding.values field 1 (packed
# float), Embedding.tokens field 2 (varint): tags for length-delimited and
# varint wire types.
_EMBEDDINGS_TAG = bytes([2 << 3 | 2])
_VALUES_TAG = bytes([1 << 3 | 2])
_TOKENS_TAG = bytes([2 << 3 | 0])


def embeddings_wire(vectors: np.ndarray, counts: list[int]) -> bytes:
    """The ``embeddings`` of an EmbedResponse in protobuf wire format.

    Merged into the response with one parse in C: building an Embedding
    from a list of Python floats takes 16.5 µs per 768-wide vector on the
    dev machine, this 2.5 µs. Packed repeated floats are little-endian
    float32 back to back."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    values_len = _varint(rows.shape[1] * 4)
    parts: list[bytes] = []
    for row, count in zip(rows, counts, strict=True):
        body = b"".join(
            (_VALUES_TAG, values_len, row.tobytes(), _TOKENS_TAG, _varint(count))
        )
        parts += (_EMBEDDINGS_TAG, _varint(len(body)), body)
    return b"".join(parts)


def packed_floats(field: int, values: np.ndarray) -> bytes:
    """Packed repeated float field number ``field`` holding ``values`` (as
    float32, flattened), in protobuf wire format: merged into its message
    with one parse in C. (Extending the field from a list of Python floats
    takes 2.6 ms for 256 x 384 values on the dev machine, on the event
    loop; this and the merge 0.03.)"""
    data = np.ascontiguousarray(values, dtype="<f4").tobytes()
    return b"".join((_varint(field << 3 | 2), _varint(len(data)), data))


def check_pair_options(model: str, options: berth_pb2.Options) -> None:
    """A Rerank call takes truncate alone; raises InvalidInput naming the
    option it does not take."""
    for name in ("normalize", "prompt"):
        if options.HasField(name):
            raise _pair_option(model, name)
    if options.prompt_name:
        raise _pair_option(model, "prompt_name")
    if options.dimensions:
        raise _pair_option(model, "dimensions")


def _pair_option(model: str, name: str) -> InvalidInput:
    return InvalidInput(
        f"options.{name} is not taken by rerank model {model!r}, which scores "
        "pairs; of the options it takes truncate alone",
        field=f"options.{name}",
    )


def activated(scores: np.ndarray, activation: str) -> np.ndarray:
    """A cross-encoder's scores through its activation (Model.activation:
    sigmoid, tanh or identity), as sentence-transformers' CrossEncoder
    applies it in predict."""
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-scores.astype(np.float64)))
    if activation == "tanh":
        return np.tanh(scores)
    return scores


def ranked(scores: np.ndarray, sort: bool, top_k: int) -> np.ndarray:
    """The indices of the results to answer, in answer order: all in the
    texts' order, or best first (sort), or the best ``top_k`` (0: all);
    ties keep the texts' order."""
    if not sort and not top_k:
        return np.arange(len(scores))
    order = np.argsort(-scores, kind="stable")
    return order[:top_k] if top_k else order


def tokenize_response(
    model: Model, request: berth_pb2.TokenizeRequest
) -> berth_pb2.TokenizeResponse:
    """The answer to a Tokenize call; raises InvalidInput."""
    texts = list(request.texts)
    if request.query:
        tokenized = model.encoder.tokens(texts, query=request.query)
    else:
        prompt = model.prompts.of(request.options)
        tokenized = model.encoder.tokens(texts, prompt=prompt)
    return berth_pb2.TokenizeResponse(
        model=model.entry.name,
        results=[berth_pb2.TokenizedText(ids=i, tokens=t) for i, t in tokenized],
    )


class Berth:
    """The berth.v1 request path over a Gateway, without gRPC."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def counted(
        self, api: str, model: str, texts: int, work: Awaitable[Served[Response]]
    ) -> Response:
        """Await one request of ``texts`` texts, counting its outcome and
        the stage times it took, and in its model's statistics (KServe's
        ModelStatistics: as in Triton, every inference of a model counts,
        whatever API it came by)."""
        known = model in self.gateway.models
        label = model if known else "unknown"
        metrics.TEXTS.labels(label).inc(texts)
        t0 = time.perf_counter_ns()
        with metrics.Tally(label, api) as tally:
            try:
                response, measured = await work
            except Exception:
                if known:
                    metrics.model_stats(label).failed(time.perf_counter_ns() - t0)
                raise
            tally.answered(measured, response.degraded)
        if known:
            run_ns = measured.total_us * 1000
            output_ns = max(0, time.perf_counter_ns() - t0 - run_ns)
            metrics.model_stats(label).succeeded(texts, measured, run_ns, output_ns)
        return response

    async def _answer(
        self,
        request: berth_pb2.EmbedRequest | berth_pb2.ClassifyRequest,
        task: str,
        response: berth_pb2.EmbedResponse | berth_pb2.ClassifyResponse,
        timeout_s: float | None,
        tenant: str,
    ) -> tuple[Model, Answer]:
        """Run one Embed or Classify call's texts into ``response``'s
        timings; its model and the answer."""
        model = self.gateway.model(request.model, task)
        response.model = model.entry.name
        response.request_id = request.request_id
        answer = await self.gateway.run(
            model,
            list(request.texts),
            request.options,
            timeout_s,
            response.timings,
            tenant,
        )
        response.degraded = answer.degraded
        return model, answer

    async def embed(
        self, request: berth_pb2.EmbedRequest, timeout_s: float | None, tenant: str = ""
    ) -> Served[berth_pb2.EmbedResponse]:
        """The response, and the timings the call took (see Served)."""
        with self.gateway.admission:
            response = berth_pb2.EmbedResponse()
            model, answer = await self._answer(
                request, "embed", response, timeout_s, tenant
            )
            vectors = model.embeddings(answer.outputs, request.options)
            response.MergeFromString(embeddings_wire(vectors, answer.tokens))
            return response, answer.measured

    async def classify(
        self,
        request: berth_pb2.ClassifyRequest,
        timeout_s: float | None,
        tenant: str = "",
    ) -> Served[berth_pb2.ClassifyResponse]:
        """The response, and the timings the call took (see Served)."""
        with self.gateway.admission:
            response = berth_pb2.ClassifyResponse()
            model, answer = await self._answer(
                request, "classify", response, timeout_s, tenant
            )
            probs = answer.outputs
            top_k = max(1, min(request.top_k or 1, len(model.labels)))
            best = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
            for row, (order, n) in enumerate(zip(best, answer.tokens, strict=True)):
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
            return response, answer.measured

    async def rerank(
        self,
        request: berth_pb2.RerankRequest,
        timeout_s: float | None,
        tenant: str = "",
    ) -> Served[berth_pb2.RerankResponse]:
        """The response, and the timings the call took (see Served)."""
        with self.gateway.admission:
            model = self.gateway.model(request.model, "rerank")
            check_pair_options(model.entry.name, request.options)
            response = berth_pb2.RerankResponse(
                model=model.entry.name, request_id=request.request_id
            )
            answer = await self.gateway.run(
                model,
                list(request.texts),
                request.options,
                timeout_s,
                response.timings,
                tenant,
                query=request.query,
            )
            response.degraded = answer.degraded
            scores = answer.outputs[:, 0]
            if not request.raw_scores:
                scores = activated(scores, model.activation)
            order = ranked(scores, request.sort, request.top_k)
            texts = request.texts
            for i in order.tolist():
                response.results.add(
                    index=i,
                    score=float(scores[i]),
                    tokens=answer.tokens[i],
                    text=texts[i] if request.return_text else "",
                )
            return response, answer.measured

    async def stream(
        self, request: berth_pb2.StreamRequest, timeout_s: float | None, tenant: str
    ) -> berth_pb2.StreamResponse:
        """One request of a Stream call, counted as api ``stream``."""
        kind = request.WhichOneof("request")
        if kind == "embed":
            inner = request.embed
            work = self.embed(inner, timeout_s, tenant)
            embedded = await self.counted("stream", inner.model, len(inner.texts), work)
            return berth_pb2.StreamResponse(embed=embedded)
        if kind == "classify":
            asked = request.classify
            job = self.classify(asked, timeout_s, tenant)
            classified = await self.counted(
                "stream", asked.model, len(asked.texts), job
            )
            return berth_pb2.StreamResponse(classify=classified)
        if kind == "rerank":
            pairs = request.rerank
            scoring = self.rerank(pairs, timeout_s, tenant)
            scored = await self.counted(
                "stream", pairs.model, len(pairs.texts), scoring
            )
            return berth_pb2.StreamResponse(rerank=scored)
        raise InvalidInput("StreamRequest holds no request: embed, classify or rerank")

    async def tokenize(
        self, request: berth_pb2.TokenizeRequest
    ) -> berth_pb2.TokenizeResponse:
        """Ids and tokens per text. A long call is tokenized on the tokenizer
        threads, as for Embed: ~4 M characters take seconds, and on the event
        loop they would stall every other request of this gateway."""
        model = self.gateway.model(request.model)
        if request.query and model.entry.task != "rerank":
            raise InvalidInput(
                f"query is for rerank models, and {model.entry.name!r} is a "
                f"{model.entry.task} model: leave it empty",
                field="query",
            )
        chars = sum(map(len, request.texts)) + len(request.query) * len(request.texts)
        if chars <= INLINE_TOKENIZE_CHARS:
            return tokenize_response(model, request)
        with self.gateway.admission:  # bounds the calls queued for the threads
            return await self.gateway.in_threads(tokenize_response, model, request)

    def describe(self, name: str) -> berth_pb2.ModelInfoResponse:
        if name:
            self.gateway.model(name)  # raises, naming the models served
        return berth_pb2.ModelInfoResponse(
            models=[
                berth_pb2.ModelDescription(
                    name=m.entry.name,
                    task=m.entry.task,
                    dimension=m.dimension,
                    max_dimensions=m.width,
                    labels=m.labels,
                    max_tokens=m.entry.max_tokens,
                    buckets=m.entry.buckets,
                    backend=m.entry.backend,
                    default_normalize=m.entry.normalize,
                    prompt_names=sorted(m.entry.prompts),
                    default_prompt_name=m.entry.default_prompt_name or "",
                )
                for m in self.gateway.models.values()
                if (not name or m.entry.name == name) and auth.allowed(m.entry.name)
            ]
        )
