"""Quantized linear layers for berth's encoder: INT8 on the CPU, FP8 on the GPU.

Only the encoder's ``nn.Linear`` layers are replaced (QKV, attention output,
FFN in and out): embeddings, LayerNorms, attention scores, pooling and the
classifier head keep their precision.

- ``int8`` (CPU): :class:`Int8DynamicLinear`, int8 weights with one scale per
  output channel, activations quantized per call at run time, int8 x int8
  products in fbgemm/oneDNN (``torch.ops.quantized.linear_dynamic``); with
  calibration texts, activation outliers are first smoothed into the
  weights (SmoothQuant).
- ``fp8`` (CUDA, Hopper/Ada): :class:`Fp8Linear`, e4m3 weights with one
  scale per weight (per output channel in the row-wise variant), their codes
  rounded by GPTQ, and a static activation scale per layer, both calibrated
  on real texts (engine/build/quantize.py), multiplied
  by ``torch._scaled_mm`` with the bias in its epilogue, writing the model's
  fp16 (the fused forward makes the same products through cuBLASLt itself,
  engine/cuda/products.py). Its forward has no data-dependent control flow and no
  host sync, so it lives inside the engine's CUDA graphs, where
  engine/cuda/forward.py's LayerNorm and GELU kernels write the next product's e4m3
  input themselves.

The scale arithmetic is plain torch and runs (and is tested) on the CPU;
``torch._scaled_mm`` also runs there, slowly, as a reference.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from engine.cuda import kernels

log = logging.getLogger("berth.engine")

QUANT_MODES = ("none", "int8", "fp8")
E4M3_MAX = kernels.E4M3_MAX  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
INT8_MAX = 127.0
_TINY = 1e-12

Batch = tuple[torch.Tensor, torch.Tensor]  # (input_ids [B, L], lengths [B])


def encoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of each nn.Linear of the encoder (the head excluded)."""
    root = getattr(model, "encoder", model)
    prefix = "encoder." if root is not model else ""
    return [
        (prefix + name, module)
        for name, module in root.named_modules()
        if isinstance(module, nn.Linear)
    ]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


# ---- INT8 on the CPU ---------------------------------------------------------


def int8_weight_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel scales: row max |w| maps to 127."""
    return weight.detach().float().abs().amax(dim=1).clamp(min=_TINY) / INT8_MAX


def _cpu_has_vnni() -> bool:
    """AVX-512 VNNI / AVX-VNNI / AMX: int8 sums in 32 bits, no 16-bit saturation."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read(1 << 16)
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


REDUCE_RANGE = not _cpu_has_vnni()


class Int8DynamicLinear(nn.Module):
    """An nn.Linear as int8 x int8 on the CPU: per-channel weights, dynamic inputs."""

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float().cpu()
        self.inv_smooth: torch.Tensor | None = None
        if smooth is not None:
            smooth = smooth.detach().float().cpu()
            weight = weight * smooth[None, :]
            self.inv_smooth = 1.0 / smooth
        scales = int8_weight_scales(weight).double()
        zeros = torch.zeros(self.out_features, dtype=torch.int64)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        # Quantized tensors are deprecated in torch 2.13 (in favour of torchao);
        # the fbgemm/oneDNN kernels this packs for are not. Silence the notice.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_smooth is not None:
            x = x * self.inv_smooth
        # Activations: one asymmetric uint8 range per call, 7 bits where the
        # CPU lacks VNNI (its 16-bit pair sums could saturate), as torch.ao does.
        out: torch.Tensor = torch.ops.quantized.linear_dynamic(
            x, self._packed, REDUCE_RANGE
        )
        return out

    def extra_repr(self) -> str:
        smooth = "smoothed" if self.inv_smooth is not None else "plain"
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, {smooth}"


# ---- FP8 on the GPU ----------------------------------------------------------


