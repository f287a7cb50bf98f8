"""Triton kernels of the fused forward, each with a plain-torch fallback.

- ``add_layer_norm``: LayerNorm(x + residual), one pass;
  ``add_layer_norm_e4m3`` also writes the rows as the next FP8 product's
  e4m3 input;
- ``quantize_e4m3``: act(x) / scale as e4m3, one pass (an FP8 product's
  input where its producer cannot write e4m3 itself);
- ``embed_with_lengths``: word + position + type-0 embeddings, then
  LayerNorm, and the rows' lengths copied (``embed_packed``: rows packed);
- ``mean_pool``: the float32 mean of each row's real tokens;
- ``attention``: softmax(QK^T / sqrt(d)) V straight from the fused QKV
  projection, keys cut at each row's length, key blocks past it skipped;
- ``linear``: x W^T + b (GELU or ReLU after it) for few tokens, where
  cuBLAS's tiles leave most SMs idle; with ``split`` > 1 the K range is cut
  into slices whose float32 partial products ``add_layer_norm_partials``
  sums, with the bias and the residual, before its LayerNorm (no separate
  split-K reduction, no memset).

Every kernel takes ``pdl``: programmatic dependent launch (Hopper and
later), the kernel launched while its predecessor still runs, each program
waiting for the predecessor's writes (``gdc_wait``) before it reads
anything, then letting its own successor launch (``gdc_launch_dependents``).
A chain of such kernels overlaps each launch with the previous kernel's
tail, what a few-token forward of ~90 short kernels spends much of its time
in (benchmarks/small_batch.py). Every program of every such kernel waits before it
reads anything a kernel writes, so the ordering stays transitive: a kernel
reading what two kernels back wrote is safe. What kernels read before they
wait is model weights, which no kernel writes, so they stream in while the
predecessor runs: biases, LayerNorm weights, position embeddings, and with
``LinearConfig.preload`` ``linear``'s whole weight slice.

Without Triton (the CPU build of torch) or off the GPU each falls back to
torch ops, so the module imports and computes everywhere; with
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests of the kernels
themselves).

One module per operation (base.py holds what they share); this package
exports their public names.
"""

from __future__ import annotations

from engine.cuda.kernels.attention import attention
from engine.cuda.kernels.base import (
    ACT_GELU_ERF,
    ACT_GELU_TANH,
    ACT_NONE,
    ACT_RELU,
    E4M3_MAX,
    LN_ROWS,
    activate_reference,
    launch_options,
    layer_norm_tiles,
    pdl_available,
    to_e4m3,
    triton,
    use_triton,
    warps_for,
)
from engine.cuda.kernels.e4m3 import QUANT_BLOCK, quantize_e4m3
from engine.cuda.kernels.embed import embed_packed, embed_with_lengths
from engine.cuda.kernels.layer_norm import (
    add_layer_norm,
    add_layer_norm_e4m3,
    add_layer_norm_partials,
)
from engine.cuda.kernels.linear import linear, small_linear_plan
from engine.cuda.kernels.pooling import mean_pool

__all__ = [
    "ACT_GELU_ERF",
    "ACT_GELU_TANH",
    "ACT_NONE",
    "ACT_RELU",
    "E4M3_MAX",
    "LN_ROWS",
    "QUANT_BLOCK",
    "activate_reference",
    "add_layer_norm",
    "add_layer_norm_e4m3",
    "add_layer_norm_partials",
    "attention",
    "embed_packed",
    "embed_with_lengths",
    "launch_options",
    "layer_norm_tiles",
    "linear",
    "mean_pool",
    "pdl_available",
    "quantize_e4m3",
    "small_linear_plan",
    "to_e4m3",
    "triton",
    "use_triton",
    "warps_for",
]
