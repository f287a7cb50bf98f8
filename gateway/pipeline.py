"""The request path every API shares: admit, cache, tokenize, run, fall back.

berth.v1 (gateway.berth) and KServe v2 (gateway.kserve) shape their calls'
answers over one :class:`Gateway`: its admission bound, response cache,
tokenizers, batcher and CPU fallbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np

from gateway import auth, metrics
from gateway.batcher_client import Batching
from gateway.cache import Entry, ResponseCache, Timings
from gateway.echo import quoted
from gateway.options import Prompts, check_dimensions, truncated
from gateway.tokenize import Limits, TextEncoder
from services.errors import (
    BerthError,
    EngineFailure,
    InvalidInput,
    Overloaded,
    Unavailable,
)
from services.fallback_model import FallbackError, FallbackModel
from services.pair_fallback import PairFallback
from services.proto.berth.v1 import berth_pb2
from services.repository import ModelEntry
from services.telemetry import inject, span_if_recording, tracer

log = logging.getLogger("berth.gateway")
TRACER = tracer("gateway")
# Calls with at most this many characters are tokenized on the event loop
# (tens of microseconds); longer ones on the tokenizer threads, so one
# large call cannot stall every other request.
INLINE_TOKENIZE_CHARS = 2048
# Likewise the CPU fallback: a call of at most this many tokens runs on the
# loop; a larger one (256 texts of ~450 tokens take ~1 s) on those threads.
INLINE_FALLBACK_TOKENS = 2048
# A request waiting for the engines at start-up stops this long before its
# deadline, so the fallback can still answer it in time; it tries again
# every STARTUP_RETRY_S while the batcher has no engine for it.
FALLBACK_RESERVE_S = 0.2
STARTUP_RETRY_S = 0.05
# The internal hops carry a deadline as uint32 milliseconds (~50 days); a
# caller's longer one is as good as none and goes out as this.
MAX_TIMEOUT_MS = 2**32 - 1


Result = TypeVar("Result")


@dataclass
class Answer:
    """One call's outputs [N, width], token counts, whether degraded, and
    the timings it took itself (for metrics: what the caller is told can
    differ, see Gateway.run)."""

    outputs: np.ndarray
    tokens: list[int]
    degraded: bool
    measured: berth_pb2.Timings


def stamp(timings: berth_pb2.Timings) -> Timings:
    return (
        timings.tokenize_us,
        timings.queue_us,
        timings.inference_us,
        timings.total_us,
    )


def reported(
    measured: berth_pb2.Timings, found: list[Entry | None], missed: bool
) -> Timings:
    """The timings a call is told: its own when nothing was cached; else,
    field by field, the largest of the cached entries' (the timings of the
    calls that computed them) and, when some texts missed, its own. A call
    answered from the cache so reports what the call that filled it did,
    and its timings do not tell whether a text was cached."""
    stamps = [f[2] for f in found if f is not None]
    if missed:
        stamps.append(stamp(measured))
    tokenize, queue, inference, total = (
        max(values) for values in zip(*stamps, strict=True)
    )
    return tokenize, queue, inference, total


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
        # An embedding's full width, and the width a call gets when its
        # options ask for none (the entry's dimensions: a truncate_dim).
        self.width = entry.output_width()
        self.dimension = entry.dimensions or self.width
        self.prompts = Prompts(entry, self.encoder.tokenizer, self.encoder.max_chars)
        # A rerank model's activation on its scores (gateway.berth.activated).
        self.activation = (
            entry.classifier().activation if entry.task == "rerank" else ""
        )
        self.fallback: FallbackModel | PairFallback | None
        if entry.task == "rerank":  # nothing built: lexical overlap
            tokenizer, offset = self.encoder.tokenizer, self.encoder.type_offset
            self.fallback = PairFallback(entry.name, tokenizer, offset)
            return
        try:
            self.fallback = FallbackModel.load(entry)
        except FallbackError as exc:
            log.warning(
                "model %s has no CPU fallback (level 3 off): %s", entry.name, exc
            )
            self.fallback = None

    def prompt(self, options: berth_pb2.Options) -> str:
        """The prompt a call's texts get, its options checked against the
        model (gateway.options); raises InvalidInput."""
        check_dimensions(self.entry, self.width, options.dimensions)
        return self.prompts.of(options)

    def embeddings(self, vectors: np.ndarray, options: berth_pb2.Options) -> np.ndarray:
        """Embeddings as a call's options ask for them: the first
        ``dimensions`` values of each (0: the entry's ``dimensions``, else
        all), then normalized (as :meth:`normalized`), as
        sentence-transformers' truncate_dim."""
        dimensions = options.dimensions or self.dimension
        return self.normalized(truncated(vectors, dimensions), options)

    def normalized(self, vectors: np.ndarray, options: berth_pb2.Options) -> np.ndarray:
        """Embeddings at unit length if the call's options ask for it (if
        they do not say, as the model's default is)."""
        normalize = (
            options.normalize if options.HasField("normalize") else self.entry.normalize
        )
        if not normalize:
            return vectors
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)