def fp8_weight_scales(weight: torch.Tensor, rowwise: bool = True) -> torch.Tensor:
    """Scales that map max |w| to 448 (e4m3's largest): one per output channel
    (row-wise), else one for the whole weight (a 0-d tensor)."""
    w = weight.detach().float().abs()
    amax = w.amax(dim=1) if rowwise else w.amax()
    return amax.clamp(min=_TINY) / E4M3_MAX


def fp8_input_scale(amax: float) -> float:
    """A static activation scale from the calibrated max |x|."""
    return max(float(amax), 1e-6) / E4M3_MAX


def quantize_e4m3(x: torch.Tensor, inv_scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to ±448 (e4m3fn has no inf: overflow would be NaN)."""
    return kernels.to_e4m3(x, inv_scale)


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, float32 scales [rows, 1]): each row's max |x| maps to 448."""
    scales = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-6) / E4M3_MAX
    return quantize_e4m3(x, 1.0 / scales), scales


# What a per-token Fp8Linear quantizes its input with: eager (several kernels)
# unless use_compiled_quantize() swapped in one fused Triton kernel.
_quantize_rows = quantize_rows_e4m3


def use_compiled_quantize() -> bool:
    """Quantize per-token FP8 inputs with one fused kernel (torch.compile,
    needs Triton); static input scales always take berth's own kernel
    (engine/cuda/kernels/e4m3.py).

    Each new input shape compiles once, at its first call: warm every shape
    up before capturing CUDA graphs. Returns whether the swap happened.
    """
    global _quantize_rows
    try:
        import triton  # noqa: F401
    except ImportError:
        log.info("fp8: no Triton, inputs are quantized by eager kernels")
        return False
    _quantize_rows = torch.compile(quantize_rows_e4m3, dynamic=None)
    return True


def fp8_weight(
    weight: torch.Tensor, rowwise: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [out, in], float32 scales) with w ~= w8 * scale: scales
    [out] row-wise, one 0-d scale tensor-wise."""
    scales = fp8_weight_scales(weight, rowwise)
    inv = (1.0 / scales)[:, None] if rowwise else 1.0 / scales
    return quantize_e4m3(weight.detach(), inv), scales


def fp8_supported(linear: nn.Linear) -> bool:
    """torch._scaled_mm needs both matrix dimensions to be multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


