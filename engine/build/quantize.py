"""Quantizing an encoder as an entry asks (``quantize: int8 | fp8``), at load:
calibration on the shipped texts, SmoothQuant for INT8, and GPTQ-rounded
e4m3 codes with static input scales for FP8. The layers it puts in place
(engine/quant.py) are what serves."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from torch import nn

from engine.build.calibration import calibration_texts, text_batches
from engine.cuda import kernels
from engine.quant import (
    FP8,
    QUANT_MODES,
    Batch,
    Fp8Linear,
    Int8DynamicLinear,
    _replace,
    encoder_linears,
    fp8_supported,
)
from services.repository import ModelEntry

log = logging.getLogger("berth.engine")


CALIBRATION_MAX_LENGTH = 256  # the calibration texts fit; longer buckets add nothing


PROGRESS_EVERY_S = 2.0


SMOOTH_ALPHA = 0.8  # measured on the default models: 0.5 hurt, 0.8 was best


def smoothing_factors(
    input_amax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA
) -> torch.Tensor:
    """SmoothQuant's per-input-channel s = max|x|^a / max|w|^(1-a).

    x / s and w * s give the same product, with the activations' outlier
    channels (BERT's LayerNorm outputs have a few) moved into the weights,
    which have a scale per output channel to absorb them.
    """
    w_max = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    x_max = input_amax.float().to(w_max.device).clamp(min=1e-5)
    return (x_max.pow(alpha) / w_max.pow(1.0 - alpha)).clamp(min=1e-5)


def quantize_int8_cpu(
    model: nn.Module,
    batches: Iterable[Batch] | None = None,
    alpha: float = SMOOTH_ALPHA,
) -> int:
    """Replace the encoder's Linears by INT8 ones, in place; returns how many.

    With calibration ``batches``, activations are smoothed first (SmoothQuant):
    on the default models that lifted intent agreement from 96 % to 98 %.
    """
    start = time.perf_counter()
    amax = record_input_amax(model, batches) if batches is not None else {}
    linears = encoder_linears(model)
    for name, linear in linears:
        smooth = smoothing_factors(amax[name], linear.weight, alpha) if amax else None
        _replace(model, name, Int8DynamicLinear(linear, smooth))
    log.info(
        "int8: %d encoder linears quantized (%s) in %.2f s",
        len(linears),
        f"smoothed, alpha {alpha}" if amax else "not smoothed",
        time.perf_counter() - start,
    )
    return len(linears)


@torch.inference_mode()
def record_input_amax(
    model: nn.Module, batches: Iterable[Batch]
) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of each encoder Linear, over ``batches``.

    Padded rows and positions are included: the product sees them too.
    """
    return record_inputs(model, batches)[0]


@torch.inference_mode()
def record_inputs(
    model: nn.Module, batches: Iterable[Batch], hessians: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(per-input-channel max |x|, and with ``hessians`` X^T X) of each
    encoder Linear's inputs, over ``batches``.

    The max sees padded positions too (the product does); X^T X, what GPTQ
    weighs a weight's rounding error by (:func:`gptq_e4m3`), only the real
    tokens' rows, in float32.
    """
    linears = encoder_linears(model)
    amax: dict[str, torch.Tensor] = {}
    gram: dict[str, torch.Tensor] = {}
    real: list[torch.Tensor] = []  # the current batch's real-token mask [B, L]

    def top(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        ids, lengths = args[0], args[1]
        positions = torch.arange(ids.shape[1], device=ids.device)
        real[:] = [positions[None, :] < lengths.to(ids.device)[:, None]]

    def recorder(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach()
            seen = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            amax[name] = seen if name not in amax else torch.maximum(amax[name], seen)
            if hessians:
                rows = x[real[0]].float()
                product = rows.t() @ rows
                gram[name] = product if name not in gram else gram[name] + product

        return hook

    handles = [model.register_forward_pre_hook(top)] if hessians else []
    handles += [lin.register_forward_pre_hook(recorder(n)) for n, lin in linears]
    start, count = time.perf_counter(), 0
    try:
        for ids, lengths in batches:
            model(ids, lengths)
            count += 1
    finally:
        for handle in handles:
            handle.remove()
    if count == 0:
        raise ValueError("calibration needs at least one batch")
    log.info(
        "calibrated the inputs of %d linears on %d batches in %.2f s%s",
        len(amax),
        count,
        time.perf_counter() - start,
        " (with X^T X)" if hessians else "",
    )
    return amax, gram


# Added to X^T X, as a share of its mean diagonal: Hugging Face's GPTQConfig
# default (the paper's is 0.01). With it and the columns in act-order, the
# default intent model's FP8 answers have the lowest KL divergence from
# float32 of six GPTQ settings measured on the H200 (benchmarks/quant_gpu.py).
GPTQ_DAMP = 0.1


GPTQ_BLOCK = 128  # columns whose errors are spread lazily, together


def gptq_e4m3(
    weight: torch.Tensor,
    gram: torch.Tensor,
    scale: torch.Tensor,
    damp: float = GPTQ_DAMP,
    block: int = GPTQ_BLOCK,
    act_order: bool = True,
) -> torch.Tensor:
    """e4m3 codes of ``weight / scale`` [out, in], rounded by GPTQ.

    Rounding each weight to its nearest e4m3 (what :func:`fp8_weight` does)
    minimizes each weight's own error. GPTQ (Frantar et al., 2022) minimizes
    the product's: the input columns are rounded in turn, and each column's
    error is spread over the columns not yet rounded, weighted by the inverse
    of the inputs' X^T X (``gram``, :func:`record_inputs`), so that on inputs
    like the calibration texts' the rounded weight's outputs stay close to
    the exact weight's. On the default intent model it cuts the weights'
    share of FP8's error by half or more (benchmarks/quant_gpu.py). ``scale``
    is the weight's (0-d, or [out] per row); the codes take the same scale.
    With ``act_order`` the columns are rounded largest input first (X^T X's
    diagonal), so the inputs that weigh most have the most columns left to
    take their errors (GPTQ's "act-order").
    """
    if act_order:
        order = torch.argsort(torch.diag(gram), descending=True, stable=True)
        w = weight.detach()[:, order.to(weight.device)]
        codes = gptq_e4m3(w, gram[order][:, order], scale, damp, block, False)
        return codes[:, torch.argsort(order).to(codes.device)]
    w = weight.detach().float().clone()
    columns = w.shape[1]
    inv = (1.0 / scale.float()).reshape(-1, 1) if scale.dim() else 1.0 / scale.float()
    outs = scale.float().reshape(-1) if scale.dim() else scale.float()
    h = gram.detach().float().to(w.device).clone()
    # An input never seen has a zero row and column: its weights spread no
    # error and take their nearest codes (they still count, should it fire).
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    eye = torch.eye(columns, device=w.device)
    for attempt in range(4):
        # The upper Cholesky factor of H^-1: row i holds how column i's
        # error spreads over the columns after it.
        damped = h + damp * 10**attempt * torch.diag(h).mean() * eye
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            factor, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower))
            if int(info) == 0:
                break
    else:  # X^T X too ill-conditioned even damped 1,000 times more
        log.warning("fp8: X^T X not positive definite; weights rounded to nearest")
        return kernels.to_e4m3(w, inv)
    hinv = factor.t().contiguous()
    codes = torch.empty(w.shape, dtype=FP8, device=w.device)
    for first in range(0, columns, block):
        last = min(first + block, columns)
        part, errors = w[:, first:last].clone(), torch.empty_like(w[:, first:last])
        local = hinv[first:last, first:last]
        for i in range(last - first):
            code = kernels.to_e4m3(part[:, i : i + 1], inv)[:, 0]
            codes[:, first + i] = code
            error = (part[:, i] - code.float() * outs) / local[i, i]
            part[:, i:] -= error[:, None] * local[i, i:][None, :]
            errors[:, i] = error
        w[:, last:] -= errors @ hinv[first:last, last:]
    return codes


# Projections the served FP8 layer keeps in the encoder's fp16: none. Keeping
# the attention output's (its input's rounding alone flipped the most intent
# answers in a CPU simulation) measured slower and less accurate on the H200
# once the weights are rounded by GPTQ: 1.402x against 1.433x the fp16 engine,
# 98.85 % against 99.62 % intent agreement (benchmarks/quant_gpu.py).
FP8_KEEP = frozenset[str]()


def quantize_fp8(
    model: nn.Module,
    batches: Iterable[Batch],
    rowwise: bool = False,
    dtype: torch.dtype | None = None,
    dynamic: bool = False,
    keep: frozenset[str] = FP8_KEEP,
    gptq: bool = True,
) -> int:
    """Calibrate on ``batches``, then swap the encoder's Linears for FP8 ones.

    In place. The encoder is first cast to ``dtype``, by default its own
    fp16 or bf16 (fp16 for a float32 model; bf16 with ``rowwise``, whose
    products return bf16), and the FP8 products write that dtype; ``rowwise``
    takes a scale per weight channel and ``dynamic`` (row-wise only) one per
    token (see :class:`Fp8Linear`); projections named in ``keep`` (qkv, out,
    ffn_in, ffn_out; by default :data:`FP8_KEEP`) stay in ``dtype``, as do
    layers whose shape FP8 cannot take. With ``gptq`` the weights' e4m3
    codes are rounded by GPTQ on the calibration inputs (:func:`gptq_e4m3`),
    else each to its nearest. Returns how many were replaced.
    """
    if dynamic and not rowwise:
        raise ValueError("per-token input scales need row-wise scaled products")
    encoder = getattr(model, "encoder", model)
    if dtype is None:
        own = next(encoder.parameters()).dtype
        halves = (torch.float16, torch.bfloat16)
        dtype = torch.bfloat16 if rowwise else own if own in halves else torch.float16
    encoder.to(dtype)
    device = next(encoder.parameters()).device
    per_channel, grams = record_inputs(model, batches, hessians=gptq)
    amax = {name: float(a.max()) for name, a in per_channel.items()}
    start = last = time.perf_counter()
    chosen = [
        (name, linear)
        for name, linear in encoder_linears(model)
        if name.rpartition(".")[2] not in keep
    ]
    replaced = 0
    for name, linear in chosen:
        if not fp8_supported(linear):
            log.warning("fp8: %s kept in %s (shape not a multiple of 16)", name, dtype)
            continue
        gram = grams.pop(name, None)
        layer = Fp8Linear(linear, amax[name], rowwise, dtype, dynamic, gram)
        _replace(model, name, layer)
        replaced += 1
        if gptq and time.perf_counter() - last > PROGRESS_EVERY_S:  # a long load
            last = time.perf_counter()
            log.info("fp8: %d of %d weights rounded by GPTQ", replaced, len(chosen))
    log.info(
        "fp8: %d encoder linears now e4m3 (%s scales, %s input scales, weights "
        "rounded %s in %.2f s; %s kept in %s) on %s",
        replaced,
        "row-wise" if rowwise else "tensor-wise",
        "per-token" if dynamic else "static",
        "by GPTQ" if gptq else "to nearest",
        time.perf_counter() - start,
        ", ".join(sorted(keep)) or "nothing",
        str(dtype).removeprefix("torch."),
        device,
    )
    return replaced


def quantize_for_entry(
    model: nn.Module, entry: ModelEntry, device: torch.device
) -> str:
    """Apply the entry's ``quantize`` option ("none", "int8", "fp8") in place.

    Calibrates on the shipped calibration texts, tokenized by the model's
    own tokenizer. int8 is the CPU path, fp8 the CUDA one; asking for either
    elsewhere is an error that names the setting. Returns the mode applied.
    """
    mode = str(getattr(entry, "quantize", "none") or "none")
    if mode == "none":
        return mode
    if mode not in QUANT_MODES:
        raise ValueError(f"{entry.name}: quantize must be one of {QUANT_MODES}")
    wanted = "cpu" if mode == "int8" else "cuda"
    if device.type != wanted:
        raise ValueError(
            f"{entry.name}: quantize {mode!r} runs on {wanted}, not {device}; "
            f"set quantize to {'fp8' if mode == 'int8' else 'int8'} or 'none'"
        )
    buckets = [b for b in entry.buckets if b <= CALIBRATION_MAX_LENGTH] or entry.buckets
    batches = [
        (torch.from_numpy(b.ids).to(device), torch.from_numpy(b.lengths).to(device))
        for b in text_batches(entry.tokenizer_file, calibration_texts(), buckets, 64)
    ]
    if mode == "int8":
        quantize_int8_cpu(model, batches)
    else:
        quantize_fp8(model, batches)
    return mode
