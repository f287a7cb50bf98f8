"""Engine speed on a GPU: berth's CUDA backend against transformers eager.

BERT-base (12 layers, hidden 768) and MiniLM (6 layers, hidden 384) get
random weights, written once as a Hugging Face checkpoint that both sides
load. For every (batch, length) of BATCHES x LENGTHS, in one process:

- ours_ms: one batch through ``CudaBackend.run_bytes``, wire bytes in to
  float32 rows in pinned memory out, host work included: the median of
  CUDA-event timings on the engine's stream. Measured with both input modes
  (``staging``, ``zero-copy``), each twice in the order A B B A, the two
  averaged (in a fixed order the card's drift showed as a mode's lead);
  ``ours_ms`` is the default mode's;
- graph_ms: the graph replay alone (the backend's own compute events);
- hf_eager_ms: ``transformers`` BertModel in fp16 with
  ``attn_implementation="sdpa"``, eager, plus mean pooling, on the same
  inputs (what most users run): median of CUDA-event timings;
- pipe_seq_s: sequences/s with double buffering (batch n+1 submitted before
  batch n is collected);
- padded_ms: shapes the engine runs packed (B*L >= 4096 tokens: no padding
  token computed), timed again on a backend that keeps them padded;
- TFLOP/s: the graph's (padded tokens' matmul and attention FLOPs), against
  the fp16 matmul ceiling measured first.

Rows have lengths drawn from (L/2, L], the first row full; BERT-base at
128 x 128 is timed once more with every row full (packing saves nothing
there). Then single kernels are probed and the fused forward's kernels
profiled.

    python benchmarks/engine.py --out engine_h200.json [--models minilm] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.random_models import (  # noqa: E402
    MODELS,
    VOCAB,
    write_random_checkpoint,
)
from engine import settings as engine_settings  # noqa: E402
from engine.cuda.backend import (  # noqa: E402
    DEFAULT_INPUT,
    INPUT_MODES,
    CudaBackend,
    collect,
)
from engine.cuda.graphs import token_ladder  # noqa: E402
from engine.cuda.kernels import add_layer_norm, attention  # noqa: E402
from services.repository import ModelEntry  # noqa: E402

BATCHES = (1, 8, 32, 64, 128, 256)
LENGTHS = (16, 32, 64, 128, 256, 512)


def event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def time_calls(
    fn: Callable[[], object], stream: torch.cuda.Stream, budget_s: float = 0.25
) -> list[float]:
    """Milliseconds per call (events around each, then a sync), after warm-up."""
    fn()
    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < 200 and (
        len(times) < 7 or time.perf_counter() - began < budget_s
    ):
        start, end = event(), event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_loop(fn: Callable[[], object], calls: int = 50) -> float:
    """Milliseconds per call of back-to-back calls (kernel probes)."""
    for _ in range(3):
        fn()
    start, end = event(), event()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def ceilings() -> dict[str, float]:
    """fp16/bf16 matmul TFLOP/s (8192^3, random data, back-to-back after 0.5 s
    of warm-up so clocks have risen) and device copy TB/s (read + write)."""
    n = 8192
    out = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in "ab")
        mm = partial(torch.mm, a, b)
        began = time.perf_counter()
        while time.perf_counter() - began < 0.5:
            time_loop(mm, 10)
        best = max(2 * n**3 / time_loop(mm, 20) / 1e9 for _ in range(5))
        out[f"matmul_{name}_tflops"] = best
    x = torch.randn(2**29, device="cuda", dtype=torch.float16)  # 1 GiB
    y = torch.empty_like(x)
    out["copy_tbps"] = 2 * x.numel() * 2 / time_loop(partial(y.copy_, x), 20) / 1e9
    return out


def flops(spec: dict[str, int], batch: int, length: int) -> float:
    """Matmul + attention FLOPs of one padded batch."""
    h, inner, tokens = spec["hidden"], spec["inner"], batch * length
    per_layer = 2 * tokens * (4 * h * h + 2 * h * inner) + 4 * tokens * length * h
    return float(spec["layers"] * per_layer)


def write_checkpoint(name: str, directory: Path) -> ModelEntry:
    write_random_checkpoint(name, directory)
    return ModelEntry(name=name, task="embed", checkpoint=str(directory), root="/")


def hf_model(checkpoint: str) -> Any:
    import transformers

    model: Any = transformers.BertModel.from_pretrained(
        checkpoint,
        dtype=torch.float16,
        attn_implementation="sdpa",
        add_pooling_layer=False,
    )
    return model.cuda().eval()


def inputs(batch: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, VOCAB, size=(batch, length), dtype=np.int32)
    lengths = rng.integers(length // 2 + 1, length + 1, size=batch, dtype=np.int32)
    lengths[0] = length
    ids[np.arange(length)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def hf_pooled(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def time_ours(backend: CudaBackend, args: tuple[Any, ...]) -> dict[str, Any]:
    """e2e ms, graph ms, pipelined sequences/s and the output of one shape."""
    batch = args[3]
    computes: list[float] = []

    def once() -> None:
        computes.append(backend.run_bytes(*args)[1][1])

    ours_ms = statistics.median(time_calls(once, backend.stream))
    output = backend.run_bytes(*args)[0].copy()
    calls = max(10, min(400, int(0.15 / (ours_ms / 1e3))))
    start, end = event(), event()
    start.record(backend.stream)
    pending: deque[Any] = deque()
    host: list[float] = []
    for _ in range(calls):  # fill slot n+1 while slot n computes
        began = time.perf_counter()
        pending.append(backend.submit(*args))
        host.append(time.perf_counter() - began)
        if len(pending) == 2:
            collect(pending.popleft())
    while pending:
        collect(pending.popleft())
    end.record(backend.stream)
    end.synchronize()
    return {
        "ms": ours_ms,
        "graph_ms": statistics.median(computes) * 1e3,
        "pipe": calls * batch / (start.elapsed_time(end) / 1e3),
        "submit_us": statistics.median(host) * 1e6,
        "output": output,
    }


def averaged(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """time_ours's figures averaged over runs (the first run's output)."""
    keys = ("ms", "graph_ms", "pipe", "submit_us")
    mean = {key: statistics.fmean(t[key] for t in timings) for key in keys}
    return mean | {"output": timings[0]["output"]}


def bench_shape(
    backends: dict[str, CudaBackend],
    hf: Any,
    name: str,
    shape: tuple[int, int],
    peak: float,
    full: bool = False,
) -> dict[str, Any]:
    batch, length = shape
    ids, lengths = inputs(batch, length, seed=batch * 1000 + length)
    if full:  # every row as long as the shape: nothing for packing to save
        ids[ids == 0] = 1000
        lengths[:] = length
    args = (name, ids.tobytes(), lengths.tobytes(), batch, length)
    modes = [m for m in backends if m != "padded" or token_ladder(batch, length)]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for mode in modes + modes[::-1]:  # A B B A: drift weighs on each alike
        runs[mode].append(time_ours(backends[mode], args))
    ours = {mode: averaged(timings) for mode, timings in runs.items()}
    ids_t = torch.from_numpy(ids).long().cuda()
    mask = torch.from_numpy(ids != 0).long().cuda()
    mask[:, 0] = 1
    hf_ms = statistics.median(
        time_calls(partial(hf_pooled, hf, ids_t, mask), torch.cuda.current_stream())
    )
    theirs = hf_pooled(hf, ids_t, mask).float().cpu().numpy()
    best = ours[DEFAULT_INPUT]
    mine = best["output"]
    cos = np.sum(mine * theirs, 1) / (
        np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1)
    )
    tflops = flops(MODELS[name], batch, length) / (best["graph_ms"] / 1e3) / 1e12
    row: dict[str, Any] = {
        "model": name,
        "batch": batch,
        "length": length,
        "ours_ms": round(best["ms"], 4),
        "hf_eager_ms": round(hf_ms, 4),
        "graph_ms": round(best["graph_ms"], 4),
        "pipe_seq_s": round(best["pipe"]),
        "tflops": round(tflops, 1),
        "ceiling_pct": round(100 * tflops / peak, 1),
        "min_cos_vs_hf": round(float(cos.min()), 6),
        "attention": backends[DEFAULT_INPUT].runner(name).forward.chosen[shape],
        "preload": backends[DEFAULT_INPUT].runner(name).forward.preloaded[shape],
    }
    if full:
        row["rows_full"] = True
    if "padded" in ours:
        row["padded_ms"] = round(ours["padded"]["ms"], 4)
        row["padded_pipe_seq_s"] = round(ours["padded"]["pipe"])
    for mode, timing in ours.items():
        if mode == "padded":
            continue
        key = mode.replace("-", "_")
        row[f"ours_ms_{key}"] = round(timing["ms"], 4)
        row[f"graph_ms_{key}"] = round(timing["graph_ms"], 4)
        row[f"pipe_seq_s_{key}"] = round(timing["pipe"])
        row[f"submit_us_{key}"] = round(timing["submit_us"], 1)
    return row


HEADER = (
    f"{'model':9} {'batch':>5} {'len':>4} {'ours_ms':>8} {'other_ms':>8} "
    f"{'graph_ms':>8} {'hf_ms':>8} {'speedup':>7} {'ours_seq/s':>10} "
    f"{'pipe_seq/s':>10} {'hf_seq/s':>9} {'TFLOP/s':>7} {'%ceil':>5} {'cos_hf':>7} "
    f"{'padded_ms':>9}"
)


def row_line(r: dict[str, Any]) -> str:
    other = next(m for m in INPUT_MODES if m != DEFAULT_INPUT).replace("-", "_")
    return (
        f"{r['model']:9} {r['batch']:5d} {r['length']:4d} {r['ours_ms']:8.3f} "
        f"{r.get(f'ours_ms_{other}', float('nan')):8.3f} {r['graph_ms']:8.3f} "
        f"{r['hf_eager_ms']:8.3f} {r['hf_eager_ms'] / r['ours_ms']:6.1f}x "
        f"{r['batch'] / r['ours_ms'] * 1e3:10.0f} {r['pipe_seq_s']:10d} "
        f"{r['batch'] / r['hf_eager_ms'] * 1e3:9.0f} {r['tflops']:7.1f} "
        f"{r['ceiling_pct']:5.1f} {r['min_cos_vs_hf']:7.4f} "
        f"{r.get('padded_ms', float('nan')):9.3f}"
    )


def bench_model(
    name: str, shapes: list[tuple[int, int]], peak: float, workdir: Path
) -> list[dict[str, Any]]:
    entry = write_checkpoint(name, workdir / name)
    backends = {}
    for mode in INPUT_MODES:
        backends[mode] = CudaBackend("cuda:0", input_mode=mode)
        backends[mode].load(entry)
        began = time.perf_counter()
        backends[mode].warmup(name, shapes)
        chosen = backends[mode].runner(name).forward.chosen
        print(
            f"{name} {mode}: graphs captured in {time.perf_counter() - began:.1f} s; "
            f"attention {sorted(chosen.items())}"
        )
    backends["padded"] = CudaBackend("cuda:0", input_mode=DEFAULT_INPUT, pack=False)
    backends["padded"].load(entry)
    backends["padded"].warmup(name, [s for s in shapes if token_ladder(*s)])
    hf = hf_model(entry.checkpoint)
    rows = []
    print(f"ours_ms: {DEFAULT_INPUT} inputs; other_ms: the other mode", flush=True)
    print(HEADER)
    for shape in shapes:
        rows.append(bench_shape(backends, hf, name, shape, peak))
        print(row_line(rows[-1]), flush=True)
    if name == "bert-base" and (128, 128) in shapes:
        full = bench_shape(backends, hf, name, (128, 128), peak, full=True)
        print(row_line(full), "(every row 128 tokens)", flush=True)
        rows.append(full)
    if name == "bert-base":
        profile(backends[DEFAULT_INPUT], name)
    del hf, backends
    torch.cuda.empty_cache()
    return rows


def profile(backend: CudaBackend, name: str) -> None:
    """Kernel times of one fused forward (eager: the same kernels as the graph)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    forward = backend.runner(name).forward
    for batch, length in ((1, 128), (128, 128)):
        ids, lengths = (torch.from_numpy(a).cuda() for a in inputs(batch, length, 3))
        with torch.inference_mode():
            forward(ids, lengths)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    forward(ids, lengths)
                torch.cuda.synchronize()
        kernels = prof.key_averages()
        events = [e for e in kernels if e.device_type == DeviceType.CUDA]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.device_time_total for e in events) / 5
        print(f"profile {name} {batch}x{length}: {total:.0f} us of kernels per forward")
        for e in events[:14]:
            print(
                f"profile   {e.device_time_total / 5:8.1f} us {e.count // 5:4d}x "
                f"{e.key[:90]}"
            )


