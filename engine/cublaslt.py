"""FP8 products with more in their epilogue than torch asks for (cuBLASLt).

The fused forward's FP8 layer (engine/fused.py) feeds FFN-out with FFN-in's
activations in e4m3. ``torch._scaled_mm`` takes no epilogue but a bias, so
with it FFN-in writes fp16 and a separate pass (engine/kernels.quantize_e4m3)
applies GELU and writes e4m3: on the H200 at 16,384 tokens, 73 us of product
and 39 us of pass a layer, and a fused Triton FP8 product was no faster than
the two (112.8 us at best of 16 configurations, probe of session 12). cuBLASLt
itself takes bias + GELU (or ReLU) and an e4m3 output with its scale in the
epilogue; torch does not expose that call, so :class:`Fp8EpilogueGemm` makes
it through ctypes, against the libcublasLt that torch has already loaded. It
also makes the plain product (bias, fp16 out) with an algorithm timed on its
shape, where torch takes the heuristic's first.

    D [M, N] = e4m3(act(x8 [M, K] @ w8 [N, K]^T * scale_w * scale_x + bias) / scale_out)
    D [M, N] = x8 [M, K] @ w8 [N, K]^T * scale_w * scale_x + bias  (fp16)

Every scale is a device scalar read when the product runs (a CUDA graph
replays with the current ones). A plan (matrix layouts, and the fastest of
the algorithms cuBLASLt's heuristic proposes, timed) is made per token count
at its first call;
cublasLtMatmul itself only enqueues work on torch's current stream, so it is
captured into CUDA graphs like any kernel. Where any of it is missing (no
CUDA, no libcublasLt, no algorithm at load), :func:`fp8_epilogue_gemm`
returns None and the caller keeps torch's product (and, for FFN-in, the
separate pass); so does a token count that has no algorithm
(:meth:`Fp8EpilogueGemm.runs`). The engine takes FFN-in's epilogue unless
``BERTH_FP8_EPILOGUE=0`` and the timed plain products unless
``BERTH_FP8_TUNED=0`` (engine/fused.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

log = logging.getLogger("berth.engine")

# cublasLt.h (CUDA 12 and 13).
CUDA_R_32F, CUDA_R_16F, CUDA_R_8F_E4M3 = 0, 2, 28
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_D_SCALE_POINTER = 17, 18, 20
DESC_FAST_ACCUM, DESC_BIAS_DATA_TYPE = 25, 26
PREF_MAX_WORKSPACE_BYTES = 1
EPILOGUE_BIAS, EPILOGUE_RELU_BIAS, EPILOGUE_GELU_BIAS = 4, 6, 36  # GELU: tanh form
# What cuBLASLt may use as scratch (NVIDIA's advice for Hopper).
WORKSPACE_BYTES = 32 << 20
# Algorithms cuBLASLt's heuristic is asked for; each is timed on the product's
# shape once per process (:meth:`Fp8EpilogueGemm.plan`) and the fastest kept.
CANDIDATES = 8
TIMED_RUNS = 10
# fp8_epilogue_gemm's activations, by name (None: the bias alone).
EPILOGUES = {
    None: EPILOGUE_BIAS,
    "gelu_tanh": EPILOGUE_GELU_BIAS,
    "relu": EPILOGUE_RELU_BIAS,
}


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    pass


class Plan(NamedTuple):
    """A product's layouts for one token count, and cuBLASLt's algorithm."""

    x: ctypes.c_void_p
    c: ctypes.c_void_p
    d: ctypes.c_void_p
    found: _Heuristic


_P, _INT, _SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES: dict[str, list[type]] = {
    "cublasLtCreate": [_P],
    "cublasLtMatmulDescCreate": [_P, _INT, _INT],
    "cublasLtMatmulDescSetAttribute": [_P, _INT, _P, _SIZE],
    "cublasLtMatrixLayoutCreate": [
        _P,
        _INT,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int64,
    ],
    "cublasLtMatmulPreferenceCreate": [_P],
    "cublasLtMatmulPreferenceSetAttribute": [_P, _INT, _P, _SIZE],
    "cublasLtMatmulPreferenceDestroy": [_P],
    "cublasLtMatmulDescDestroy": [_P],
    "cublasLtMatrixLayoutDestroy": [_P],
    # handle, op, A, B, C, D layouts, preference, count, results, found
    "cublasLtMatmulAlgoGetHeuristic": [_P] * 7 + [_INT, _P, _P],
    # handle, op, alpha, A, A layout, B, B layout, beta, C, C layout, D,
    # D layout, algorithm, workspace, its size, stream
    "cublasLtMatmul": [_P] * 14 + [_SIZE, _P],
}


class _Library:
    """libcublasLt's calls, each checked; one handle and workspace per device.

    One workspace serves every product on the device, so two of them must
    not run at once on two streams: berth's engine runs one stream per GPU
    (engine/cuda_backend.py), and a graph bakes the workspace's address in."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self.handles: dict[int, tuple[ctypes.c_void_p, torch.Tensor]] = {}

    def call(self, name: str, *args: object) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise CublasLtError(f"{name} returned cublasStatus {status}")

    def handle(self, device: torch.device) -> tuple[ctypes.c_void_p, torch.Tensor]:
        index = (
            device.index if device.index is not None else torch.cuda.current_device()
        )
        if index not in self.handles:
            handle = ctypes.c_void_p()
            with torch.cuda.device(index):
                self.call("cublasLtCreate", ctypes.byref(handle))
            space = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self.handles[index] = (handle, space)
        return self.handles[index]