class Fp8Linear(nn.Module):
    """An nn.Linear as one FP8 e4m3 matmul (``torch._scaled_mm``).

    - **Tensor-wise** (``rowwise=False``, what the engine serves): one scale
      for the weight and one static input scale, calibrated; cuBLASLt applies
      both and adds the bias in its epilogue and writes ``out_dtype`` (the
      model's fp16): one kernel, given e4m3 input. On the H200 it is the faster
      layout at every BERT-base size, 1.3-1.7x fp16 at 16,384 tokens and
      1.0-1.4x at 128, where the row-wise kernels are slower than fp16
      (benchmarks/fp8_gemm.py). e4m3 is floating point, so a scale only
      matters for values it pushes under e4m3's subnormals: one for a whole
      weight measured as accurate as one per channel (mean cosine 0.99736
      against 0.99738, benchmarks/quant_gpu.py).
    - **Row-wise**: one scale per output channel, and per input row either
      the static scale or (``dynamic``) the token's own max |x| at run time;
      bf16 out (the CUTLASS kernels torch picks for row-wise scales).

    With static input scales, an input that is already e4m3 is taken to be in
    this layer's input scale (engine/cuda/forward.py's LayerNorm and GELU kernels
    write it so) and is multiplied as it is; any other input is quantized
    first by berth's kernel (engine/cuda/kernels/e4m3.py). With per-token
    scales every input is quantized per token.
    """

    weight8: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor
    input_inv_scale: torch.Tensor
    bias: torch.Tensor

    def __init__(
        self,
        linear: nn.Linear,
        input_amax: float,
        rowwise: bool = False,
        out_dtype: torch.dtype = torch.float16,
        dynamic: bool = False,
        gram: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if dynamic and not rowwise:
            raise ValueError("per-token input scales need row-wise scaled products")
        self.dynamic = dynamic
        if not fp8_supported(linear):
            raise ValueError(
                f"FP8 needs in/out features that are multiples of 16, got "
                f"{linear.in_features}x{linear.out_features}"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.rowwise = rowwise
        self.out_dtype = out_dtype
        device = linear.weight.device
        w8, w_scale = fp8_weight(linear.weight, rowwise)
        self.rounding = "nearest"
        if gram is not None:  # the same scale, codes rounded for the product
            from engine.build.quantize import gptq_e4m3  # build-time rounding

            w8, self.rounding = gptq_e4m3(linear.weight, gram, w_scale), "gptq"
        x_scale = fp8_input_scale(input_amax)
        self.input_amax = float(input_amax)
        f32 = torch.float32
        # w8 is row-major [out, in]; w8.t() is the column-major [in, out]
        # that _scaled_mm wants as its second operand.
        self.register_buffer("weight8", w8)
        shape = (1, -1) if rowwise else ()
        self.register_buffer("weight_scale", w_scale.reshape(shape).to(device, f32))
        self.register_buffer("input_scale", torch.full((), x_scale, device=device))
        inv = torch.full((), 1.0 / x_scale, device=device)
        self.register_buffer("input_inv_scale", inv)
        zeros = torch.zeros(self.out_features, device=device)
        bias = zeros if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias.to(out_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.dynamic:
            xq, scale_a = _quantize_rows(x2)
        else:
            xq = (
                x2
                if x2.dtype == FP8
                else kernels.quantize_e4m3(x2, self.input_inv_scale)
            )
            scale_a = self.input_scale
            if self.rowwise:
                scale_a = scale_a.expand(x2.shape[0], 1).contiguous()
        # out[i, j] = (sum_k xq[i, k] w8[j, k]) * x_scale[i] * w_scale[j] + b[j]
        out = torch._scaled_mm(
            xq,
            self.weight8.t(),
            scale_a=scale_a,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=self.out_dtype,
            use_fast_accum=True,
        )
        return out.reshape(*lead, self.out_features)

    @property
    def static_tensorwise(self) -> bool:
        """Whether a producer may hand this layer e4m3 input in its scale."""
        return not self.rowwise and not self.dynamic

    def extra_repr(self) -> str:
        mode = "rowwise" if self.rowwise else "tensorwise"
        inputs = "per token" if self.dynamic else f"input_amax={self.input_amax:.4g}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{mode}, {inputs}, rounding={self.rounding}, "
            f"out={str(self.out_dtype).removeprefix('torch.')}"
        )


def rowwise_scaled_mm_works(device: torch.device | str) -> bool:
    """Whether this torch/device runs row-wise scaled FP8 products (bf16 out)."""
    device = torch.device(device)
    a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
    try:
        out = torch._scaled_mm(
            a,
            b.t(),
            scale_a=torch.ones(16, 1, device=device),
            scale_b=torch.ones(1, 16, device=device),
            bias=torch.zeros(16, device=device, dtype=torch.bfloat16),
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
    except (RuntimeError, NotImplementedError) as exc:
        log.info("fp8: row-wise scaled_mm unavailable on %s (%s)", device, exc)
        return False
    return bool(out.float().sub(32.0).abs().max().item() == 0.0)


def compile_layers(model: nn.Module) -> None:
    """torch.compile each encoder layer in place (regional compilation).

    The layers share one compiled graph (fusing what Inductor can around the
    products: the per-token quantization of row-wise layers; static scales
    quantize in berth's own kernel, which it does not fuse). Compilation happens at
    the first call of each shape: warm every (batch, length) shape up before
    capturing CUDA graphs.
    """
    encoder = getattr(model, "encoder", model)
    for layer in encoder.get_submodule("layers").children():
        layer.compile(dynamic=False)
