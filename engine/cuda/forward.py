"""A served model's forward pass with fused GPU kernels: what the graphs capture.

It computes what :class:`engine.model.ServedModel` computes, from the same
modules and weights, in fewer passes over device memory (engine/cuda/kernels.py):

- embeddings: gather, add and LayerNorm in one Triton kernel;
- attention: no mask tensor, each row's keys cut at its length, by whichever
  kernel is faster for the shape, measured at capture (``choose_attention``):
  torch's flash attention (varlen, ``seqused_k``) or berth's Triton kernel;
  SDPA with the boolean key mask where neither runs; SDPA with no mask when
  every row is full (``FULL_ROWS``);
- feed-forward: bias and GELU in the cuBLASLt epilogue of the first matmul
  (tanh-form GELU; ``gelu_epilogue=False`` keeps the exact erf form);
- residual add and LayerNorm in one Triton kernel; mean pooling in another;
- few tokens (a plan per token count, engine/kernels.SMALL_LINEAR): berth's
  Triton GEMM where it measured faster than cuBLAS, its split-K partials
  summed by the LayerNorm kernel;
- on Hopper, at up to PDL_MAX_TOKENS tokens, every Triton kernel launched
  dependent on its predecessor (``pdl``, engine/cuda/kernels.py: its launch
  overlaps the previous kernel's tail); ``BERTH_PDL=0`` turns that off;
- shapes of up to 128 tokens timed at capture with every GEMM a Triton
  kernel that reads its weights before it waits (kernels.PRELOAD_LINEAR:
  one unbroken chain), the faster plan kept (``choose_plan``);
  ``BERTH_PRELOAD=0`` keeps SMALL_LINEAR's.

Tokens are kept flat ([batch * length, hidden]) so every matmul is one 2-D
GEMM with its bias in the epilogue. Packed (``tokens`` given): the rows'
tokens end to end, no padding token computed; the CUDA graphs capture large
shapes this way (engine/cuda/graphs.py). Off the GPU each step falls back to
torch ops, so this module imports and computes everywhere.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.cuda import kernels
from engine.cuda.cublaslt import (
    EPILOGUE_BIAS,
    EPILOGUE_DEFAULT,
    EPILOGUE_GELU_BIAS,
    EPILOGUE_RELU_BIAS,
    Fp8EpilogueGemm,
    HalfGemm,
    aligned,
    fp8_epilogue_gemm,
    half_gemm,
)
from engine.cuda.graphs import capturing
from engine.cuda.kernels import add_layer_norm, add_layer_norm_partials, mean_pool
from engine.encoder import ACTIVATIONS, EncoderLayer, key_padding_mask
from engine.heads import ClsPooling, MeanPooling
from engine.model import ServedModel
from services.config import env

log = logging.getLogger("berth.engine")

# BERTH_ATTENTION: auto (default: the faster per shape), flash, triton or sdpa.
ATTENTION_ENV = "BERTH_ATTENTION"
ATTENTION_KINDS = ("flash", "triton", "sdpa")
# Switches read from the environment (services.config.env, on by default):
# - BERTH_PDL=0: kernels launched the classic way (no dependent launches);
# - BERTH_PRELOAD=0: few-token forwards keep engine/kernels.SMALL_LINEAR's
#   plan, never timing PRELOAD_LINEAR's against it (``choose_plan``);
# - BERTH_FP8_EPILOGUE=0: FP8 layers apply FFN-in's activation in a separate
#   pass instead of cuBLASLt's epilogue (engine/cuda/cublaslt.py; the epilogue is
#   1.06-1.08x the FP8 engine at 128 x 128 on the H200). Session 12 left it
#   opt-in after a graph capture failed once; the cause was garbage collected
#   during a capture, which engine/cuda_graphs.capturing now holds off
#   (notes/gpu.md, session 13);
# - BERTH_FP8_TUNED=0: FP8 layers run QKV, attention-out and FFN-out through
#   torch._scaled_mm (the heuristic's first algorithm) instead of cuBLASLt
#   products with an algorithm timed on their shape (engine/cuda/cublaslt.py);
# - BERTH_FP16_TUNED=0: fp16 (and bf16) layers run their cuBLAS products
#   through torch (the heuristic's first algorithm, with a workspace it
#   zeroes first: a memset node before each product in a graph) instead of
#   cuBLASLt products with an algorithm timed on their shape, with or without
#   a workspace (``HalfLayer``).


class Fp8Layer(NamedTuple):
    """How ``FusedForward._fp8_layer`` runs one FP8 layer; a product whose
    cuBLASLt plan is None is torch's (engine/quant.Fp8Linear's forward)."""

    after: torch.Tensor | None  # 1 / the next layer's QKV input scale
    ffn_in: Fp8EpilogueGemm | None  # FFN-in with activation and e4m3 out
    qkv: Fp8EpilogueGemm | None = None  # the others, bias in, fp16 out
    out: Fp8EpilogueGemm | None = None
    ffn_out: Fp8EpilogueGemm | None = None


class HalfLayer(NamedTuple):
    """An fp16/bf16 layer's products where torch's cuBLAS would run them
    (shapes without berth's few-token tiles), as cuBLASLt calls with an
    algorithm timed per token count (engine/cublaslt.HalfGemm): QKV with its
    bias, FFN-in with its bias and, where cuBLASLt computes it (ReLU, GELU's
    tanh form), its activation, and in fp16 the two products followed by a
    residual added to it in place (``_adds_residual``). None: torch's product."""

    qkv: HalfGemm | None
    out: HalfGemm | None
    ffn_in: HalfGemm | None
    ffn_in_act: bool  # whether ffn_in applies the activation itself
    ffn_out: HalfGemm | None


# Forwards of at least this many tokens run HalfLayer's products. H200,
# BERT-base, the engine's graphs against torch's products, two runs: 4,096 to
# 32,768 tokens 1.01-1.05x (128 x 128 1.02-1.04x, 64 x 512 1.05x), but 512 to
# 2,048 tokens 0.88-0.98x, with algorithms timed on one weight copy or on
# copies read cold (notes/gpu.md, session 18).
HALF_TUNED_MIN_TOKENS = 4096
# Dependent launches up to this many tokens a forward. H200, end to end over
# four runs: 1.01-1.23x at 16-256 tokens (mostly 1.06-1.09x), 0.97-1.00x at
# 512-1,024 (MiniLM 0.90-0.99x at 1,024): benchmarks/small_batch.py.
PDL_MAX_TOKENS = 256
# Unpacked forwards of up to this many tokens take ids straight from a mapped
# host buffer in the embedding kernel (``reads_host``); measured at 16 and 128
# (notes/gpu.md, session 15), where it saved the ~2 us copy kernel before it.
HOST_READ_MAX_TOKENS = 256
# Attention of a batch whose every row is full, with no mask: SDPA's own pick
# for dense rows (cuDNN's or flash's batch kernel, faster than flash's varlen
# path for any lengths) or berth's Triton kernel, whichever is faster for the
# shape (``choose_full_rows``). H200, BERT-base, inside CUDA graphs: 128 x 128
# SDPA (cuDNN) 30 us a layer, Triton 42, flash 47; 256 x 64 Triton 34, cuDNN
# 56; 32 x 512 cuDNN 69, Triton 94.
FULL_ROWS = ("sdpa", None, False)


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash-attention kernel runs here for this model."""
    if device.type != "cuda":
        return False
    try:
        qkv = torch.randn(16, 3, 1, head_dim, device=device, dtype=dtype)
        starts = torch.tensor([0, 16], dtype=torch.int32, device=device)
        keys = torch.tensor([16], dtype=torch.int32, device=device)
        q, k, v = qkv.unbind(1)
        torch.ops.aten._flash_attention_forward(
            q, k, v, starts, starts, 16, 16, 0.0, False, False, seqused_k=keys
        )
    except (RuntimeError, TypeError) as exc:
        log.warning("flash attention unavailable here: %s", exc)
        return False
    return True


class FusedForward:
    """ServedModel's forward with fused kernels: same weights, same function."""

    def __init__(
        self,
        served: ServedModel,
        gelu_epilogue: bool = True,
        pdl: bool | None = None,
        fp8_epilogue: bool | None = None,
        fp8_tuned: bool | None = None,
        preload: bool | None = None,
        fp16_tuned: bool | None = None,
    ) -> None:
        self.served = served
        self.encoder = served.encoder
        self.layers = [cast(EncoderLayer, layer) for layer in self.encoder.layers]
        config = self.encoder.config
        self.heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.eps = config.layer_norm_eps
        self.activation = config.activation
        # The cuBLASLt epilogue computes GELU's tanh form, on the GPU only.
        self.gelu_epilogue = gelu_epilogue or ACTIVATIONS[config.activation] == "tanh"
        weight = self.encoder.embeddings.word.weight
        self.epilogue = self.gelu_epilogue and weight.is_cuda
        # berth's few-token GEMM computes what the cuBLAS path would.
        if self.activation == "relu":
            self.plan_act = kernels.ACT_RELU
        elif self.epilogue or ACTIVATIONS[config.activation] == "tanh":
            self.plan_act = kernels.ACT_GELU_TANH
        else:
            self.plan_act = kernels.ACT_GELU_ERF
        self.mean = isinstance(served.pooling, MeanPooling)
        if pdl is None:
            pdl = env("PDL", True)
        self.pdl = pdl and kernels.pdl_available(weight)
        self.pdl_max_tokens = PDL_MAX_TOKENS
        self.kinds = self._available(weight)
        self.chosen: dict[tuple[int, int], str] = {}  # (batch, length) -> kind
        self.full_rows: dict[tuple[int, int], str] = {}  # the same, full rows
        self._starts: dict[tuple[int, int], torch.Tensor] = {}
        # By (tokens, preloading): the few-token GEMMs' tiles.
        self._plans: dict[tuple[int, bool], dict[str, kernels.LinearConfig]] = {}
        if preload is None:
            preload = env("PRELOAD", True)
        self.preload = preload
        # (batch, length) -> whether its forward runs PRELOAD_LINEAR's plan.
        self.preloaded: dict[tuple[int, int], bool] = {}
        if fp8_epilogue is None:
            fp8_epilogue = env("FP8_EPILOGUE", True)
        if fp8_tuned is None:
            fp8_tuned = env("FP8_TUNED", True)
        self.fp8 = self._fp8_plans(fp8_epilogue, fp8_tuned)
        if fp16_tuned is None:
            fp16_tuned = env("FP16_TUNED", True)
        self.half = self._half_plans(fp16_tuned)

    def _half_plans(self, tuned: bool) -> list[HalfLayer | None]:
        """``HalfLayer`` per layer: for each fp16/bf16 layer on a GPU with
        ``tuned``, None for the others (FP8, or on the CPU)."""
        weight = self.encoder.embeddings.word.weight
        if not tuned or not weight.is_cuda:
            return [None] * len(self.layers)
        if self.activation == "relu":
            act_epilogue: int | None = EPILOGUE_RELU_BIAS
        elif self.epilogue:
            act_epilogue = EPILOGUE_GELU_BIAS
        else:  # GELU's erf form: cuBLASLt adds the bias, a kernel applies it
            act_epilogue = None
        plans: list[HalfLayer | None] = []
        for layer, fp8 in zip(self.layers, self.fp8, strict=True):
            if fp8 is not None or not isinstance(layer.ffn_in, nn.Linear):
                plans.append(None)
                continue
            att = layer.attention
            out = ffn_out = None
            if _adds_residual(layer.ffn_out.weight):
                out = half_gemm(att.out, EPILOGUE_DEFAULT, accumulate=True)
                ffn_out = half_gemm(layer.ffn_out, EPILOGUE_DEFAULT, accumulate=True)
            plans.append(
                HalfLayer(
                    qkv=half_gemm(att.qkv),
                    out=out,
                    ffn_in=half_gemm(layer.ffn_in, act_epilogue or EPILOGUE_BIAS),
                    ffn_in_act=act_epilogue is not None,
                    ffn_out=ffn_out,
                )
            )
        made = [p for p in plans if p is not None]
        if made:
            log.info(
                "%d of %d layers run their cuBLAS products as cuBLASLt calls "
                "with timed algorithms", len(made), len(plans),
            )  # fmt: skip
        return plans

    def _fp8_plans(self, epilogue: bool, tuned: bool) -> list[Fp8Layer | None]:
        """For each layer whose projections are static tensor-wise FP8
        (``_fp8_layer``): the next layer's QKV input scale, when that product
        is FP8 too (this layer's closing LayerNorm writes its e4m3 input), and
        with ``epilogue``, FFN-in as one cuBLASLt product that applies the
        activation and writes FFN-out's e4m3 input, and with ``tuned``, the
        other products as cuBLASLt's with timed algorithms (engine/cuda/cublaslt.py)."""
        ready = [_fp8_ready(layer) for layer in self.layers]
        act = {kernels.ACT_GELU_TANH: "gelu_tanh", kernels.ACT_RELU: "relu"}
        plans: list[Fp8Layer | None] = []
        for i, layer in enumerate(self.layers):
            if not ready[i]:
                plans.append(None)
                continue
            follows = i + 1 < len(self.layers) and ready[i + 1]
            after = _inv_scale(self.layers[i + 1].attention.qkv) if follows else None
            ffn_in = None
            if epilogue and self.plan_act in act:
                ffn_in = fp8_epilogue_gemm(
                    layer.ffn_in, _inv_scale(layer.ffn_out), act[self.plan_act]
                )
            others = (layer.attention.qkv, layer.attention.out, layer.ffn_out)
            qkv, out, ffn_out = (
                fp8_epilogue_gemm(p) if tuned else None for p in others
            )
            plans.append(Fp8Layer(after, ffn_in, qkv, out, ffn_out))
        made = [p for p in plans if p is not None]
        if made:
            log.info(
                "fp8: %d of %d layers run as FP8 layers, %d with FFN-in's "
                "activation in cuBLASLt's epilogue, %d with timed cuBLASLt products",
                len(made), len(plans), sum(p.ffn_in is not None for p in made),
                sum(p.ffn_out is not None for p in made),
            )  # fmt: skip
        return plans

    def _available(self, weight: torch.Tensor) -> list[str]:
        forced = os.environ.get(ATTENTION_ENV, "auto")
        if forced != "auto" and forced not in ATTENTION_KINDS:
            raise ValueError(
                f"{ATTENTION_ENV}={forced!r}: use auto or {ATTENTION_KINDS}"
            )
        kinds = []
        if flash_available(weight.device, weight.dtype, self.head_dim):
            kinds.append("flash")
        if kernels.use_triton(weight) and weight.is_cuda:
            kinds.append("triton")
        kinds.append("sdpa")
        return [forced] if forced in kinds else kinds[:-1] or kinds

    def __call__(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        tokens: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids [B, L], lengths [B] (any int dtype, on the device) -> [B, width].

        ``out`` (float32 [B, width]): where the pooling kernel may write the
        result itself, when the pooled rows are the output (mean pooling, no
        head) and the rows are not packed; the result is ``out`` then, else
        a new tensor the caller copies (a graph's zero-copy output: one
        kernel fewer at batch 1).

        With ``tokens``, the rows are packed first: row b's max(lengths[b], 1)
        tokens follow row b - 1's, and every matmul, LayerNorm and attention
        runs on ``tokens`` rows (at least the rows' total; see :meth:`packs`)
        instead of B * L, padding computed for none. ``tokens`` = B * L says
        every row is full (the caller's promise, engine/cuda/graphs.py's
        ladder keeps it): packed is padded then, and attention runs with no
        mask (FULL_ROWS)."""
        batch, length = ids.shape
        emb = self.encoder.embeddings
        if length > emb.max_length:
            raise ValueError(
                f"sequence length {length} is over the model's {emb.max_length} "
                "positions"
            )
        kind = self.chosen.get((batch, length), self.kinds[0])
        full = tokens == batch * length
        if tokens is not None and not full:
            return self._packed(ids, lengths, tokens, kind)
        pdl = self._dependent(ids.numel())
        # Every later kernel reads the embedding kernel's copy of lengths.
        x, lengths = kernels.embed_with_lengths(emb, ids, lengths, pdl)
        if full:
            chosen = self.full_rows.get((batch, length), "sdpa")
            keys = self._full_keys(chosen, lengths, batch, length)
        else:
            keys = self._keys(kind, lengths, batch, length)
        x = self._layers(x, batch, length, keys)
        hidden = x.view(batch, length, -1)
        if self.mean and kernels.use_triton(x):  # rows start at b * L
            starts = self._row_starts(batch, length, x.device)
            if out is not None and isinstance(self.served.post, nn.Identity):
                return mean_pool(x, lengths, starts, pdl, out=out)
            pooled = mean_pool(x, lengths, starts, pdl)
        elif self.mean:
            pooled = mean_pool(hidden, lengths)
        else:
            pooled = self.served.pooling(hidden, lengths)
        return self.served.post(pooled)

    def _dependent(self, tokens: int) -> bool:
        """Whether this many tokens' kernels launch dependent (PDL_MAX_TOKENS)."""
        return self.pdl and tokens <= self.pdl_max_tokens

    def clamps_inputs(self, batch: int, length: int, tokens: int | None) -> bool:
        """Whether this shape's forward reads ids and lengths only in its
        embedding kernel, which clamps them (ids into the vocabulary, lengths
        into [0, L]) and copies lengths for every later kernel: unpacked rows,
        with Triton. No input makes such a forward read out of bounds, so the
        engine may check a batch's values while it runs."""
        unpacked = tokens is None or tokens == batch * length
        return unpacked and kernels.use_triton(self.encoder.embeddings.word.weight)

    def reads_host(self, batch: int, length: int, tokens: int | None) -> bool:
        """Whether this shape's forward may take ids and lengths straight from
        a device-mapped host buffer: its embedding kernel is their only reader
        (``clamps_inputs``), and at few tokens its programs' scattered reads
        over PCIe cost less than a copy kernel before it (a zero-copy graph's
        first kernel at batch 1)."""
        few = batch * length <= HOST_READ_MAX_TOKENS
        return few and self.clamps_inputs(batch, length, tokens)

    def packs(self, batch: int, length: int) -> bool:
        """Whether this shape can run packed: its attention kernel takes row
        starts (flash varlen, berth's Triton kernel) and the pooling is
        mean or CLS."""
        kind = self.chosen.get((batch, length), self.kinds[0])
        pooling = self.mean or isinstance(self.served.pooling, ClsPooling)
        return kind in ("flash", "triton") and pooling

    def _packed(
        self, ids: torch.Tensor, lengths: torch.Tensor, tokens: int, kind: str
    ) -> torch.Tensor:
        batch, length = ids.shape
        if not self.packs(batch, length):
            raise ValueError(f"attention {kind!r} cannot run packed rows")
        used = lengths.clamp(min=1).to(torch.int32)
        starts = _packed_starts(used)
        pdl = self._dependent(tokens)
        x = kernels.embed_packed(
            self.encoder.embeddings, ids, used, starts, tokens, pdl
        )
        keys = (kind, (used, starts), True)
        x = self._layers(x, batch, length, keys)
        if self.mean:
            pooled = mean_pool(x, lengths, starts, pdl)
        else:  # CLS: each row's first token
            pooled = x[starts[:-1].long()].float()
        return self.served.post(pooled)

    def choose_attention(self, batch: int, length: int, packed: bool = False) -> str:
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
        lengths = _timing_lengths(batch, length, weight.device)
        used = lengths.to(torch.int32)
        candidates = {}
        for kind in self.kinds:
            keys = self._keys(kind, lengths, batch, length)
            if packed and kind in ("flash", "triton"):
                keys = (kind, (used, _packed_starts(used)), True)
            candidates[kind] = keys
        tokens = int(used.sum()) if packed else batch * length
        best = self._fastest(candidates, tokens, batch, length)
        self.chosen[(batch, length)] = best
        return best

    def choose_full_rows(self, batch: int, length: int) -> str:
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
        self, batch: int, length: int, run: Callable[[], object] | None = None
    ) -> bool:
        """Whether this shape's forward runs engine/kernels.PRELOAD_LINEAR's
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
        (notes/gpu.md, session 15). Only shapes
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
            lengths = _timing_lengths(batch, length, weight.device)
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

    def preload_eligible(self, tokens: int) -> bool:
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
        self,
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
        self, kind: str, lengths: torch.Tensor, batch: int, length: int
    ) -> tuple[str, Any, bool]:
        """What ``_attend`` takes for full rows: no mask, or the Triton
        kernel's lengths (all L) and row starts."""
        if kind == "sdpa":
            return FULL_ROWS
        return self._keys("triton", lengths, batch, length)

    def _keys(
        self, kind: str, lengths: torch.Tensor, batch: int, length: int
    ) -> tuple[str, Any, bool]:
        """(kind, what that attention kernel needs to cut keys at each length,
        whether the rows are packed)."""
        if kind == "sdpa":
            return kind, key_padding_mask(lengths, length), False
        starts = self._row_starts(batch, length, lengths.device)
        if kind == "triton":  # reads any int lengths, 0 as 1: no kernels here
            return kind, (lengths, starts), False
        return kind, (lengths.clamp(min=1).to(torch.int32), starts), False

    def _layers(
        self, x: torch.Tensor, batch: int, length: int, keys: tuple[str, Any, bool]
    ) -> torch.Tensor:
        """Every encoder layer over x [tokens, hidden]."""
        x8 = None  # x as the next FP8 layer's e4m3 input, where written
        for layer, fp8, half in zip(self.layers, self.fp8, self.half, strict=True):
            if fp8 is not None:
                x, x8 = self._fp8_layer(layer, x, x8, fp8, batch, length, keys)
            else:
                x, x8 = self._layer(layer, x, batch, length, keys, half), None
        return x

    def _fp8_layer(
        self,
        layer: EncoderLayer,
        x: torch.Tensor,
        x8: torch.Tensor | None,
        plan: Fp8Layer,
        batch: int,
        length: int,
        keys: tuple[str, Any, bool],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A layer of static tensor-wise FP8 products (engine/quant.Fp8Linear):
        each product's e4m3 input is written by the kernel before it (the
        LayerNorm, FFN-in's epilogue or an activation pass, a pass over the
        attention's output), and cuBLASLt adds the biases (in products with
        timed algorithms, where planned). The attention's output projection
        may be kept in fp16 (``quantize_fp8(keep=...)``), taking the
        attention's output as it is. The activation is the fp16 engine's
        (``plan_act``: GELU's tanh form on the GPU, as its cuBLASLt epilogue
        computes). Returns the layer's output and, where the plan has the next
        QKV product's input scale, the same rows as that product's e4m3 input."""
        att = layer.attention
        qkv, out, ffn_in, ffn_out = att.qkv, att.out, layer.ffn_in, layer.ffn_out
        pdl = self._dependent(len(x))
        if x8 is None:
            x8 = kernels.quantize_e4m3(x, _inv_scale(qkv), pdl=pdl)
        context = self._attend(_product(plan.qkv, qkv, x8), batch, length, keys)
        if isinstance(out, nn.Linear):
            y = F.linear(context, out.weight, out.bias)
        else:
            context8 = kernels.quantize_e4m3(context, _inv_scale(out), pdl=pdl)
            y = _product(plan.out, out, context8)
        norm = layer.norm1
        x, h8 = kernels.add_layer_norm_e4m3(
            y, x, norm.weight, norm.bias, self.eps, _inv_scale(ffn_in), pdl
        )
        if plan.ffn_in is not None and plan.ffn_in.runs(len(h8)):
            inner8 = plan.ffn_in(h8)
        else:
            inner8 = kernels.quantize_e4m3(
                ffn_in(h8), _inv_scale(ffn_out), self.plan_act, pdl
            )
        y, norm = _product(plan.ffn_out, ffn_out, inner8), layer.norm2
        if plan.after is None:
            return add_layer_norm(y, x, norm.weight, norm.bias, self.eps, pdl=pdl), None
        return kernels.add_layer_norm_e4m3(
            y, x, norm.weight, norm.bias, self.eps, plan.after, pdl
        )

    def _layer(
        self,
        layer: EncoderLayer,
        x: torch.Tensor,
        batch: int,
        length: int,
        keys: tuple[str, Any, bool],
        half: HalfLayer | None = None,
    ) -> torch.Tensor:
        attention = layer.attention
        plan = self._plan(x.shape[0], self.preloaded.get((batch, length), False))
        if not isinstance(attention.qkv, nn.Linear):  # a quantized layer (FP8)
            qkv = attention.qkv(x)
        elif "qkv" in plan:
            qkv = kernels.linear(
                x, attention.qkv.weight, attention.qkv.bias, config=plan["qkv"],
                pdl=self._dependent(len(x)),
            )  # fmt: skip
        elif half is not None and _takes(half.qkv, x):
            qkv = half.qkv(x)
        else:
            qkv = F.linear(x, attention.qkv.weight, attention.qkv.bias)
        context = self._attend(qkv, batch, length, keys)
        x = self._project_norm(
            context, attention.out, x, layer.norm1, plan.get("out"),
            half.out if half is not None else None,
        )  # fmt: skip
        inner = self._ffn_in(layer, x, plan.get("ffn_in"), half)
        return self._project_norm(
            inner, layer.ffn_out, x, layer.norm2, plan.get("ffn_out"),
            half.ffn_out if half is not None else None,
        )  # fmt: skip

    def forget_plans(self) -> None:
        """Drop the GEMM plans made so far, so the next forward reads
        kernels.SMALL_LINEAR and PRELOAD_LINEAR again (a tile search:
        benchmarks/preload_tiles.py). Graphs captured keep their plans."""
        self._plans.clear()

    def _plan(
        self, tokens: int, preload: bool = False
    ) -> dict[str, kernels.LinearConfig]:
        """Which projections run berth's few-token GEMM at this many tokens,
        with which tiles (``preload``: PRELOAD_LINEAR's, {} where it has none)."""
        key = (tokens, preload)
        if key not in self._plans:
            weight = self.encoder.embeddings.word.weight
            config = self.encoder.config
            self._plans[key] = kernels.small_linear_plan(
                weight, tokens, config.hidden_size, config.intermediate_size, preload
            )
        return self._plans[key]

    def _project_norm(
        self,
        x: torch.Tensor,
        linear: nn.Module,
        residual: torch.Tensor,
        norm: nn.LayerNorm,
        tiles: kernels.LinearConfig | None,
        tuned: HalfGemm | None = None,
    ) -> torch.Tensor:
        """LayerNorm(x W^T + b + residual). ``residual`` may be overwritten:
        the layer reads it no more. ``tuned``: the product as a cuBLASLt call
        that adds to the residual (``HalfLayer``)."""
        pdl = self._dependent(len(x))
        if not isinstance(linear, nn.Linear):  # a quantized layer (FP8)
            out = linear(x)
        elif tiles is None and _adds_residual(residual) and kernels.use_triton(x):
            # cuBLAS adds the residual (beta = 1, in place) and the LayerNorm
            # reads one tensor, not two: 1-2.6 % of a packed 64-256 x 64-128
            # batch on the H200 (notes/gpu.md, session 17).
            if _takes(tuned, x, residual):
                tuned.add_to(x, residual)
            else:
                residual.addmm_(x, linear.weight.t())
            return add_layer_norm_partials(
                None, linear.bias, residual, norm.weight, norm.bias, self.eps, pdl
            )
        elif tiles is None:
            out = F.linear(x, linear.weight, linear.bias)
        elif tiles.split > 1:  # float32 partials, summed by the LayerNorm kernel
            part = kernels.linear(x, linear.weight, None, config=tiles, pdl=pdl)
            return add_layer_norm_partials(
                part, linear.bias, residual, norm.weight, norm.bias, self.eps, pdl
            )
        else:
            out = kernels.linear(x, linear.weight, linear.bias, config=tiles, pdl=pdl)
        return add_layer_norm(out, residual, norm.weight, norm.bias, self.eps, pdl=pdl)

    def _attend(
        self, qkv: torch.Tensor, batch: int, length: int, keys: tuple[str, Any, bool]
    ) -> torch.Tensor:
        tokens = qkv.shape[0]
        kind, cut, packed = keys
        if kind == "triton":
            used, starts = cut
            return kernels.attention(
                qkv, used, batch, length, self.heads, starts=starts, packed=packed,
                pdl=self._dependent(tokens),
            )  # fmt: skip
        if kind == "flash":
            used, starts = cut
            q, k, v = qkv.view(tokens, 3, self.heads, self.head_dim).unbind(1)
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, starts, starts, length, length, 0.0, False, False,
                seqused_k=None if packed else used,
            )[0]  # fmt: skip
            return out.reshape(tokens, -1)
        shaped = qkv.view(batch, length, 3, self.heads, self.head_dim)
        q, k, v = shaped.permute(2, 0, 3, 1, 4).unbind(0)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=cut)
        return context.transpose(1, 2).reshape(tokens, -1)

    def _ffn_in(
        self,
        layer: EncoderLayer,
        x: torch.Tensor,
        tiles: kernels.LinearConfig | None = None,
        half: HalfLayer | None = None,
    ) -> torch.Tensor:
        linear = layer.ffn_in
        if not isinstance(linear, nn.Linear):  # a quantized layer (FP8)
            return layer.act(linear(x))
        if tiles is not None:
            pdl = self._dependent(len(x))
            return kernels.linear(
                x, linear.weight, linear.bias, self.plan_act, tiles, pdl
            )
        if half is not None and _takes(half.ffn_in, x):
            inner = half.ffn_in(x)
            return inner if half.ffn_in_act else layer.act(inner)
        if self.activation == "relu":
            return torch._addmm_activation(
                linear.bias, x, linear.weight.t(), use_gelu=False
            )
        if self.epilogue:
            return torch._addmm_activation(
                linear.bias, x, linear.weight.t(), use_gelu=True
            )
        return layer.act(F.linear(x, linear.weight, linear.bias))

    def _row_starts(
        self, batch: int, length: int, device: torch.device
    ) -> torch.Tensor:
        """int32 [B + 1]: where each row's tokens start; made once per shape."""
        key = (batch, length)
        if key not in self._starts:
            self._starts[key] = torch.arange(
                0, (batch + 1) * length, length, dtype=torch.int32, device=device
            )
        return self._starts[key]


def _adds_residual(residual: torch.Tensor) -> bool:
    """Whether a projection may add its product into the residual in cuBLAS
    (``_project_norm``): in fp16 only. The sum is rounded to the residual's
    type there, before the LayerNorm; bf16's 8-bit mantissa made that cost 3
    of the intent model's 784 answers against float32, where rounding the
    product alone and adding in the LayerNorm's float32 cost none (H200,
    notes/gpu.md, session 19)."""
    return residual.dtype == torch.float16


def _takes(gemm: HalfGemm | None, *tensors: torch.Tensor) -> TypeGuard[HalfGemm]:
    """Whether a tuned product (None: none was made) runs on these tensors:
    at least HALF_TUNED_MIN_TOKENS rows, each tensor as cuBLASLt's heuristic
    assumes it (engine/cublaslt.aligned), and a plan for their token count
    (made now, before any capture: engine/cuda_graphs runs each shape
    eagerly first)."""
    if gemm is None or len(tensors[0]) < HALF_TUNED_MIN_TOKENS:
        return False
    return all(map(aligned, tensors)) and gemm.runs(len(tensors[0]))


def _fp8_ready(layer: EncoderLayer) -> bool:
    """Whether ``layer``'s projections take e4m3 input in their own static
    scale (engine/quant.Fp8Linear, tensor-wise, static input scales): all
    four, or all but the attention's output projection, kept an nn.Linear."""
    projections = (layer.attention.qkv, layer.ffn_in, layer.ffn_out)
    out = layer.attention.out
    fp8 = all(getattr(p, "static_tensorwise", False) for p in projections)
    return fp8 and (
        isinstance(out, nn.Linear) or getattr(out, "static_tensorwise", False)
    )


def _product(
    gemm: Fp8EpilogueGemm | None, linear: nn.Module, x8: torch.Tensor
) -> torch.Tensor:
    """An FP8 projection of e4m3 x8: its cuBLASLt plan where it has one for
    this many tokens, else the module (torch._scaled_mm)."""
    if gemm is not None and gemm.runs(len(x8)):
        return gemm(x8)
    return cast(torch.Tensor, linear(x8))


def _inv_scale(projection: nn.Module) -> torch.Tensor:
    """1 / the static input scale of an FP8 projection (a device scalar)."""
    return cast(torch.Tensor, projection.input_inv_scale)


def _timing_lengths(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Random row lengths in (L/2, L]: what the choices at capture are timed on."""
    return torch.randint(length // 2 + 1, length + 1, (batch,), device=device)


def _packed_starts(used: torch.Tensor) -> torch.Tensor:
    """int32 [B + 1]: where each packed row starts (cumulative lengths, 0 first)."""
    return F.pad(used.cumsum(0, dtype=torch.int32), (1, 0))


def time_in_graph(fn: Any, calls: int = 10, rounds: int = 3) -> float:
    """Milliseconds per call of fn's GPU work: ``calls`` calls captured in one
    CUDA graph, as the engine will run them, the best of a few replays.

    Back-to-back eager calls timed Python's launches instead, where kernels
    take a few microseconds: they picked flash attention for BERT-base 128 x
    16, whose graph then took 1.32 ms against 0.95 with berth's kernel
    (benchmarks/engine.py, H200)."""
    graph = captured(fn, calls)
    return min(replay_ms(graph) for _ in range(rounds)) / calls


def captured(fn: Any, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of fn, after one eager warm-up call
    (Triton compiles, cuBLAS picks its kernels)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        for _ in range(calls):
            fn()
    return graph


def time_in_turn(graphs: list[torch.cuda.CUDAGraph], rounds: int = 25) -> list[float]:
    """Milliseconds of one replay of each graph from an idle stream, as a
    batch runs: the median of ``rounds`` rounds that replay every graph once,
    in turn, each replay timed by events and waited for."""
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for graph, own in zip(graphs, times, strict=True):
            own.append(replay_ms(graph))
    return [statistics.median(own) for own in times]


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Milliseconds of one replay on the current stream: events around it,
    then waited for."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