_library: _Library | None = None
_library_error: str | None = None


def _load(device: torch.device) -> _Library:
    """The libcublasLt torch uses (loaded by a first product if need be)."""
    global _library, _library_error
    if _library is not None:
        return _library
    if _library_error is not None:
        raise CublasLtError(_library_error)
    try:
        a = torch.ones(16, 16, device=device, dtype=torch.float16)
        torch.mm(a, a)  # torch loads cuBLAS and cuBLASLt on its first product
        maps = Path("/proc/self/maps").read_text().splitlines()
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
        if not paths:
            raise CublasLtError("no libcublasLt in this process")
        _library = _Library(ctypes.CDLL(sorted(paths)[0]))
    except (OSError, AttributeError, RuntimeError) as exc:
        _library_error = f"cuBLASLt unavailable: {exc}"
        raise CublasLtError(_library_error) from exc
    return _library


def _set(
    lib: _Library, desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData[Any]
) -> None:
    lib.call(
        "cublasLtMatmulDescSetAttribute",
        desc, attr, ctypes.byref(value), ctypes.sizeof(value),
    )  # fmt: skip


class Fp8EpilogueGemm:
    """One cuBLASLt call (module docstring): ``act(x8 @ weight8^T * scale_w *
    scale_x + bias)`` as e4m3 in ``1 / out_inv_scale``, or, with no
    ``out_inv_scale``, ``x8 @ weight8^T * scale_w * scale_x + bias`` in fp16."""

    def __init__(
        self,
        weight8: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor,
        out_inv_scale: torch.Tensor | None,
        epilogue: int = EPILOGUE_GELU_BIAS,
    ) -> None:
        if weight8.dtype != torch.float8_e4m3fn or bias.dtype != torch.float16:
            raise ValueError("an e4m3 weight and an fp16 bias")
        self.device = weight8.device
        self.lib = _load(self.device)
        self.handle, self.workspace = self.lib.handle(self.device)
        self.n, self.k = weight8.shape
        # Kept alive here: cuBLASLt holds their addresses.
        self.tensors = (weight8, weight_scale, input_scale, bias, out_inv_scale)
        self.weight8 = weight8
        self.epilogue = epilogue
        self.out_dtype = torch.float16 if out_inv_scale is None else torch.float8_e4m3fn
        self.d_type = CUDA_R_16F if out_inv_scale is None else CUDA_R_8F_E4M3
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.plans: dict[int, Plan] = {}
        self.a_layout: ctypes.c_void_p | None = None
        self.desc: ctypes.c_void_p | None = None
        lib, desc = self.lib, ctypes.c_void_p()
        lib.call(
            "cublasLtMatmulDescCreate",
            ctypes.byref(desc),
            CUBLAS_COMPUTE_32F,
            CUDA_R_32F,
        )
        self.desc = desc  # from here on close() destroys it
        # Column-major, as cuBLAS sees row-major tensors: D^T [N, M] = W [N, K]
        # . X^T [K, M], i.e. A = the weight, transposed (FP8 wants "TN").
        _set(lib, desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        _set(lib, desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        _set(lib, desc, DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        _set(lib, desc, DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        _set(lib, desc, DESC_BIAS_DATA_TYPE, ctypes.c_int32(CUDA_R_16F))
        _set(lib, desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(weight_scale.data_ptr()))
        _set(lib, desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(input_scale.data_ptr()))
        if out_inv_scale is not None:
            out_scale = ctypes.c_void_p(out_inv_scale.data_ptr())
            _set(lib, desc, DESC_D_SCALE_POINTER, out_scale)
        _set(lib, desc, DESC_FAST_ACCUM, ctypes.c_int8(1))
        self.a_layout = self._layout(CUDA_R_8F_E4M3, self.k, self.n, self.k)
        self.refused: set[int] = set()  # token counts with no algorithm
        self.plan(16)  # fails here, at load, where cuBLASLt has no algorithm

    def close(self) -> None:
        """Destroy the descriptor and every layout this product made (once;
        also when it is collected, or when its constructor fails). Graphs
        captured with it keep working: cuBLASLt reads descriptors only while
        it enqueues a product."""
        layouts = [self.a_layout]
        for plan in self.plans.values():
            layouts += [plan.x, plan.c, plan.d]
        self.plans, self.a_layout = {}, None
        desc, self.desc = self.desc, None
        for layout in layouts:
            if layout is not None:
                self.lib.call("cublasLtMatrixLayoutDestroy", layout)
        if desc is not None:
            self.lib.call("cublasLtMatmulDescDestroy", desc)

    def __del__(self) -> None:
        if hasattr(self, "desc"):  # past the checks at the constructor's top
            with contextlib.suppress(CublasLtError, AttributeError):
                self.close()

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self.lib.call(
            "cublasLtMatrixLayoutCreate", ctypes.byref(layout), dtype, rows, cols, ld
        )
        return layout

    def plan(self, m: int) -> Plan:
        """The layouts and the algorithm for m tokens: the fastest of
        cuBLASLt's heuristic's candidates, timed on this shape (once per
        process, device and problem: products of the same shape and kind
        share it),
        or its first candidate while a graph is being captured."""
        if m in self.plans:
            return self.plans[m]
        if self.desc is None:
            raise CublasLtError("this product was closed")
        b = self._layout(CUDA_R_8F_E4M3, self.k, m, self.k)
        # No C (beta = 0, the pointer NULL), but its layout: cuBLASLt wants the
        # bias's type there when D is e4m3.
        c = self._layout(CUDA_R_16F, self.n, m, self.n)
        d = self._layout(self.d_type, self.n, m, self.n)
        try:
            found = self._algorithm(m, b, c, d)
        except BaseException:  # no plan holds them: destroyed here
            for layout in (b, c, d):
                self.lib.call("cublasLtMatrixLayoutDestroy", layout)
            raise
        self.plans[m] = Plan(b, c, d, found)
        return self.plans[m]

    def _algorithm(
        self, m: int, b: ctypes.c_void_p, c: ctypes.c_void_p, d: ctypes.c_void_p
    ) -> _Heuristic:
        """``plan``'s algorithm for m tokens on these layouts."""
        pref = ctypes.c_void_p()
        self.lib.call("cublasLtMatmulPreferenceCreate", ctypes.byref(pref))
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        self.lib.call(
            "cublasLtMatmulPreferenceSetAttribute",
            pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.sizeof(size),
        )  # fmt: skip
        results, count = (_Heuristic * CANDIDATES)(), ctypes.c_int(0)
        try:
            self.lib.call(
                "cublasLtMatmulAlgoGetHeuristic",
                self.handle, self.desc, self.a_layout, b, c, d, pref, CANDIDATES,
                results, ctypes.byref(count),
            )  # fmt: skip
        finally:
            self.lib.call("cublasLtMatmulPreferenceDestroy", pref)
        candidates = [r for r in results[: count.value] if r.state == 0]
        if not candidates:
            raise CublasLtError(f"no cuBLASLt algorithm for {m}x{self.n}x{self.k}")
        index = self.device.index if self.device.index is not None else -1
        key = (index, m, self.n, self.k, self.epilogue, self.d_type)
        algos = {bytes(r.algo): r for r in candidates}
        known = _tuned.get(key)
        found = algos.get(bytes(known.algo)) if known is not None else None
        if found is None:
            with torch.cuda.device(self.device):
                if torch.cuda.is_current_stream_capturing():  # nothing can be timed
                    found = candidates[0]
                else:
                    found = _tuned[key] = self._fastest(m, candidates, b, c, d)
        return found

    def _fastest(
        self,
        m: int,
        candidates: list[_Heuristic],
        b: ctypes.c_void_p,
        c: ctypes.c_void_p,
        d: ctypes.c_void_p,
    ) -> _Heuristic:
        """The candidate that runs this product fastest, on scratch rows, on
        the product's device and stream (one that fails to run is passed
        over; none running is an error)."""
        if len(candidates) == 1:
            return candidates[0]
        x8 = torch.randn(m, self.k, device=self.device).to(torch.float8_e4m3fn)
        out = torch.empty((m, self.n), dtype=self.out_dtype, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        plan = Plan(b, c, d, candidates[0])
        best, best_ms = candidates[0], float("inf")
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for found in candidates:
            plan = plan._replace(found=found)
            try:
                for _ in range(2):  # warm-up
                    self._run(plan, x8.data_ptr(), out.data_ptr())
                start.record(stream)
                for _ in range(TIMED_RUNS):
                    self._run(plan, x8.data_ptr(), out.data_ptr())
                end.record(stream)
                end.synchronize()
            except CublasLtError:
                continue
            ms = start.elapsed_time(end) / TIMED_RUNS
            if ms < best_ms:
                best, best_ms = found, ms
        if best_ms == float("inf"):
            raise CublasLtError(
                f"none of {len(candidates)} algorithms ran {m}x{self.n}x{self.k}"
            )
        log.debug(
            "fp8: %dx%dx%d product: the fastest of %d cuBLASLt candidates, %.1f us",
            m, self.n, self.k, len(candidates), best_ms * 1000,
        )  # fmt: skip
        return best

    def _run(self, plan: Plan, x8: int, out: int) -> None:
        """One cublasLtMatmul on the current stream, at these addresses."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.lib.call(
            "cublasLtMatmul",
            self.handle, self.desc, ctypes.byref(self.alpha),
            self.weight8.data_ptr(), self.a_layout, x8, plan.x,
            ctypes.byref(self.beta), None, plan.c, out, plan.d,
            ctypes.byref(plan.found.algo), self.workspace.data_ptr(),
            WORKSPACE_BYTES, stream,
        )  # fmt: skip

    def runs(self, m: int) -> bool:
        """Whether m tokens have a plan (made now if need be: call it before a
        graph capture); one without is logged once, and the caller takes
        torch's product (and pass) instead."""
        if m in self.plans:
            return True
        if m not in self.refused:
            try:
                self.plan(m)
                return True
            except CublasLtError as exc:
                self.refused.add(m)
                log.warning(
                    "fp8: a %dx%d product at %d tokens takes torch's path: %s",
                    self.n,
                    self.k,
                    m,
                    exc,
                )
        return False

    def __call__(self, x8: torch.Tensor) -> torch.Tensor:
        """x8 [M, K] e4m3 (contiguous) -> [M, N] e4m3 or fp16, on the current
        stream."""
        if x8.dtype != torch.float8_e4m3fn or x8.shape[1:] != (self.k,):
            raise ValueError(
                f"e4m3 input [M, {self.k}] expected, got {x8.dtype} {tuple(x8.shape)}"
            )
        # cuBLASLt's heuristic assumes 256-byte aligned matrices (its default
        # alignment preferences); the fused forward's are fresh allocations.
        if not x8.is_contiguous() or x8.data_ptr() % 256:
            raise ValueError("the input must be contiguous and 256-byte aligned")
        m = x8.shape[0]
        out = torch.empty((m, self.n), dtype=self.out_dtype, device=self.device)
        self._run(self.plan(m), x8.data_ptr(), out.data_ptr())
        return out


def fp8_epilogue_gemm(
    linear: torch.nn.Module,
    out_inv_scale: torch.Tensor | None = None,
    act: str | None = None,
) -> Fp8EpilogueGemm | None:
    """The cuBLASLt product of an FP8 linear (engine/quant.Fp8Linear,
    tensor-wise): followed by ``act`` ("gelu_tanh" or "relu") and written as
    e4m3 in ``1 / out_inv_scale``, or (no ``act``, no scale) plain, in fp16;
    None (and why, logged once per reason) where it cannot run here."""
    epilogue = EPILOGUES.get(act)
    weight8 = getattr(linear, "weight8", None)
    tensorwise = getattr(linear, "static_tensorwise", False)  # one scale each
    if epilogue is None or weight8 is None or not tensorwise or not weight8.is_cuda:
        return None
    try:
        return Fp8EpilogueGemm(
            weight8,
            linear.weight_scale,  # type: ignore[arg-type]
            linear.input_scale,  # type: ignore[arg-type]
            linear.bias,  # type: ignore[arg-type]
            out_inv_scale,
            epilogue,
        )
    except (CublasLtError, ValueError) as exc:
        if str(exc) not in _logged:
            _logged.add(str(exc))
            log.warning("fp8: a product keeps torch's path: %s", exc)
        return None


_logged: set[str] = set()
# The timed choice per (device, tokens, N, K, epilogue, output type).
_tuned: dict[tuple[int, int, int, int, int, int], _Heuristic] = {}
