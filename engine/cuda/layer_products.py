"""Which products each layer of a fused forward runs, decided once at load:
FP8 layers' cuBLASLt products (with FFN-in's activation in the epilogue),
fp16/bf16 layers' timed cuBLASLt products, or torch's where neither is made."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple, TypeGuard, cast

import torch
from torch import nn

from engine.cuda import kernels
from engine.cuda.cublaslt import (
    EPILOGUE_BIAS,
    EPILOGUE_DEFAULT,
    EPILOGUE_GELU_BIAS,
    EPILOGUE_RELU_BIAS,
    aligned,
)
from engine.cuda.products import (
    Fp8EpilogueGemm,
    HalfGemm,
    fp8_epilogue_gemm,
    half_gemm,
)
from engine.encoder import EncoderLayer

if TYPE_CHECKING:
    from engine.cuda.forward import FusedForward

log = logging.getLogger("berth.engine")


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
    algorithm timed per token count (engine/products.HalfGemm): QKV with its
    bias, FFN-in with its bias and, where cuBLASLt computes it (ReLU, GELU's
    tanh form), its activation, and in fp16 the two products followed by a
    residual added to it in place (``adds_residual``). None: torch's product."""

    qkv: HalfGemm | None
    out: HalfGemm | None
    ffn_in: HalfGemm | None
    ffn_in_act: bool  # whether ffn_in applies the activation itself
    ffn_out: HalfGemm | None


# Forwards of at least this many tokens run HalfLayer's products. H200,
# BERT-base, the engine's graphs against torch's products, two runs: 4,096 to
# 32,768 tokens 1.01-1.05x (128 x 128 1.02-1.04x, 64 x 512 1.05x), but 512 to
# 2,048 tokens 0.88-0.98x, with algorithms timed on one weight copy or on
# copies read cold.
HALF_TUNED_MIN_TOKENS = 4096


def fp8_plans(
    forward: FusedForward, epilogue: bool, tuned: bool
) -> list[Fp8Layer | None]:
    """For each layer whose projections are static tensor-wise FP8
    (``_fp8_layer``): the next layer's QKV input scale, when that product
    is FP8 too (this layer's closing LayerNorm writes its e4m3 input), and
    with ``epilogue``, FFN-in as one cuBLASLt product that applies the
    activation and writes FFN-out's e4m3 input, and with ``tuned``, the
    other products as cuBLASLt's with timed algorithms (engine/cuda/products.py)."""
    ready = [fp8_ready(layer) for layer in forward.layers]
    act = {kernels.ACT_GELU_TANH: "gelu_tanh", kernels.ACT_RELU: "relu"}
    plans: list[Fp8Layer | None] = []
    for i, layer in enumerate(forward.layers):
        if not ready[i]:
            plans.append(None)
            continue
        follows = i + 1 < len(forward.layers) and ready[i + 1]
        after = inv_scale(forward.layers[i + 1].attention.qkv) if follows else None
        ffn_in = None
        if epilogue and forward.plan_act in act:
            ffn_in = fp8_epilogue_gemm(
                layer.ffn_in, inv_scale(layer.ffn_out), act[forward.plan_act]
            )
        others = (layer.attention.qkv, layer.attention.out, layer.ffn_out)
        qkv, out, ffn_out = (fp8_epilogue_gemm(p) if tuned else None for p in others)
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


def half_plans(forward: FusedForward, tuned: bool) -> list[HalfLayer | None]:
    """``HalfLayer`` per layer: for each fp16/bf16 layer on a GPU with
    ``tuned``, None for the others (FP8, or on the CPU)."""
    weight = forward.encoder.embeddings.word.weight
    if not tuned or not weight.is_cuda:
        return [None] * len(forward.layers)
    if forward.activation == "relu":
        act_epilogue: int | None = EPILOGUE_RELU_BIAS
    elif forward.epilogue:
        act_epilogue = EPILOGUE_GELU_BIAS
    else:  # GELU's erf form: cuBLASLt adds the bias, a kernel applies it
        act_epilogue = None
    plans: list[HalfLayer | None] = []
    for layer, fp8 in zip(forward.layers, forward.fp8, strict=True):
        if fp8 is not None or not isinstance(layer.ffn_in, nn.Linear):
            plans.append(None)
            continue
        att = layer.attention
        out = ffn_out = None
        if adds_residual(layer.ffn_out.weight):
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


def adds_residual(residual: torch.Tensor) -> bool:
    """Whether a projection may add its product into the residual in cuBLAS
    (``_project_norm``): in fp16 only. The sum is rounded to the residual's
    type there, before the LayerNorm; bf16's 8-bit mantissa made that cost 3
    of the intent model's 784 answers against float32, where rounding the
    product alone and adding in the LayerNorm's float32 cost none (H200,
    benchmarks/quant_gpu.py's bf16 row)."""
    return residual.dtype == torch.float16


def takes(gemm: HalfGemm | None, *tensors: torch.Tensor) -> TypeGuard[HalfGemm]:
    """Whether a tuned product (None: none was made) runs on these tensors:
    at least HALF_TUNED_MIN_TOKENS rows, each tensor as cuBLASLt's heuristic
    assumes it (engine/cuda/cublaslt.aligned), and a plan for their token count
    (made now, before any capture: engine/cuda/graphs.py runs each shape
    eagerly first)."""
    if gemm is None or len(tensors[0]) < HALF_TUNED_MIN_TOKENS:
        return False
    return all(map(aligned, tensors)) and gemm.runs(len(tensors[0]))


def fp8_ready(layer: EncoderLayer) -> bool:
    """Whether ``layer``'s projections take e4m3 input in their own static
    scale (engine/quant.Fp8Linear, tensor-wise, static input scales): all
    four, or all but the attention's output projection, kept an nn.Linear."""
    projections = (layer.attention.qkv, layer.ffn_in, layer.ffn_out)
    out = layer.attention.out
    fp8 = all(getattr(p, "static_tensorwise", False) for p in projections)
    return fp8 and (
        isinstance(out, nn.Linear) or getattr(out, "static_tensorwise", False)
    )


def fp8_product(
    gemm: Fp8EpilogueGemm | None, linear: nn.Module, x8: torch.Tensor
) -> torch.Tensor:
    """An FP8 projection of e4m3 x8: its cuBLASLt plan where it has one for
    this many tokens, else the module (torch._scaled_mm)."""
    if gemm is not None and gemm.runs(len(x8)):
        return gemm(x8)
    return cast(torch.Tensor, linear(x8))


def inv_scale(projection: nn.Module) -> torch.Tensor:
    """1 / the static input scale of an FP8 projection (a device scalar)."""
    return cast(torch.Tensor, projection.input_inv_scale)
