"""The HTTP/JSON routes: OpenAI's embeddings API and text-embeddings-inference's
(TEI) /embed, /predict, /rerank and /info, over the berth.v1 request path.

Each route reads a parsed JSON body (or a GET's query), builds the berth.v1
request, runs it through :class:`gateway.berth.Berth` (counted, api
``http``) and shapes the answer as the API it imitates does. What a body
holds that the route does not take is refused with InvalidInput naming it;
the serving of a route (keys, tracing, errors as HTTP statuses) is
gateway/http.py's. A request with a deadline (``--http-timeout-s``) hands
the time it has left to the request path, as a gRPC call does, and is
answered DeadlineExceeded if the path has not answered DEADLINE_GRACE_S past
it.

TEI's routes carry no model name: they serve the model of the ``model``
query parameter, else the only model of their task.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway import auth
from gateway.berth import Berth, Response, Served
from gateway.echo import quoted
from gateway.pipeline import Model
from services.errors import DeadlineExceeded, InvalidInput
from services.proto.berth.v1 import berth_pb2

# The openai client's models.list() shows who owns a model.
OWNER = "berth"
# A reply with more values than this is encoded as JSON on a thread, off the
# event loop (256 x 384 floats take ~30 ms to encode).
INLINE_JSON_VALUES = 16384
# A Classify top_k past any model's label count: every label, best first.
EVERY_LABEL = 2**31 - 1
# How long past its deadline a request waits for the request path's own
# answer (the batcher's DEADLINE_EXCEEDED, or the CPU fallback's, which
# start-up holds leave FALLBACK_RESERVE_S for) before it is answered
# DeadlineExceeded without it.
DEADLINE_GRACE_S = 0.5


@dataclass
class Reply:
    """A route's answer: its JSON body and headers; ``values``: how many
    numbers it holds (a large one is encoded off the event loop)."""

    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    values: int = 0


@dataclass
class Call:
    """One HTTP request as a route sees it: its JSON body (None for a GET),
    its query, and its deadline (time.monotonic(); None: none)."""

    body: Any
    query: Mapping[str, str]
    deadline: float | None = None

    def time_remaining(self) -> float | None:
        """Seconds left before the deadline (0 once past), as gRPC's
        ``context.time_remaining()``; None without a deadline."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())


Route = Callable[["Api", Call], Awaitable[Reply]]
# One berth.v1 call over the request path, given the time it has (None: no
# deadline).
Work = Callable[[float | None], Awaitable[Served[Response]]]


def _fields(body: Any, allowed: set[str], required: set[str]) -> dict[str, Any]:
    """``body`` as a JSON object whose keys are all ``allowed``; raises
    InvalidInput naming the first problem."""
    if not isinstance(body, dict):
        raise InvalidInput(
            f"the request body must be a JSON object, not {type(body).__name__}"
        )
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidInput(
            f"unknown field {quoted(unknown[0])}: this route takes "
            f"{', '.join(sorted(allowed))}",
            field=unknown[0],
        )
    for name in sorted(required):
        if name not in body:
            raise InvalidInput(f"{name} is required", field=name)
    return body


def _typed(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """``body[name]`` if it is a ``kind`` (JSON null: ``default``)."""
    value = body.get(name)
    if value is None:
        return default
    # (JSON true is no number: bool is an int subclass in Python.)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidInput(
            f"{name} must be a {kind.__name__}, not {type(value).__name__}",
            field=name,
        )
    return value


def _texts(value: Any, name: str) -> list[str]:
    """A string or a list of strings as the texts of a call; token ids
    (OpenAI takes arrays of integers) and anything else are refused."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise InvalidInput(
            f"{name} must be a string or a list of strings, not {type(value).__name__}",
            field=name,
        )
    for i, text in enumerate(value):
        if isinstance(text, str):
            continue
        if isinstance(text, int | list):
            raise InvalidInput(
                f"{name}[{i}] is token ids: berth tokenizes itself, send texts",
                field=f"{name}[{i}]",
            )
        raise InvalidInput(
            f"{name}[{i}] must be a string, not {type(text).__name__}",
            field=f"{name}[{i}]",
        )
    return value


def _truncation(body: dict[str, Any]) -> None:
    """TEI's truncation_direction: berth cuts texts at the right only."""
    direction = _typed(body, "truncation_direction", str, "Right")
    if direction.lower() != "right":
        raise InvalidInput(
            f"truncation_direction {quoted(direction)}: berth truncates at the "
            "right only",
            field="truncation_direction",
        )


