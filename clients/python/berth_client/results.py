"""Requests built from arguments, and answers as small dataclasses.

Each result keeps the response message it came from (``response``), so a
field the proto gains shows up there before this module names it; the
request builders take any field of the request, or of its ``Options``, as a
keyword argument for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from berth_client._proto.berth.v1 import berth_pb2

Request = TypeVar(
    "Request",
    berth_pb2.EmbedRequest,
    berth_pb2.ClassifyRequest,
    berth_pb2.RerankRequest,
)


def _texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str | bytes):
        raise TypeError("texts is a sequence of str, e.g. ['hello'], not one str")
    return list(texts)


def _build(
    cls: type[Request],
    texts: Sequence[str],
    model: str,
    normalize: bool | None,
    truncate: bool,
    fields: dict[str, Any],
) -> Request:
    """A request of ``cls``; each of ``fields`` goes to the request when it
    is one of the request's fields, else to its Options."""
    options = berth_pb2.Options(truncate=truncate)
    if normalize is not None:
        options.normalize = normalize
    own: dict[str, Any] = {}
    for name, value in fields.items():
        if name in ("options", "texts", "model"):
            raise TypeError(f"{name} is an argument of its own")
        if name in cls.DESCRIPTOR.fields_by_name:
            own[name] = value
        elif name in berth_pb2.Options.DESCRIPTOR.fields_by_name:
            setattr(options, name, value)
        else:
            raise TypeError(f"{cls.__name__} and Options have no field {name!r}")
    return cls(model=model, texts=_texts(texts), options=options, **own)


def embed_request(
    texts: Sequence[str],
    *,
    model: str,
    normalize: bool | None = None,
    truncate: bool = False,
    **fields: Any,
) -> berth_pb2.EmbedRequest:
    """An EmbedRequest. ``normalize``: L2-normalize (None: the model's
    default); ``truncate``: cut texts over the model's token limit instead
    of having the call refused."""
    return _build(berth_pb2.EmbedRequest, texts, model, normalize, truncate, fields)


def classify_request(
    texts: Sequence[str],
    *,
    model: str,
    top_k: int = 1,
    normalize: bool | None = None,
    truncate: bool = False,
    **fields: Any,
) -> berth_pb2.ClassifyRequest:
    """A ClassifyRequest for the ``top_k`` best labels of each text."""
    fields["top_k"] = top_k
    return _build(berth_pb2.ClassifyRequest, texts, model, normalize, truncate, fields)


def rerank_request(
    query: str,
    texts: Sequence[str],
    *,
    model: str,
    top_k: int = 0,
    sort: bool = False,
    raw_scores: bool = False,
    return_text: bool = False,
    truncate: bool = False,
    **fields: Any,
) -> berth_pb2.RerankRequest:
    """A RerankRequest scoring each of ``texts`` against ``query`` with a
    rerank model (a cross-encoder). ``top_k``: only the best k, best first
    (0: all); ``sort``: best first (else in the order of ``texts``);
    ``raw_scores``: the model's logits, without its activation;
    ``return_text``: each result carries its text; ``truncate``: cut a pair
    over the model's token limit instead of having the call refused."""
    if not isinstance(query, str):
        raise TypeError(f"query is one str, not {type(query).__name__}")
    fields.update(
        query=query,
        top_k=top_k,
        sort=sort,
        raw_scores=raw_scores,
        return_text=return_text,
    )
    return _build(berth_pb2.RerankRequest, texts, model, None, truncate, fields)


@dataclass(frozen=True)
class EmbedResult:
    """One vector per text, in the order of the texts. ``tokens``: each
    text's token count; ``degraded``: answered by the model's CPU fallback
    (close to, not the same as, the model's own vectors)."""

    model: str
    vectors: list[list[float]]
    tokens: list[int]
    degraded: bool
    response: berth_pb2.EmbedResponse = field(repr=False, compare=False)

    @classmethod
    def of(cls, response: berth_pb2.EmbedResponse) -> EmbedResult:
        return cls(
            model=response.model,
            vectors=[list(e.values) for e in response.embeddings],
            tokens=[e.tokens for e in response.embeddings],
            degraded=response.degraded,
            response=response,
        )


class Label(NamedTuple):
    label: str
    score: float


@dataclass(frozen=True)
class ClassifyResult:
    """Each text's labels, best first (``top_k`` of them); ``best``: the
    first of each."""

    model: str
    labels: list[list[Label]]
    tokens: list[int]
    degraded: bool
    response: berth_pb2.ClassifyResponse = field(repr=False, compare=False)

    @property
    def best(self) -> list[Label]:
        return [labels[0] for labels in self.labels]

    @classmethod
    def of(cls, response: berth_pb2.ClassifyResponse) -> ClassifyResult:
        return cls(
            model=response.model,
            labels=[
                [Label(s.label, s.score) for s in r.labels] for r in response.results
            ],
            tokens=[r.tokens for r in response.results],
            degraded=response.degraded,
            response=response,
        )


@dataclass(frozen=True)
class TokenizeResult:
    """Each text's token ids and tokens, as the model's tokenizer makes them
    (special tokens included)."""

    model: str
    ids: list[list[int]]
    tokens: list[list[str]]
    response: berth_pb2.TokenizeResponse = field(repr=False, compare=False)

    @classmethod
    def of(cls, response: berth_pb2.TokenizeResponse) -> TokenizeResult:
        return cls(
            model=response.model,
            ids=[list(r.ids) for r in response.results],
            tokens=[list(r.tokens) for r in response.results],
            response=response,
        )


@dataclass(frozen=True)
class Ranked:
    """One text's score: ``index``, its place in the texts of the request;
    ``tokens``, those of the (query, text) pair as the model saw it;
    ``text``, the text when the request asked for it (else ''). (A
    dataclass, not a NamedTuple: a tuple has an ``index`` method.)"""

    index: int
    score: float
    tokens: int
    text: str


@dataclass(frozen=True)
class RerankResult:
    """Each text's score against the query, in the answer's order: the
    order of the texts, or best first when the request sorted or asked for
    ``top_k`` (then only those). ``degraded``: answered by the model's CPU
    fallback."""

    model: str
    results: list[Ranked]
    degraded: bool
    response: berth_pb2.RerankResponse = field(repr=False, compare=False)

    @property
    def indices(self) -> list[int]:
        return [r.index for r in self.results]

    @property
    def scores(self) -> list[float]:
        return [r.score for r in self.results]

    @property
    def tokens(self) -> list[int]:
        return [r.tokens for r in self.results]

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.results]

    @classmethod
    def of(cls, response: berth_pb2.RerankResponse) -> RerankResult:
        return cls(
            model=response.model,
            results=[
                Ranked(r.index, r.score, r.tokens, r.text) for r in response.results
            ],
            degraded=response.degraded,
            response=response,
        )


StreamResult = EmbedResult | ClassifyResult | RerankResult