def probe_kernels() -> dict[str, float]:
    """Single-kernel timings at BERT-base sizes (ms), for the notes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from engine.cuda.pinned import HostBuffer

    h, inner, heads, dev, dt = 768, 3072, 12, "cuda", torch.float16
    out: dict[str, float] = {}
    tokens = 16384
    x = torch.randn(tokens, h, device=dev, dtype=dt)
    w_in = torch.randn(inner, h, device=dev, dtype=dt) * 0.02
    b_in = torch.randn(inner, device=dev, dtype=dt)
    out["ffn_in_addmm"] = time_loop(partial(F.linear, x, w_in, b_in))
    out["ffn_in_gelu_epilogue"] = time_loop(
        partial(torch._addmm_activation, b_in, x, w_in.t(), use_gelu=True)
    )
    out["ffn_in_then_gelu_erf"] = time_loop(lambda: F.gelu(F.linear(x, w_in, b_in)))
    w_qkv, b_qkv = w_in[: 3 * h], b_in[: 3 * h]
    out["qkv_one_gemm"] = time_loop(partial(F.linear, x, w_qkv, b_qkv))
    out["qkv_three_gemms"] = time_loop(
        lambda: [F.linear(x, w_qkv[i * h : (i + 1) * h]) for i in range(3)]
    )
    y = torch.randn_like(x)
    w, b = torch.ones(h, device=dev, dtype=dt), torch.zeros(h, device=dev, dtype=dt)
    for rows in (1, 2, 4, 8):
        out[f"add_layernorm_triton_rows{rows}"] = time_loop(
            partial(add_layer_norm, y, x, w, b, 1e-12, rows)
        )
    out["add_layernorm_torch"] = time_loop(
        lambda: F.layer_norm(y + x, (h,), w, b, 1e-12)
    )
    # Mapped pinned memory: the zero-copy graph's first and last kernels.
    mapped = HostBuffer(4 * (tokens + 128), torch.device(dev)).cuda.view(torch.int32)
    out["zero_copy_read_ids_16k"] = time_loop(partial(mapped.to, torch.int64))
    pinned = torch.zeros(tokens + 128, dtype=torch.int32).pin_memory()
    staged = torch.empty_like(pinned, device=dev)
    out["staging_copy_ids_16k"] = time_loop(partial(staged.copy_, pinned, True))
    result = torch.randn(128, h, device=dev)
    written = HostBuffer(4 * 128 * h, torch.device(dev)).cuda.view(torch.float32)
    target = written.view(128, h)
    out["zero_copy_write_128x768"] = time_loop(
        partial(torch.mul, result, 1.0, out=target)
    )
    for batch, length in ((1, 128), (128, 128), (32, 512)):
        out.update(probe_attention(batch, length, h, heads, SDPBackend, sdpa_kernel))
    for name, ms in out.items():
        print(f"probe {name:40} {ms * 1e3:9.1f} us")
    return out


def probe_attention(
    batch: int, length: int, h: int, heads: int, backends: Any, sdpa_kernel: Any
) -> dict[str, float]:
    dev, n, d, key = "cuda", batch * length, h // heads, f"{batch}x{length}"
    out: dict[str, float] = {}
    qkv = torch.randn(n, 3 * h, device=dev, dtype=torch.float16)
    used = torch.from_numpy(inputs(batch, length, seed=5)[1]).to(dev)
    starts = torch.arange(
        0, (batch + 1) * length, length, dtype=torch.int32, device=dev
    )
    q, k, v = qkv.view(n, 3, heads, d).unbind(1)
    flash = partial(torch.ops.aten._flash_attention_forward, dropout_p=0.0)
    out[f"attn_flash_seqused_{key}"] = time_loop(
        partial(flash, q, k, v, starts, starts, length, length,
                is_causal=False, return_debug_mask=False, seqused_k=used)
    )  # fmt: skip
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    out[f"attn_flash_seqused_contiguous_{key}"] = time_loop(
        partial(flash, qc, kc, vc, starts, starts, length, length,
                is_causal=False, return_debug_mask=False, seqused_k=used)
    )  # fmt: skip
    out[f"attn_triton_{key}"] = time_loop(
        partial(attention, qkv, used, batch, length, heads)
    )
    out[f"attn_flash_varlen_full_{key}"] = time_loop(
        partial(flash, q, k, v, starts, starts, length, length,
                is_causal=False, return_debug_mask=False)
    )  # fmt: skip
    qb, kb, vb = qkv.view(batch, length, 3, heads, d).permute(2, 0, 3, 1, 4)
    mask = (torch.arange(length, device=dev)[None] < used[:, None])[:, None, None, :]
    masked = partial(F.scaled_dot_product_attention, qb, kb, vb, attn_mask=mask)
    for label, kernel in (
        ("efficient", backends.EFFICIENT_ATTENTION),
        ("cudnn", backends.CUDNN_ATTENTION),
    ):
        try:
            with sdpa_kernel([kernel]):
                out[f"attn_sdpa_mask_{label}_{key}"] = time_loop(masked)
        except RuntimeError as exc:
            print(f"sdpa {label} with a mask at {key}: {exc}".splitlines()[0])
    out[f"attn_sdpa_nomask_{key}"] = time_loop(
        partial(F.scaled_dot_product_attention, qb, kb, vb)
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("engine_gpu.json"))
    parser.add_argument("--models", default="bert-base,minilm")
    parser.add_argument("--quick", action="store_true", help="length 128 only")
    parser.add_argument("--no-probes", action="store_true")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "device": props.name,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "input_mode": engine_settings.current().cuda_input,
    }
    result.update(ceilings())
    result["matmul_tflops"] = round(result["matmul_fp16_tflops"], 1)
    print(
        f"{props.name}: fp16 matmul {result['matmul_fp16_tflops']:.0f} TFLOP/s, bf16 "
        f"{result['matmul_bf16_tflops']:.0f}, copy {result['copy_tbps']:.2f} TB/s",
        flush=True,
    )
    shapes = [(b, n) for n in LENGTHS for b in BATCHES]
    if args.quick:
        shapes = [(b, n) for b, n in shapes if n == 128]
    result["rows"] = []
    result["rows_full"] = []  # the same shapes with every row full
    if not args.no_probes:
        result["probes_ms"] = probe_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            for row in bench_model(name, shapes, result["matmul_tflops"], Path(tmp)):
                result["rows_full" if row.get("rows_full") else "rows"].append(row)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nfp16 matmul ceiling {result['matmul_tflops']} TFLOP/s")
    print(f"ours_ms: {DEFAULT_INPUT} inputs; other_ms: the other mode")
    print(HEADER)
    for row in result["rows"]:
        print(row_line(row))
    for row in result["rows_full"]:
        print(row_line(row), "(every row full)")


if __name__ == "__main__":
    main()