class Api:
    """The HTTP routes over one gateway's berth.v1 request path."""

    def __init__(self, berth: Berth, max_texts: int, max_in_flight: int) -> None:
        self.berth = berth
        self.max_texts = max_texts
        self.max_in_flight = max_in_flight

    async def _counted(
        self, call: Call, model: str, texts: int, work: Work[Response]
    ) -> Response:
        """``work`` with the time ``call`` has left, counted (api ``http``)."""
        timeout_s = call.time_remaining()
        bounded = _within(work(timeout_s), timeout_s)
        return await self.berth.counted("http", model, texts, bounded)

    def _served(self, query: Mapping[str, str], task: str) -> str:
        """The model a TEI route serves: the ``model`` query parameter, else
        the only ``task`` model this gateway serves."""
        if "model" in query:
            return query["model"]
        names = sorted(
            n for n, m in self.berth.gateway.models.items() if m.entry.task == task
        )
        if len(names) != 1:
            served = ", ".join(names) or "none"
            raise InvalidInput(
                f"name the {task} model with the query parameter ?model= "
                f"(this gateway serves {len(names)}: {served})",
                field="model",
            )
        return names[0]

    # OpenAI: /v1/embeddings, /v1/models.

    async def embeddings(self, call: Call) -> Reply:
        """OpenAI's POST /v1/embeddings."""
        body = _fields(
            call.body,
            {"input", "model", "dimensions", "encoding_format", "user"},
            {"input", "model"},
        )
        texts = _texts(body["input"], "input")
        name = _typed(body, "model", str, "")
        encoding = _typed(body, "encoding_format", str, "float")
        if encoding not in ("float", "base64"):
            raise InvalidInput(
                f"encoding_format must be float or base64, not {quoted(encoding)}",
                field="encoding_format",
            )
        _typed(body, "user", str, "")
        options = berth_pb2.Options(dimensions=self._dimensions(body))
        request = berth_pb2.EmbedRequest(model=name, texts=texts, options=options)
        tenant = _tenant()
        response = await self._counted(
            call, name, len(texts), lambda t: self.berth.embed(request, t, tenant)
        )
        rows = _vectors(response)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _b64(row) if encoding == "base64" else row.tolist(),
            }
            for i, row in enumerate(rows)
        ]
        tokens = sum(e.tokens for e in response.embeddings)
        return Reply(
            {
                "object": "list",
                "data": data,
                "model": response.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
            _degraded(response),
            rows.size if encoding == "float" else 0,
        )

    @staticmethod
    def _dimensions(body: dict[str, Any]) -> int:
        """``dimensions`` (0: all), 1 to 2**32 - 1 when given."""
        dimensions = int(_typed(body, "dimensions", int, 0))
        if body.get("dimensions") is not None and not 0 < dimensions < 2**32:
            raise InvalidInput(
                f"dimensions must be 1 or more, not {dimensions}"
                if dimensions < 1
                else f"dimensions {dimensions} is too large",
                field="dimensions",
            )
        return dimensions

    async def models(self, call: Call) -> Reply:
        """OpenAI's GET /v1/models: the embedding models this key may use."""
        served = self.berth.gateway.models.values()
        return Reply(
            {
                "object": "list",
                "data": [
                    _openai_model(m)
                    for m in served
                    if m.entry.task == "embed" and auth.allowed(m.entry.name)
                ],
            }
        )

    async def model(self, call: Call) -> Reply:
        """OpenAI's GET /v1/models/{model}."""
        return Reply(_openai_model(self.berth.gateway.model(call.query["model"])))

    # TEI: /embed, /predict, /rerank, /info.

    async def embed(self, call: Call) -> Reply:
        """TEI's POST /embed: a list of vectors, unit length unless
        ``normalize`` is false (TEI's default, whatever the model's)."""
        allowed = {"inputs", "normalize", "truncate", "truncation_direction"}
        body = _fields(call.body, allowed | {"prompt_name", "dimensions"}, {"inputs"})
        texts = _texts(body["inputs"], "inputs")
        _truncation(body)
        options = berth_pb2.Options(
            normalize=_typed(body, "normalize", bool, True),
            truncate=_typed(body, "truncate", bool, False),
            prompt_name=_typed(body, "prompt_name", str, ""),
            dimensions=self._dimensions(body),
        )
        name = self._served(call.query, "embed")
        request = berth_pb2.EmbedRequest(model=name, texts=texts, options=options)
        tenant = _tenant()
        response = await self._counted(
            call, name, len(texts), lambda t: self.berth.embed(request, t, tenant)
        )
        rows = _vectors(response)
        return Reply(rows.tolist(), _degraded(response), rows.size)

    async def predict(self, call: Call) -> Reply:
        """TEI's POST /predict: every label with its score, best first; one
        list for a string, a list of them for a list of strings."""
        allowed = {"inputs", "raw_scores", "truncate", "truncation_direction"}
        body = _fields(call.body, allowed, {"inputs"})
        texts = _texts(body["inputs"], "inputs")
        _truncation(body)
        if _typed(body, "raw_scores", bool, False):
            raise InvalidInput(
                "raw_scores: berth's classification models answer probabilities only",
                field="raw_scores",
            )
        name = self._served(call.query, "classify")
        options = berth_pb2.Options(truncate=_typed(body, "truncate", bool, False))
        request = berth_pb2.ClassifyRequest(
            model=name, texts=texts, options=options, top_k=EVERY_LABEL
        )
        tenant = _tenant()
        response = await self._counted(
            call, name, len(texts), lambda t: self.berth.classify(request, t, tenant)
        )
        results = [
            [{"label": s.label, "score": s.score} for s in result.labels]
            for result in response.results
        ]
        single = isinstance(body["inputs"], str)
        return Reply(results[0] if single else results, _degraded(response))

    async def rerank(self, call: Call) -> Reply:
        """TEI's POST /rerank: [{index, score, text?}], best first."""
        allowed = {"query", "texts", "raw_scores", "return_text", "truncate"}
        body = _fields(call.body, allowed | {"truncation_direction"}, {"query"})
        query = _typed(body, "query", str, "")
        texts = _texts(body.get("texts", []), "texts")
        _truncation(body)
        name = self._served(call.query, "rerank")
        request = berth_pb2.RerankRequest(
            model=name,
            query=query,
            texts=texts,
            options=berth_pb2.Options(truncate=_typed(body, "truncate", bool, False)),
            raw_scores=_typed(body, "raw_scores", bool, False),
            return_text=_typed(body, "return_text", bool, False),
            sort=True,
        )
        tenant = _tenant()
        response = await self._counted(
            call, name, len(texts), lambda t: self.berth.rerank(request, t, tenant)
        )
        ranked = [
            {"index": r.index, "score": r.score}
            | ({"text": r.text} if request.return_text else {})
            for r in response.results
        ]
        return Reply(ranked, _degraded(response))

    async def info(self, call: Call) -> Reply:
        """TEI's GET /info, of the ``model`` query parameter's model, else
        of the only embedding model."""
        model = self.berth.gateway.model(self._served(call.query, "embed"))
        entry = model.entry
        kind: dict[str, Any]
        if entry.task == "embed":
            kind = {"embedding": {"pooling": entry.pooling}}
        else:
            labels = dict(enumerate(model.labels))
            kind = {
                "classifier" if entry.task == "classify" else "reranker": {
                    "id2label": {str(i): label for i, label in labels.items()},
                    "label2id": {label: i for i, label in labels.items()},
                }
            }
        return Reply(
            {
                "model_id": entry.name,
                "model_sha": None,
                "model_dtype": "float32",
                "model_type": kind,
                "max_concurrent_requests": self.max_in_flight,
                "max_input_length": entry.max_tokens,
                "max_client_batch_size": self.max_texts,
                "tokenization_workers": 2,
                "dimension": model.dimension,
                "backend": entry.backend,
                "version": "berth",
            }
        )


async def _within(
    work: Awaitable[Served[Response]], timeout_s: float | None
) -> Served[Response]:
    """``work``'s answer; raises DeadlineExceeded (and cancels ``work``, which
    calls off its texts where they wait) when it has none DEADLINE_GRACE_S
    past ``timeout_s``."""
    if timeout_s is None:
        return await work
    timer = asyncio.timeout(timeout_s + DEADLINE_GRACE_S)
    try:
        async with timer:
            return await work
    except TimeoutError:
        if not timer.expired():
            raise
        raise DeadlineExceeded(
            "the request's deadline passed before it was answered (the "
            "gateway's --http-timeout-s)"
        ) from None


def _tenant() -> str:
    """The calling key's tenant (gateway/auth.py), as gRPC calls have."""
    return auth.CALLER.get().tenant


def _vectors(response: berth_pb2.EmbedResponse) -> np.ndarray:
    """The response's embeddings as a float32 matrix."""
    if not response.embeddings:
        return np.zeros((0, 0), dtype=np.float32)
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def _b64(row: np.ndarray) -> str:
    """What OpenAI's encoding_format base64 carries: little-endian float32."""
    return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")


def _degraded(response: berth_pb2.EmbedResponse | Any) -> dict[str, str]:
    """The header of an answer the CPU fallback gave (gRPC's trailer)."""
    return {"x-berth-degraded": "true"} if response.degraded else {}


def _openai_model(model: Model) -> dict[str, Any]:
    return {
        "id": model.entry.name,
        "object": "model",
        "created": 0,
        "owned_by": OWNER,
    }