class Gateway:
    """The request path shared by every API, unary and streaming calls."""

    def __init__(
        self,
        entries: dict[str, ModelEntry],
        batcher: Batching,
        limits: Limits,
        max_in_flight: int,
        cache: ResponseCache | None = None,
        startup_wait_s: float = 0.0,
    ) -> None:
        self.models = {name: Model(e, limits) for name, e in entries.items()}
        self.batcher = batcher
        # Until the gateway first is SERVING (every model answered from the
        # engines: gateway/__main__.py sets started), and at most until this
        # moment, requests wait for the engines (_hold_while_starting).
        self.started = False
        self.startup_until = time.monotonic() + startup_wait_s
        self._told_waiting = False
        # Disabled unless given one (gateway flags --cache-entries, --cache-mb).
        self.cache = cache or ResponseCache(0, 0)
        self.admission = Admission(max_in_flight)
        # Models whose circuit the batcher reports open: answered by the
        # fallback without a round trip (kept fresh by gateway/__main__.py).
        self.open_circuits: set[str] = set()
        self._tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    def model(self, name: str, task: str | None = None) -> Model:
        """The model named, for a call of this task (any task: None), if
        the call's API key may use it (gateway.auth.allow)."""
        auth.allow(name)
        model = self.models.get(name)
        if model is None:
            raise InvalidInput(
                f"unknown model {quoted(name)}; this gateway serves "
                f"{', '.join(sorted(self.models))}",
                field="model",
                reason="UNKNOWN_MODEL",
            )
        if task is not None and model.entry.task != task:
            task = model.entry.task
            article = "an" if task[0] in "aeiou" else "a"
            raise InvalidInput(
                f"model {name!r} is {article} {task} model: call {task.capitalize()}"
            )
        return model

    async def run(
        self,
        model: Model,
        texts: list[str],
        options: berth_pb2.Options,
        timeout_s: float | None,
        timings: berth_pb2.Timings,
        tenant: str = "",
        query: str | None = None,
    ) -> Answer:
        """Tokenize and run texts: outputs [N, width], token counts, degraded.
        A rerank model's texts run each as a pair after ``query`` (its
        place in the cache key is the prompt's).

        Texts found in the ``tenant``'s response cache (under the call's
        prompt) skip tokenization and the batcher; a call whose texts all
        hit never reaches the batcher. ``timings`` gets what the caller is
        told (:func:`reported`). The outputs are the full rows: the caller
        applies ``dimensions`` and normalization (Model.embeddings).
        """
        t0 = time.perf_counter()
        name, truncate = model.entry.name, options.truncate
        model.encoder.check_count(texts)
        prompt = model.prompt(options) if query is None else query
        with span_if_recording(TRACER, "gateway.cache"):
            found = self.cache.lookup(name, tenant, truncate, texts, prompt)
        if self.cache.enabled:
            hits = sum(f is not None for f in found)
            metrics.CACHE.labels(name, "hit").inc(hits)
            metrics.CACHE.labels(name, "miss").inc(len(found) - hits)
        # Each distinct text missing from the cache runs once.
        if len(texts) == 1:  # most calls
            misses = texts if found[0] is None else []
        else:
            misses = list(
                dict.fromkeys(t for t, f in zip(texts, found, strict=True) if f is None)
            )
        rows: list[np.ndarray] = []
        counts: list[int] = []
        t1 = t0
        degraded = False
        measured = berth_pb2.Timings()
        if misses:
            try:
                with span_if_recording(TRACER, "gateway.tokenize"):
                    ids = await self._tokenize(model, misses, truncate, prompt)
            except InvalidInput:
                if len(misses) < len(texts):
                    # Check the whole call so the error names the caller's index.
                    await self._tokenize(model, texts, truncate, prompt)
                raise
            t1 = time.perf_counter()
            rows, degraded = await self._infer(model, ids, timeout_s, measured)
            counts = [len(x) for x in ids]
            measured.tokenize_us = int((t1 - t0) * 1e6)
            measured.total_us = int((time.perf_counter() - t0) * 1e6)
            if not degraded:  # a fallback's answer is never cached
                own = stamp(measured)
                self.cache.insert(
                    name, tenant, truncate, misses, rows, counts, own, prompt
                )
        if len(misses) < len(texts):  # some cached, or a text twice
            computed = dict(zip(misses, zip(rows, counts, strict=True), strict=True))
            answers = [
                (f[0], f[1]) if f is not None else computed[t]
                for t, f in zip(texts, found, strict=True)
            ]
            rows, counts = [row for row, _ in answers], [n for _, n in answers]
        # (np.stack of one row costs 1.5 µs on the dev machine, this copy 0.3.)
        outputs = rows[0][np.newaxis].copy() if len(rows) == 1 else np.stack(rows)
        if not misses:
            measured.total_us = int((time.perf_counter() - t0) * 1e6)
        (
            timings.tokenize_us,
            timings.queue_us,
            timings.inference_us,
            timings.total_us,
        ) = reported(measured, found, bool(misses))
        return Answer(outputs, counts, degraded, measured)

    async def in_threads(self, work: Callable[..., Result], *args: object) -> Result:
        """``work(*args)`` on the tokenizer threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, work, *args
        )

    async def _tokenize(
        self, model: Model, texts: list[str], truncate: bool, prompt: str
    ) -> list[np.ndarray]:
        """Token ids per text, after ``prompt`` (a rerank model's: each text
        paired with the query ``prompt``). A short call is tokenized right
        here: the tokenizer takes microseconds for it, less than a hop to a
        thread."""
        encoder = model.encoder
        if model.entry.task == "rerank":
            encode = partial(encoder.encode_pairs, prompt, texts, truncate)
        else:
            encode = partial(encoder.encode, texts, truncate, prompt)
        # (The prompt, or query, is tokenized with every text.)
        if len(prompt) * len(texts) + sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return encode()
        return await self.in_threads(encode)

    async def _infer(
        self,
        model: Model,
        ids: list[np.ndarray],
        timeout_s: float | None,
        timings: berth_pb2.Timings,
    ) -> tuple[list[np.ndarray], bool]:
        """The engines' outputs, or the CPU fallback's when they cannot answer.

        Level 3: the fallback answers while the model's circuit is open, while
        the batcher is unreachable, and for a call whose batch failed on the
        engines (so no request is lost to a failing fleet); but not while the
        gateway is starting up (``_hold_while_starting``).
        """
        name = model.entry.name
        error: BerthError | None = None
        while True:
            if name in self.open_circuits:
                reason = "circuit_open"
            elif not self.batcher.connected:
                reason = "batcher_unreachable"
            else:
                ms = (
                    min(max(1, int(timeout_s * 1000)), MAX_TIMEOUT_MS)
                    if timeout_s is not None
                    else 0
                )
                try:
                    with span_if_recording(TRACER, "gateway.infer"):
                        results = await self.batcher.run(name, ids, ms, inject())
                except (Unavailable, EngineFailure) as exc:
                    reason, error = "engine_failure", exc
                    log.debug("engines cannot answer %s: %s", name, exc)
                else:
                    timings.queue_us = max(r.queue_us for r in results)
                    timings.inference_us = max(r.inference_us for r in results)
                    outputs = [np.frombuffer(r.output, dtype="<f4") for r in results]
                    return outputs, False
            waited = await self._hold_while_starting(timeout_s)
            if waited is None:
                break
            if timeout_s is not None:
                timeout_s -= waited
        if model.fallback is None:
            if error is not None:
                raise error
            raise Unavailable(
                f"model {name!r} cannot answer now ({reason.replace('_', ' ')}) and "
                "has no CPU fallback (build it with `berth build-models`)"
            )
        with span_if_recording(
            TRACER, "gateway.fallback", attributes={"berth.reason": reason}
        ):
            if sum(map(len, ids)) <= INLINE_FALLBACK_TOKENS:
                fallback = model.fallback.run(ids)
            else:  # while the fleet fails every call comes here: keep the loop
                fallback = await self.in_threads(model.fallback.run, ids)
        metrics.FALLBACKS.labels(name, reason).inc(len(ids))
        return list(fallback), True

    async def _hold_while_starting(self, timeout_s: float | None) -> float | None:
        """Before the gateway has first been SERVING, how long a request the
        engines cannot answer yet waited for them (then it tries again); None
        when it should not wait: the gateway has served, its start-up window
        (--startup-wait-s from start) is over, or the caller's deadline is
        near (FALLBACK_RESERVE_S before it, so the fallback still answers).

        While a stack starts, its gateways listen before the batcher has
        connected and before the engines have loaded (a GPU engine captures
        its graphs for seconds), and a gateway started next to serving ones
        gets callers on the shared port (SO_REUSEPORT) at once: answering
        them from the fallback would degrade answers the engines are about
        to give. Once the gateway has served, a failing fleet falls back at
        once."""
        if self.started:
            return None
        bound = self.startup_until - time.monotonic()
        if timeout_s is not None:
            bound = min(bound, timeout_s - FALLBACK_RESERVE_S)
        if bound <= 0:
            return None
        if not self._told_waiting:
            self._told_waiting = True
            log.info(
                "start-up: requests wait for the engines, at most %.1f s more "
                "(--startup-wait-s), instead of the CPU fallback",
                self.startup_until - time.monotonic(),
            )
        t0 = time.monotonic()
        if not self.batcher.connected and not self.batcher.ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.batcher.ready.wait(), bound)
        else:  # connected, no engine yet: the batcher refuses at once
            await asyncio.sleep(min(STARTUP_RETRY_S, bound))
        return time.monotonic() - t0
