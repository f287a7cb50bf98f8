"""The per-shape choices a fused forward makes while the engine captures its
graphs: which attention kernel (``choose_attention``, ``choose_full_rows``)
and which few-token GEMM plan (``choose_plan``), each timed on the shape
inside CUDA graphs (engine/cuda/timing.py) and remembered for its graph."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch

from engine.architectures.mpnet import RelativePositionBias
from engine.cuda.layer_products import Fp8Layer
from engine.cuda.tiles import LinearConfig
from engine.cuda.timing import (
    captured,
    packed_starts,
    time_in_graph,
    time_in_turn,
    timing_lengths,
)
from engine.encoder import Encoder

log = logging.getLogger("berth.engine")

# Attention of a batch whose every row is full, with no mask: SDPA's own pick
# for dense rows (cuDNN's or flash's batch kernel, faster than flash's varlen
# path for any lengths) or berth's Triton kernel, whichever is faster for the
# shape (``choose_full_rows``). H200, BERT-base, inside CUDA graphs: 128 x 128
# SDPA (cuDNN) 30 us a layer, Triton 42, flash 47; 256 x 64 Triton 34, cuDNN
# 56; 32 x 512 cuDNN 69, Triton 94.
FULL_ROWS = ("sdpa", None, False)


class _Forward(Protocol):
    """What the choices read and call on the forward they are made for."""

    encoder: Encoder
    heads: int
    head_dim: int
    kinds: list[str]
    chosen: dict[tuple[int, int], str]
    full_rows: dict[tuple[int, int], str]
    preload: bool
    preloaded: dict[tuple[int, int], bool]
    fp8: list[Fp8Layer | None]
    relative: RelativePositionBias | None

    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...

    def _dependent(self, tokens: int) -> bool: ...

    def sdpa_mask(self, lengths: torch.Tensor, length: int) -> torch.Tensor: ...

    def _plan(self, tokens: int, preload: bool = False) -> dict[str, LinearConfig]: ...

    def _keys(
        self, kind: str, lengths: torch.Tensor, batch: int, length: int
    ) -> tuple[str, Any, bool]: ...

    def _attend(
        self, qkv: torch.Tensor, batch: int, length: int, keys: tuple[str, Any, bool]
    ) -> torch.Tensor: ...

    def choose_attention(
        self, batch: int, length: int, packed: bool = False
    ) -> str: ...

    def preload_eligible(self, tokens: int) -> bool: ...

    def _fastest(
        self,
        candidates: dict[str, tuple[str, Any, bool]],
        tokens: int,
        batch: int,
        length: int,
    ) -> str: ...

    def _full_keys(
        self, kind: str, lengths: torch.Tensor, batch: int, length: int
    ) -> tuple[str, Any, bool]: ...


class ShapeChoices:
    """The choices at capture, as methods of :class:`FusedForward`."""

    def choose_attention(
        self: _Forward, batch: int, length: int, packed: bool = False
    ) -> str:
        """The faster attention kernel for this shape, timed in a CUDA graph
        (``time_in_graph``; random inputs, lengths in (L/2, L]; rows packed as the
        graph will run them when ``packed``); remembered for the graphs.
        Shapes whose kernels launch dependent take berth's Triton kernel
        untimed: it waits inside the chain, where flash's classic launch
        breaks it (alone the two are within noise at such shapes, and timing
        picked flash on some: BERT-base 1 x 128 took 0.458 ms end to end with
        flash, 0.421 with Triton, benchmarks/engine.py on the H200)."""
        if len(self.kinds) == 1:
            self.chosen[(batch, length)] = self.kinds[0]
            return self.kinds[0]
        if self._dependent(batch * length) and "triton" in self.kinds:
            self.chosen[(batch, length)] = "triton"
            return "triton"
        weight = self.encoder.embeddings.word.weight
        lengths = timing_lengths(batch, length, weight.device)
        used = lengths.to(torch.int32)
        candidates = {}
        for kind in self.kinds:
            keys = self._keys(kind, lengths, batch, length)
            if packed and kind in ("flash", "triton"):
                keys = (kind, (used, packed_starts(used)), True)
            candidates[kind] = keys
        tokens = int(used.sum()) if packed else batch * length
        best = self._fastest(candidates, tokens, batch, length)
        self.chosen[(batch, length)] = best
        return best

    def choose_full_rows(self: _Forward, batch: int, length: int) -> str:
        """The faster attention for a batch of this shape whose every row is
        full (FULL_ROWS): SDPA with no mask or berth's Triton kernel, timed in
        a CUDA graph; remembered for that batch's graph."""
        if "triton" not in self.kinds:
            self.full_rows[(batch, length)] = "sdpa"
            return "sdpa"
        weight = self.encoder.embeddings.word.weight
        lengths = torch.full((batch,), length, dtype=torch.int32, device=weight.device)
        candidates = {
            kind: self._full_keys(kind, lengths, batch, length)
            for kind in ("sdpa", "triton")
        }
        best = self._fastest(candidates, batch * length, batch, length)
        self.full_rows[(batch, length)] = best
        return best

    def choose_plan(
        self: _Forward, batch: int, length: int, run: Callable[[], object] | None = None
    ) -> bool:
        """Whether this shape's forward runs the preloading table's
        GEMMs instead of SMALL_LINEAR's plan: one batch timed with each in a
        CUDA graph from an idle GPU, as batches run, the faster remembered
        for the shape's graphs (``time_in_turn``: the two graphs replayed
        alternately, the median of 25 rounds, so the card's clocks, which
        drift while the engine captures, weigh on both alike; timed one after
        the other, the choice at 128 tokens flipped between runs). ``run`` is
        that batch: the engine's whole graph step on its own buffers (the
        forward alone, on random ids with lengths in (L/2, L], where not
        given). The step and the forward alone can rank the plans
        differently: at 128 tokens on the H200 the two plans' forwards tie
        while the preloading plan's zero-copy step is ~5 % faster
        (benchmarks/step_overhead.py). Only shapes
        ``preload_eligible`` are timed; call it after ``choose_attention``.
        A preloading forward that fails to run is logged and the shape keeps
        the other plan."""
        key = (batch, length)
        self.preloaded[key] = False
        if not self.preload_eligible(batch * length):
            return False
        if run is None:
            weight = self.encoder.embeddings.word.weight
            ids = torch.randint(
                0, weight.shape[0], (batch, length), device=weight.device
            )
            lengths = timing_lengths(batch, length, weight.device)
            run = partial(self, ids, lengths)
        graphs = []
        for preload in (False, True):
            self.preloaded[key] = preload
            try:
                graphs.append(captured(run))
            except Exception as exc:  # Triton's errors are not RuntimeErrors
                self.preloaded[key] = False
                if not preload:
                    raise
                log.warning(
                    "%dx%d: the preloading GEMMs failed (%s); the shape keeps "
                    "SMALL_LINEAR's plan", batch, length, exc,
                )  # fmt: skip
                return False
        ms = dict(zip((False, True), time_in_turn(graphs), strict=True))
        self.preloaded[key] = ms[True] < ms[False]
        log.debug(
            "%dx%d forward: %.3f ms with preloading GEMMs, %.3f ms without",
            batch, length, ms[True], ms[False],
        )  # fmt: skip
        return self.preloaded[key]

    def preload_eligible(self: _Forward, tokens: int) -> bool:
        """Whether a forward of this many tokens may take PRELOAD_LINEAR's
        plan: preloading on, kernels launched dependent, a plan in the table,
        and some layer not FP8 (FP8 layers take their own products)."""
        return (
            self.preload
            and self._dependent(tokens)
            and any(plan is None for plan in self.fp8)
            and bool(self._plan(tokens, True))
        )

    def _fastest(
        self: _Forward,
        candidates: dict[str, tuple[str, Any, bool]],
        tokens: int,
        batch: int,
        length: int,
    ) -> str:
        """The candidate whose attention over random qkv [tokens, 3H] is
        fastest in a CUDA graph (``time_in_graph``); one that cannot run the shape is
        skipped with a warning."""
        weight = self.encoder.embeddings.word.weight
        qkv = torch.randn(
            tokens, 3 * self.heads * self.head_dim,
            device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        timings = {}
        for kind, keys in candidates.items():
            try:
                timings[kind] = time_in_graph(
                    lambda keys=keys: self._attend(qkv, batch, length, keys)
                )
            except RuntimeError as exc:  # a kernel that cannot run this shape
                log.warning("attention %s at %dx%d: %s", kind, batch, length, exc)
        return min(timings, key=lambda k: timings[k])

    def _full_keys(
        self: _Forward, kind: str, lengths: torch.Tensor, batch: int, length: int
    ) -> tuple[str, Any, bool]:
        """What ``_attend`` takes for full rows: no mask (MPNet: its position
        bias), or the Triton kernel's lengths (all L) and row starts."""
        if kind == "sdpa" and self.relative is not None:
            return kind, self.sdpa_mask(lengths, length), False
        if kind == "sdpa":
            return FULL_ROWS
        return self._keys("triton", lengths, batch, length)
