"""A served model's forward pass with fused GPU kernels: what the graphs capture.

It computes what :class:`engine.model.ServedModel` computes, from the same
modules and weights, in fewer passes over device memory (engine/cuda/kernels/):

- embeddings: gather, add and LayerNorm in one Triton kernel;
- attention: no mask tensor, each row's keys cut at its length, by whichever
  kernel is faster for the shape, measured at capture (``choose_attention``):
  torch's flash attention (varlen, ``seqused_k``) or berth's Triton kernel;
  SDPA with the boolean key mask where neither runs; SDPA with no mask when
  every row is full (``FULL_ROWS``). MPNet's relative position bias: read by
  berth's kernel from a per-head table of key - query (flash takes no bias),
  or SDPA's float mask, as the served model computes it;
- feed-forward: bias and GELU in the cuBLASLt epilogue of the first matmul
  (tanh-form GELU; ``gelu_epilogue=False`` keeps the exact erf form);
- residual add and LayerNorm in one Triton kernel; mean pooling in another;
- few tokens (a plan per token count, from engine/cuda/tiles.py's
  small_linear table): berth's Triton GEMM where it measured faster than
  cuBLAS, its split-K partials summed by the LayerNorm kernel;
- on Hopper, at up to PDL_MAX_TOKENS tokens, every Triton kernel launched
  dependent on its predecessor (``pdl``, engine/cuda/kernels/: its launch
  overlaps the previous kernel's tail); ``BERTH_PDL=0`` turns that off;
- shapes of up to 128 tokens timed at capture with every GEMM a Triton
  kernel that reads its weights before it waits (the preload_linear table:
  one unbroken chain), the faster plan kept (``choose_plan``);
- products as cuBLASLt calls with algorithms timed on their shape (FP8
  layers; fp16/bf16 layers from HALF_TUNED_MIN_TOKENS), and FP8 FFN-in's
  activation in cuBLASLt's epilogue; ``BERTH_CUBLASLT=0`` keeps torch's.

Tokens are kept flat ([batch * length, hidden]) so every matmul is one 2-D
GEMM with its bias in the epilogue. Packed (``tokens`` given): the rows'
tokens end to end, no padding token computed; the CUDA graphs capture large
shapes this way (engine/cuda/graphs.py). Off the GPU each step falls back to
torch ops, so this module imports and computes everywhere.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine import settings as engine_settings
from engine.architectures.mpnet import RelativePositionBias
from engine.cuda import kernels
from engine.cuda.choices import ShapeChoices
from engine.cuda.kernels import add_layer_norm, add_layer_norm_partials, mean_pool
from engine.cuda.layer_products import (
    Fp8Layer,
    HalfLayer,
    adds_residual,
    fp8_plans,
    fp8_product,
    half_plans,
    inv_scale,
    takes,
)
from engine.cuda.plain import unfused_reason
from engine.cuda.products import HalfGemm
from engine.cuda.tiles import LinearConfig
from engine.cuda.timing import packed_starts
from engine.encoder import ACTIVATIONS, Embeddings, EncoderLayer, key_padding_mask
from engine.heads import ClsPooling, MeanPooling
from engine.model import ServedModel

log = logging.getLogger("berth.engine")

ATTENTION_KINDS = ("flash", "triton", "sdpa")


# Dependent launches up to this many tokens a forward. H200, end to end over
# four runs: 1.01-1.23x at 16-256 tokens (mostly 1.06-1.09x), 0.97-1.00x at
# 512-1,024 (MiniLM 0.90-0.99x at 1,024): benchmarks/small_batch.py.
PDL_MAX_TOKENS = 256
# Unpacked forwards of up to this many tokens take ids straight from a mapped
# host buffer in the embedding kernel (``reads_host``); measured at 16 and 128,
# where it saves the ~2 us copy kernel that would run ahead of it.
HOST_READ_MAX_TOKENS = 256


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


class FusedForward(ShapeChoices):
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
        reason = unfused_reason(served)
        if reason is not None:
            raise ValueError(reason)
        self.served = served
        self.encoder = served.encoder
        self.embeddings = cast(Embeddings, self.encoder.embeddings)
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
        settings = engine_settings.current()
        if pdl is None:
            pdl = settings.pdl
        self.pdl = pdl and kernels.pdl_available(weight)
        self.pdl_max_tokens = PDL_MAX_TOKENS
        inputs = self.encoder.attention_inputs
        # MPNet: the bias of every key - query the positions allow, per head.
        self.relative: RelativePositionBias | None = None
        self.position_bias: torch.Tensor | None = None
        if isinstance(inputs, RelativePositionBias):
            self.relative = inputs
            self.position_bias = inputs.by_distance(self.embeddings.max_length)
        self.kinds = self._available(weight)
        self.chosen: dict[tuple[int, int], str] = {}  # (batch, length) -> kind
        self.full_rows: dict[tuple[int, int], str] = {}  # the same, full rows
        self._starts: dict[tuple[int, int], torch.Tensor] = {}
        # By (tokens, preloading): the few-token GEMMs' tiles.
        self._plans: dict[tuple[int, bool], dict[str, LinearConfig]] = {}
        self.preload = True if preload is None else preload
        # (batch, length) -> whether its forward runs PRELOAD_LINEAR's plan.
        self.preloaded: dict[tuple[int, int], bool] = {}
        # (The separate passes and torch's products stay the way wherever
        # cuBLASLt cannot make a product.)
        if fp8_epilogue is None:
            fp8_epilogue = settings.cublaslt
        if fp8_tuned is None:
            fp8_tuned = settings.cublaslt
        self.fp8 = fp8_plans(self, fp8_epilogue, fp8_tuned)
        if fp16_tuned is None:
            fp16_tuned = settings.cublaslt
        self.half = half_plans(self, fp16_tuned)

    def _available(self, weight: torch.Tensor) -> list[str]:
        forced = engine_settings.current().attention
        kinds = []
        biased = self.position_bias is not None  # flash takes no bias
        if not biased and flash_available(weight.device, weight.dtype, self.head_dim):
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
        emb = self.embeddings
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
        starts = packed_starts(used)
        pdl = self._dependent(tokens)
        x = kernels.embed_packed(self.embeddings, ids, used, starts, tokens, pdl)
        keys = (kind, (used, starts), True)
        x = self._layers(x, batch, length, keys)
        if self.mean:
            pooled = mean_pool(x, lengths, starts, pdl)
        else:  # CLS: each row's first token
            pooled = x[starts[:-1].long()].float()
        return self.served.post(pooled)

    def _keys(
        self, kind: str, lengths: torch.Tensor, batch: int, length: int
    ) -> tuple[str, Any, bool]:
        """(kind, what that attention kernel needs to cut keys at each length,
        whether the rows are packed)."""
        if kind == "sdpa":
            return kind, self.sdpa_mask(lengths, length), False
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
            x8 = kernels.quantize_e4m3(x, inv_scale(qkv), pdl=pdl)
        context = self._attend(fp8_product(plan.qkv, qkv, x8), batch, length, keys)
        if isinstance(out, nn.Linear):
            y = F.linear(context, out.weight, out.bias)
        else:
            context8 = kernels.quantize_e4m3(context, inv_scale(out), pdl=pdl)
            y = fp8_product(plan.out, out, context8)
        norm = layer.norm1
        x, h8 = kernels.add_layer_norm_e4m3(
            y, x, norm.weight, norm.bias, self.eps, inv_scale(ffn_in), pdl
        )
        if plan.ffn_in is not None and plan.ffn_in.runs(len(h8)):
            inner8 = plan.ffn_in(h8)
        else:
            inner8 = kernels.quantize_e4m3(
                ffn_in(h8), inv_scale(ffn_out), self.plan_act, pdl
            )
        y, norm = fp8_product(plan.ffn_out, ffn_out, inner8), layer.norm2
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
        elif half is not None and takes(half.qkv, x):
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
        the tile tables (engine/cuda/tiles.py) again (a tile search:
        benchmarks/preload_tiles.py). Graphs captured keep their plans."""
        self._plans.clear()

    def _plan(self, tokens: int, preload: bool = False) -> dict[str, LinearConfig]:
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
        tiles: LinearConfig | None,
        tuned: HalfGemm | None = None,
    ) -> torch.Tensor:
        """LayerNorm(x W^T + b + residual). ``residual`` may be overwritten:
        the layer reads it no more. ``tuned``: the product as a cuBLASLt call
        that adds to the residual (``HalfLayer``)."""
        pdl = self._dependent(len(x))
        if not isinstance(linear, nn.Linear):  # a quantized layer (FP8)
            out = linear(x)
        elif tiles is None and adds_residual(residual) and kernels.use_triton(x):
            # cuBLAS adds the residual (beta = 1, in place) and the LayerNorm
            # reads one tensor, not two: 1-2.6 % of a packed 64-256 x 64-128
            # batch on the H200 (an A/B probe).
            if takes(tuned, x, residual):
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
                pdl=self._dependent(tokens), bias=self.position_bias,
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
        tiles: LinearConfig | None = None,
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
        if half is not None and takes(half.ffn_in, x):
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

    def sdpa_mask(self, lengths: torch.Tensor, length: int) -> torch.Tensor:
        """SDPA's mask: the boolean key mask, or MPNet's float bias with the
        lowest value at padding keys."""
        if self.relative is None:
            return key_padding_mask(lengths, length)
        return self.relative.scores(lengths, length)

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
