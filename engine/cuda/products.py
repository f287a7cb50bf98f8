"""cuBLASLt products that torch does not make: FP8 with more in the
epilogue, and fp16/bf16 with an algorithm timed on the shape.

The fused forward's FP8 layer (engine/cuda/forward.py) feeds FFN-out with FFN-in's
activations in e4m3. ``torch._scaled_mm`` takes no epilogue but a bias, so
with it FFN-in writes fp16 and a separate pass (engine/cuda/kernels/e4m3.py)
applies GELU and writes e4m3: on the H200 at 16,384 tokens, 73 us of product
and 39 us of pass a layer, and a fused Triton FP8 product was no faster than
the two (112.8 us at best of 16 configurations, probe). cuBLASLt
itself takes bias + GELU (or ReLU) and an e4m3 output with its scale in the
epilogue; torch does not expose that call, so :class:`Fp8EpilogueGemm` makes
it through ctypes, against the libcublasLt that torch has already loaded. It
also makes the plain product (bias, fp16 out) with an algorithm timed on its
shape, where torch takes the heuristic's first.

    D [M, N] = e4m3(act(x8 [M, K] @ w8 [N, K]^T * scale_w * scale_x + bias) / scale_out)
    D [M, N] = x8 [M, K] @ w8 [N, K]^T * scale_w * scale_x + bias  (fp16)

:class:`HalfGemm` makes the fp16/bf16 layer's products the same way:

    D [M, N] = act(x [M, K] @ w [N, K]^T + bias)
    R [M, N] += x [M, K] @ w [N, K]^T  (in place: beta 1)

torch takes the heuristic's first algorithm with a workspace; on the H200
every such candidate asks for 4 bytes of it, which cuBLASLt zeroes before
the kernel, a memset node in a graph (48 of a BERT-base forward's 146
nodes at 16,384 tokens). The algorithms are timed among the candidates with
the workspace and without one (docs/performance.md, ``HalfGemm``).

Every scale is a device scalar read when the product runs (a CUDA graph
replays with the current ones). A plan (matrix layouts, and the fastest of
the algorithms cuBLASLt's heuristic proposes, timed) is made per token count
at its first call;
cublasLtMatmul itself only enqueues work on torch's current stream, so it is
captured into CUDA graphs like any kernel. Where any of it is missing (no
CUDA, no libcublasLt, no algorithm at load), :func:`fp8_epilogue_gemm` and
:func:`half_gemm` return None and the caller keeps torch's product (and, for
FFN-in, the separate pass); so does a token count that has no algorithm
(``runs``). The engine takes all of them unless ``BERTH_CUBLASLT=0``
(engine/settings.py, engine/cuda/forward.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any

import torch

from engine.cuda.cublaslt import (
    CANDIDATES,
    COLD_BYTES,
    CUBLAS_COMPUTE_32F,
    CUDA_R_8F_E4M3,
    CUDA_R_16F,
    CUDA_R_32F,
    DESC_A_SCALE_POINTER,
    DESC_B_SCALE_POINTER,
    DESC_BIAS_DATA_TYPE,
    DESC_BIAS_POINTER,
    DESC_D_SCALE_POINTER,
    DESC_EPILOGUE,
    DESC_FAST_ACCUM,
    DESC_TRANSA,
    DESC_TRANSB,
    EPILOGUE_BIAS,
    EPILOGUE_DEFAULT,
    EPILOGUE_GELU_BIAS,
    EPILOGUES,
    HALF_TYPES,
    OP_N,
    OP_T,
    PREF_MAX_WORKSPACE_BYTES,
    TIMED_RUNS,
    WORKSPACE_BYTES,
    CublasLtError,
    Heuristic,
    Plan,
    aligned,
    load_library,
    set_attribute,
)

log = logging.getLogger("berth.engine")


class _Product:
    """One cuBLASLt product of a fixed weight [N, K] (nn.Linear's layout):
    its descriptor, and per token count its layouts and the fastest of the
    algorithms cuBLASLt's heuristic proposes, timed (``plan``). Subclasses
    set the types and the epilogue, then call ``plan(16)``, which fails at
    load where cuBLASLt has no algorithm."""

    label = "cuBLASLt"  # what logs call the product
    # The workspace sizes the heuristic is asked for candidates with, and
    # whether the timing reads the weight cold (COLD_BYTES of copies).
    spaces: tuple[int, ...] = (WORKSPACE_BYTES,)
    cold = False

    def __init__(
        self,
        weight: torch.Tensor,
        types: tuple[int, int, int, int],
        out_dtype: torch.dtype,
        epilogue: int,
        beta: float = 0.0,
    ) -> None:
        self.device = weight.device
        self.lib = load_library(self.device)
        self.handle, self.workspace = self.lib.handle(self.device)
        self.n, self.k = weight.shape
        self.weight = weight
        # The types of A (the weight), B (x), C and D.
        a_type, self.x_type, self.c_type, self.d_type = types
        self.out_dtype = out_dtype
        self.epilogue = epilogue
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(beta)
        self.plans: dict[int, Plan] = {}
        self.refused: set[int] = set()  # token counts with no algorithm
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
        set_attribute(lib, desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        set_attribute(lib, desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        set_attribute(lib, desc, DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        self.a_layout = self._layout(a_type, self.k, self.n, self.k)

    def _describe(self, attr: int, value: ctypes._SimpleCData[Any]) -> None:
        """Set one attribute of the product's descriptor."""
        if self.desc is None:
            raise CublasLtError("this product was closed")
        set_attribute(self.lib, self.desc, attr, value)

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
        b = self._layout(self.x_type, self.k, m, self.k)
        # With beta = 0 no C is read (the pointer NULL), but its layout is
        # given: cuBLASLt wants the bias's type there when D is e4m3.
        c = self._layout(self.c_type, self.n, m, self.n)
        d = self._layout(self.d_type, self.n, m, self.n)
        try:
            found = self._algorithm(m, b, c, d)
        except BaseException:  # no plan holds them: destroyed here
            for layout in (b, c, d):
                self.lib.call("cublasLtMatrixLayoutDestroy", layout)
            raise
        self.plans[m] = Plan(b, c, d, found)
        return self.plans[m]

    def _candidates(
        self, b: ctypes.c_void_p, c: ctypes.c_void_p, d: ctypes.c_void_p, space: int
    ) -> list[Heuristic]:
        """cuBLASLt's heuristic's algorithms for these layouts that need at
        most ``space`` bytes of workspace."""
        pref = ctypes.c_void_p()
        self.lib.call("cublasLtMatmulPreferenceCreate", ctypes.byref(pref))
        size = ctypes.c_uint64(space)
        results, count = (Heuristic * CANDIDATES)(), ctypes.c_int(0)
        try:
            self.lib.call(
                "cublasLtMatmulPreferenceSetAttribute",
                pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.sizeof(size),
            )  # fmt: skip
            self.lib.call(
                "cublasLtMatmulAlgoGetHeuristic",
                self.handle, self.desc, self.a_layout, b, c, d, pref, CANDIDATES,
                results, ctypes.byref(count),
            )  # fmt: skip
        finally:
            self.lib.call("cublasLtMatmulPreferenceDestroy", pref)
        return [r for r in results[: count.value] if r.state == 0]

    def _algorithm(
        self, m: int, b: ctypes.c_void_p, c: ctypes.c_void_p, d: ctypes.c_void_p
    ) -> Heuristic:
        """``plan``'s algorithm for m tokens on these layouts, among the
        heuristic's candidates for each workspace size in ``spaces`` (one
        that uses the workspace is a memset node and a kernel in a graph:
        cuBLASLt zeroes its first bytes; one without is the kernel alone)."""
        index = self.device.index if self.device.index is not None else -1
        key: tuple[int | float, ...] = (index, m, self.n, self.k, self.epilogue)
        key += (self.x_type, self.d_type, self.beta.value)
        if key in _tuned:  # the same problem: the same candidates (every layer)
            return _tuned[key]
        candidates: dict[bytes, Heuristic] = {}
        for space in self.spaces:
            for found in self._candidates(b, c, d, space):
                candidates.setdefault(bytes(found.algo), found)
        if not candidates:
            raise CublasLtError(f"no cuBLASLt algorithm for {m}x{self.n}x{self.k}")
        listed = list(candidates.values())
        with torch.cuda.device(self.device):
            if torch.cuda.is_current_stream_capturing():  # nothing can be timed
                return listed[0]
            _tuned[key] = self._fastest(m, listed, b, c, d)
        return _tuned[key]

    def _scratch(self, m: int) -> torch.Tensor:
        """Rows of this product's input to time its candidates on."""
        raise NotImplementedError

    def _fastest(
        self,
        m: int,
        candidates: list[Heuristic],
        b: ctypes.c_void_p,
        c: ctypes.c_void_p,
        d: ctypes.c_void_p,
    ) -> Heuristic:
        """The candidate that runs this product fastest, on scratch rows, on
        the product's device and stream (one that fails to run is passed
        over; none running is an error). With ``cold``, each run reads
        another copy of the weight, more of them than L2 holds (COLD_BYTES),
        as a forward's products read theirs from memory."""
        if len(candidates) == 1:
            return candidates[0]
        x = self._scratch(m)
        out = torch.zeros((m, self.n), dtype=self.out_dtype, device=self.device)
        weights = [self.weight.data_ptr()]
        if self.cold:
            count = max(2, COLD_BYTES // (self.weight.numel() * self.weight.itemsize))
            copies = self.weight.expand(count, *self.weight.shape).contiguous()
            weights = [int(copy.data_ptr()) for copy in copies]
        stream = torch.cuda.current_stream(self.device)
        plan = Plan(b, c, d, candidates[0])
        best, best_ms = candidates[0], float("inf")
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        turn = 0  # the copies in turn, across candidates: none read twice in L2
        for found in candidates:
            plan = plan._replace(found=found)
            try:
                for _ in range(2):  # warm-up
                    self._run(plan, x.data_ptr(), out.data_ptr())
                start.record(stream)
                for _ in range(TIMED_RUNS):
                    weight = weights[turn % len(weights)]
                    turn += 1
                    self._run(plan, x.data_ptr(), out.data_ptr(), weight)
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
            "%s: %dx%dx%d product: the fastest of %d cuBLASLt candidates, %.1f us"
            " (%s workspace)",
            self.label, m, self.n, self.k, len(candidates), best_ms * 1000,
            "with" if best.workspace_size else "no",
        )  # fmt: skip
        return best

    def _run(self, plan: Plan, x: int, out: int, weight: int | None = None) -> None:
        """One cublasLtMatmul on the current stream, at these addresses (out
        is C too where beta is 1; the product's weight unless another is
        given); the workspace only for an algorithm that uses it."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        found = plan.found
        space = WORKSPACE_BYTES if found.workspace_size else 0
        self.lib.call(
            "cublasLtMatmul",
            self.handle, self.desc, ctypes.byref(self.alpha),
            weight or self.weight.data_ptr(), self.a_layout, x, plan.x,
            ctypes.byref(self.beta), out if self.beta.value else None, plan.c,
            out, plan.d, ctypes.byref(found.algo),
            self.workspace.data_ptr() if space else None, space, stream,
        )  # fmt: skip

    def runs(self, m: int) -> bool:
        """Whether m tokens have a plan (made now if need be: call it before a
        graph capture); one without is logged once, and the caller takes
        torch's product instead."""
        if m in self.plans:
            return True
        if m not in self.refused:
            try:
                self.plan(m)
                return True
            except CublasLtError as exc:
                self.refused.add(m)
                log.warning(
                    "%s: a %dx%d product at %d tokens takes torch's path: %s",
                    self.label, self.n, self.k, m, exc,
                )  # fmt: skip
        return False

    def _checked(self, x: torch.Tensor, dtype: torch.dtype) -> int:
        """x's rows, once x is [M, K] of ``dtype``, contiguous and 256-byte
        aligned (what cuBLASLt's heuristic assumes by default; the fused
        forward's are fresh allocations)."""
        if x.dtype != dtype or x.shape[1:] != (self.k,):
            raise ValueError(
                f"{dtype} input [M, {self.k}] expected, got {x.dtype} {tuple(x.shape)}"
            )
        if not aligned(x):
            raise ValueError("the input must be contiguous and 256-byte aligned")
        return x.shape[0]


class Fp8EpilogueGemm(_Product):
    """One cuBLASLt call (module docstring): ``act(x8 @ weight8^T * scale_w *
    scale_x + bias)`` as e4m3 in ``1 / out_inv_scale``, or, with no
    ``out_inv_scale``, ``x8 @ weight8^T * scale_w * scale_x + bias`` in fp16."""

    label = "fp8"

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
        # Kept alive here: cuBLASLt holds their addresses.
        self.tensors = (weight8, weight_scale, input_scale, bias, out_inv_scale)
        self.weight8 = weight8
        d_type = CUDA_R_16F if out_inv_scale is None else CUDA_R_8F_E4M3
        out_dtype = torch.float16 if out_inv_scale is None else torch.float8_e4m3fn
        types = (CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16F, d_type)
        super().__init__(weight8, types, out_dtype, epilogue)
        describe = self._describe
        describe(DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        describe(DESC_BIAS_DATA_TYPE, ctypes.c_int32(CUDA_R_16F))
        describe(DESC_A_SCALE_POINTER, ctypes.c_void_p(weight_scale.data_ptr()))
        describe(DESC_B_SCALE_POINTER, ctypes.c_void_p(input_scale.data_ptr()))
        if out_inv_scale is not None:
            describe(DESC_D_SCALE_POINTER, ctypes.c_void_p(out_inv_scale.data_ptr()))
        describe(DESC_FAST_ACCUM, ctypes.c_int8(1))
        self.plan(16)  # fails here, at load, where cuBLASLt has no algorithm

    def _scratch(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.k, device=self.device).to(torch.float8_e4m3fn)

    def __call__(self, x8: torch.Tensor) -> torch.Tensor:
        """x8 [M, K] e4m3 (contiguous) -> [M, N] e4m3 or fp16, on the current
        stream."""
        m = self._checked(x8, torch.float8_e4m3fn)
        out = torch.empty((m, self.n), dtype=self.out_dtype, device=self.device)
        self._run(self.plan(m), x8.data_ptr(), out.data_ptr())
        return out


class HalfGemm(_Product):
    """An fp16 or bf16 projection as one cuBLASLt call with a timed
    algorithm: ``act(x @ weight^T + bias)`` (``__call__``), or, made with
    ``accumulate``, ``residual += x @ weight^T`` in place (``add_to``: beta 1,
    no bias). torch's products take the heuristic's first algorithm with a
    workspace, a memset node before each kernel in a graph."""

    # Timed on one hot weight copy and among candidates with the workspace
    # only, BERT-base 8 x 128's products took algorithms that made its forward
    # 12 % slower on the H200; with both changed, still 5 % (so the engine
    # takes these products from HALF_TUNED_MIN_TOKENS tokens on,
    # engine/cuda/layer_products.py). With the same two changes the FP8 engine
    # ran 0.6 and 2.3 % slower than with torch's products in two runs, and
    # 0.5 % faster with the base's timing: the FP8 products keep the base's.
    spaces = (WORKSPACE_BYTES, 0)
    cold = True

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        epilogue: int = EPILOGUE_BIAS,
        accumulate: bool = False,
    ) -> None:
        kind = HALF_TYPES.get(weight.dtype)
        if kind is None or (bias is not None and bias.dtype != weight.dtype):
            raise ValueError("an fp16 or bf16 weight, and a bias of its type")
        if accumulate and (bias is not None or epilogue != EPILOGUE_DEFAULT):
            raise ValueError("a product added to the residual takes no epilogue")
        if not accumulate and bias is None:
            raise ValueError("a product without the residual takes its bias")
        self.tensors = (weight, bias)  # kept alive: cuBLASLt holds addresses
        types = (kind, kind, kind, kind)
        super().__init__(weight, types, weight.dtype, epilogue, float(accumulate))
        if bias is not None:
            self._describe(DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
            self._describe(DESC_BIAS_DATA_TYPE, ctypes.c_int32(kind))
        self.plan(16)

    def _scratch(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.k, device=self.device, dtype=self.out_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> act(x W^T + b) [M, N], on the current stream."""
        if self.beta.value:
            raise ValueError("this product adds to a residual: add_to")
        m = self._checked(x, self.out_dtype)
        out = torch.empty((m, self.n), dtype=self.out_dtype, device=self.device)
        self._run(self.plan(m), x.data_ptr(), out.data_ptr())
        return out

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual [M, N] += x [M, K] W^T, in place, on the current stream."""
        if not self.beta.value:
            raise ValueError("this product takes no residual: call it")
        m = self._checked(x, self.out_dtype)
        if residual.shape != (m, self.n) or residual.dtype != self.out_dtype:
            raise ValueError(f"a residual [{m}, {self.n}] of {self.out_dtype}")
        if not aligned(residual):
            raise ValueError("the residual must be contiguous and 256-byte aligned")
        self._run(self.plan(m), x.data_ptr(), residual.data_ptr())
        return residual


def half_gemm(
    linear: torch.nn.Module, epilogue: int = EPILOGUE_BIAS, accumulate: bool = False
) -> HalfGemm | None:
    """The timed cuBLASLt product of an fp16/bf16 nn.Linear on a GPU
    (``HalfGemm``), or None (and why, logged once per reason) where it
    cannot run here."""
    if not isinstance(linear, torch.nn.Linear) or not linear.weight.is_cuda:
        return None
    weight = linear.weight
    if weight.dtype not in HALF_TYPES:  # float32 on a GPU: torch's products
        return None
    try:
        bias = None if accumulate else linear.bias
        return HalfGemm(weight, bias, epilogue, accumulate)
    except (CublasLtError, ValueError) as exc:
        if str(exc) not in _logged:
            _logged.add(str(exc))
            log.warning("a product keeps torch's path: %s", exc)
        return None


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
# The timed choice per (device, tokens, N, K, epilogue, input and output
# types, beta).
_tuned: dict[tuple[int | float, ...], Heuristic] = {}
