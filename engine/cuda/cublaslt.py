"""cuBLASLt through ctypes, against the libcublasLt torch has loaded: its
constants, descriptors, handles and the heuristic's algorithms.

torch does not expose cublasLtMatmul with an FP8 epilogue or a chosen
algorithm; engine/cuda/products.py builds those products on what this module
binds. Where the library cannot be loaded, :func:`load_library` raises
:class:`CublasLtError` and the products fall back to torch's.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

log = logging.getLogger("berth.engine")

# cublasLt.h (CUDA 12 and 13).
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 2, 14, 28
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_D_SCALE_POINTER = 17, 18, 20
DESC_FAST_ACCUM, DESC_BIAS_DATA_TYPE = 25, 26
PREF_MAX_WORKSPACE_BYTES = 1
EPILOGUE_DEFAULT, EPILOGUE_BIAS, EPILOGUE_RELU_BIAS = 1, 4, 6
EPILOGUE_GELU_BIAS = 36  # GELU: tanh form
# What cuBLASLt may use as scratch (NVIDIA's advice for Hopper).
WORKSPACE_BYTES = 32 << 20
# Algorithms cuBLASLt's heuristic is asked for; each is timed on the product's
# shape once per process (:meth:`Fp8EpilogueGemm.plan`) and the fastest kept.
CANDIDATES = 8
TIMED_RUNS = 10
# Bytes of weight copies a timing cycles through: more than the H200's 50 MB
# of L2, so each run reads its weights from memory (``_Product._fastest``).
COLD_BYTES = 64 << 20
# HalfGemm's types, by the weight's dtype.
HALF_TYPES = {torch.float16: CUDA_R_16F, torch.bfloat16: CUDA_R_16BF}
# fp8_epilogue_gemm's activations, by name (None: the bias alone).
EPILOGUES = {
    None: EPILOGUE_BIAS,
    "gelu_tanh": EPILOGUE_GELU_BIAS,
    "relu": EPILOGUE_RELU_BIAS,
}


class Heuristic(ctypes.Structure):
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
    found: Heuristic


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
    (engine/cuda/backend.py), and a graph bakes the workspace's address in."""

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


def load_library(device: torch.device) -> _Library:
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


def aligned(x: torch.Tensor) -> bool:
    """Whether cuBLASLt's heuristic may take x as it assumes matrices by
    default: contiguous, 256-byte aligned (fresh allocations are)."""
    return x.is_contiguous() and x.data_ptr() % 256 == 0


def set_attribute(
    lib: _Library, desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData[Any]
) -> None:
    lib.call(
        "cublasLtMatmulDescSetAttribute",
        desc, attr, ctypes.byref(value), ctypes.sizeof(value),
    )  # fmt: skip
