"""FP8 against fp16 on a GPU: speed at batch 128 x 128 tokens, accuracy on real texts.

Run on the device machine (scripts/gpu_run.sh runs it with $OUT set)::

    python3 benchmarks/quant_gpu.py [--out FILE] [--model-repository DIR]

1. Accuracy: the default models (minilm, intent) with the GPU engines'
   buckets, float32 on the GPU (TF32 off) as the reference, against fp16,
   bf16 and FP8 variants run by the engine's fused forward (engine/cuda/forward.py:
   what berth serves) on the other texts: embedding cosine (mean, min) and
   intent top-1 agreement. "fp8" is what ``quantize: fp8`` serves: e4m3
   with one scale per weight, its codes rounded by GPTQ, and static input
   scales, calibrated on the first 256 texts of
   engine/data/calibration_texts.txt. The others round to nearest, keep the
   attention output's or FFN-out's projection in fp16, or take a scale per
   token.
2. Speed: a BERT-base-sized encoder (12 x 768, random weights) at batch 128,
   length 128, every row full, each variant captured in one CUDA graph and
   replayed; sequences/s from CUDA events. The baseline ("fp16 engine") is
   the engine's own fused fp16 forward (engine/cuda/forward.py); the fused variants
   run as the engine serves full rows (its full-row attention).

Writes ``quant_h200.json`` (to --out, else $OUT/, else benchmarks/results/)
after every stage, so a run cut short keeps what it measured; prints a
table. Variants that fail are reported with their error, never dropped.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.quant_gpu_report import print_table, summarize  # noqa: E402
from engine import quant  # noqa: E402
from engine.build import calibration, quantize  # noqa: E402
from engine.cuda.forward import FusedForward  # noqa: E402
from engine.cuda.graphs import capturing  # noqa: E402
from engine.encoder import Encoder, EncoderConfig  # noqa: E402
from engine.model import ServedModel, load_served_model  # noqa: E402
from services.repository import ModelEntry, load_repository  # noqa: E402

log = logging.getLogger("berth.bench")
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

BERT_BASE = EncoderConfig(
    model_type="bert",
    vocab_size=30522,
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    intermediate_size=3072,
    max_positions=512,
    activation="gelu",
    layer_norm_eps=1e-12,
    position_offset=0,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--model-repository", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="skip variants after this"
    )
    parser.add_argument("--no-compile", action="store_true")
    return parser.parse_args()


def out_path(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "quant_h200.json"
    return ROOT / "benchmarks" / "results" / "quant_h200.json"


def find_repository(arg: Path | None) -> Path:
    """--model-repository, the GPU fixtures' repo, ./model_repository, or built."""
    candidates = [arg] if arg else []
    fixtures = os.environ.get("BERTH_GPU_FIXTURES")
    if fixtures:
        candidates.append(Path(fixtures) / "repo")
    candidates.append(ROOT / "model_repository")
    for path in candidates:
        if path and (path / "minilm" / "berth.json").is_file():
            try:
                load_repository(path)
                return path
            except (ValueError, OSError) as exc:
                log.warning("model repository %s unusable: %s", path, exc)
    from services.cli.default_models import build_default_repository

    root = Path(tempfile.mkdtemp(prefix="berth-models-"))
    build_default_repository(root)
    return root


def checkpoint_dtype(entry: ModelEntry) -> str:
    """The stored weights' dtype (the device machine carries fp16-rounded ones)."""
    from safetensors import safe_open

    with safe_open(str(entry.checkpoint_dir / "model.safetensors"), "pt") as f:
        return str(f.get_tensor(next(iter(f.keys()))).dtype).removeprefix("torch.")


# ---- accuracy ---------------------------------------------------------------


def run_batches(
    model: nn.Module | Forward,
    batches: list[calibration.TokenBatch],
    device: torch.device,
) -> np.ndarray:
    outputs = []
    with torch.inference_mode():
        for b in batches:
            ids = torch.from_numpy(b.ids).to(device)
            lens = torch.from_numpy(b.lengths).to(device)
            outputs.append(model(ids, lens).float().cpu().numpy())
    return calibration.gather_rows(batches, iter(outputs))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


def variant_model(
    entry: ModelEntry, variant: str, device: torch.device, calib: list[Any]
) -> nn.Module:
    if variant == "fp16":
        return load_served_model(entry, device, torch.float16)
    if variant == "bf16":
        return load_served_model(entry, device, torch.bfloat16)
    model = load_served_model(entry, device, torch.float32)
    quantize.quantize_fp8(model, calib, **FP8_ACCURACY_VARIANTS[variant])
    return model


# Accuracy variants of FP8: which scales, which projections stay fp16, how
# the weights are rounded. "fp8" is what is served (quantize.quantize_fp8's
# defaults: GPTQ, all four projections in FP8).
OUT_FP16 = frozenset({"out"})
FP8_ACCURACY_VARIANTS: dict[str, dict[str, Any]] = {
    "fp8": {},
    "fp8, nearest": {"gptq": False},
    "fp8, out fp16": {"keep": OUT_FP16},
    "fp8, out fp16, nearest": {"keep": OUT_FP16, "gptq": False},
    "fp8 per-token": {"rowwise": True, "dynamic": True},
    "fp8, ffn_out fp16": {"keep": frozenset({"ffn_out"})},
}


def accuracy(repo: Path, device: torch.device, result: dict[str, Any]) -> None:
    entries = load_repository(repo, gpu=True)
    texts, kinds = calibration.evaluation_texts(), calibration.evaluation_kinds()
    result["accuracy_texts"] = len(texts)
    result["accuracy_utterances"] = kinds.count("utterance")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    refs: dict[str, np.ndarray] = {}
    batches: dict[str, list[calibration.TokenBatch]] = {}
    calib: dict[str, list[Any]] = {}
    for name in ("minilm", "intent"):
        entry = entries[name]
        batches[name] = calibration.text_batches(
            entry.tokenizer_file, texts, entry.buckets, 64
        )
        calib[name] = [
            (torch.from_numpy(b.ids).to(device), torch.from_numpy(b.lengths).to(device))
            for b in calibration.text_batches(
                entry.tokenizer_file, calibration.calibration_texts(), entry.buckets, 64
            )
        ]
        model = load_served_model(entry, device, torch.float32)
        refs[name] = run_batches(model, batches[name], device)
        del model
    table = {}
    for variant in ("fp16", "bf16", *FP8_ACCURACY_VARIANTS):
        row: dict[str, Any] = {}
        try:
            emb = run_batches(
                fused_forward(
                    variant_model(entries["minilm"], variant, device, calib["minilm"])
                ),
                batches["minilm"],
                device,
            )
            cos = cosines(emb, refs["minilm"])
            probs = run_batches(
                fused_forward(
                    variant_model(entries["intent"], variant, device, calib["intent"])
                ),
                batches["intent"],
                device,
            )
            row = {
                "mean_cosine": round(float(cos.mean()), 6),
                "min_cosine": round(float(cos.min()), 6),
                **calibration.intent_agreement(probs, refs["intent"], kinds),
            }
        except Exception as exc:  # a variant that fails is reported, not fatal
            traceback.print_exc()
            row = {"error": f"{type(exc).__name__}: {exc}"}
        table[variant] = row
        log.info("accuracy %s: %s", variant, row)
    result["accuracy"] = table


# ---- speed ------------------------------------------------------------------


def bert_base(device: torch.device) -> ServedModel:
    torch.manual_seed(0)
    with torch.device(device):
        encoder = Encoder(BERT_BASE)
    entry = ModelEntry(name="bert-base-random", task="embed", checkpoint="")
    return ServedModel(entry, encoder).eval().requires_grad_(False)


def graph_speed(
    forward: Forward, batch: int, length: int, iters: int, device: torch.device
) -> tuple[float, float, torch.Tensor]:
    """(sequences/s, ms per batch, output) of ``forward`` in one CUDA graph,
    every row full. A fused forward runs as the engine serves such a batch:
    its full-row attention chosen (``choose_full_rows``), told that every row
    is full (the ladder's top rung, engine/cuda/graphs.py)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1000, 29000, (batch, length), generator=gen, dtype=torch.int32)
    ids, lens = ids.to(device), torch.full((batch,), length, device=device)
    lens = lens.to(torch.int32)
    if isinstance(forward, FusedForward):
        forward.choose_full_rows(batch, length)
        forward = partial(forward, tokens=batch * length)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(3):  # compiles, autotunes, allocates: before capture
            forward(ids, lens)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), capturing(graph):
        out = forward(ids, lens)
    for _ in range(5):
        graph.replay()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    ms = start.elapsed_time(end) / iters
    return batch * 1000.0 / ms, ms, out.float().clone()


def fused_forward(model: nn.Module, **options: Any) -> Forward:
    """What the engine runs a model with: its fused forward (engine/cuda/forward.py)."""
    return FusedForward(cast(ServedModel, model), **options)


SpeedVariant = tuple[str, Callable[[], Forward | None]]


def speed_variants(
    base: ServedModel, calib: list[Any], no_compile: bool
) -> list[SpeedVariant]:
    """The speed table's variants of ``base``, each built when it is timed."""

    def fp16() -> ServedModel:
        return copy.deepcopy(base).half()

    def fp8(**options: Any) -> ServedModel:
        model = copy.deepcopy(base)
        quantize.quantize_fp8(model, calib, **options)
        return model

    def compiled(make: Callable[[], ServedModel]) -> Callable[[], ServedModel]:
        def build() -> ServedModel:
            model = make()
            quant.compile_layers(model)
            return model

        return build

    # Most telling first, so a cut-short run still has a baseline and FP8.
    variants: list[SpeedVariant] = [
        ("fp16 engine (fused kernels)", lambda: fused_forward(fp16())),
        ("fp8 engine (fused kernels)", lambda: fused_forward(fp8())),
        (
            "fp8 engine, torch's products",
            lambda: fused_forward(fp8(), fp8_tuned=False),
        ),
        (
            "fp8 engine, GELU pass",
            lambda: fused_forward(fp8(), fp8_epilogue=False, fp8_tuned=False),
        ),
        ("fp8 engine, out fp16", lambda: fused_forward(fp8(keep=OUT_FP16))),
        ("fp8 row-wise + fused kernels", lambda: fused_forward(fp8(rowwise=True))),
        ("fp8 eager", fp8),
    ]
    if not no_compile:
        variants.append(
            ("fp8 row-wise compiled layers", compiled(lambda: fp8(rowwise=True)))
        )
        per_token = compiled(lambda: fp8(rowwise=True, dynamic=True))
        variants.append(("fp8 per-token compiled layers", per_token))
    variants.append(("fp16 eager", fp16))
    if not no_compile:
        variants.append(("fp16 compiled layers", compiled(fp16)))
    return variants


def cosines_vs_fp16(table: dict[str, Any], outputs: dict[str, torch.Tensor]) -> None:
    """Sanity on the random model: each variant's min row cosine to fp16's."""
    reference = outputs.get("fp16 engine (fused kernels)", outputs.get("fp16 eager"))
    if reference is not None:
        for name, out in outputs.items():
            cos = cosines(out.cpu().numpy(), reference.cpu().numpy())
            table[name]["min_cosine_vs_fp16"] = round(float(cos.min()), 5)


def speed(
    args: argparse.Namespace,
    device: torch.device,
    result: dict[str, Any],
    save: Callable[[], None],
    deadline: float,
) -> None:
    b, n = args.batch, args.length
    base = bert_base(device)
    calib_gen = torch.Generator(device="cpu").manual_seed(2)
    calib_ids = torch.randint(1000, 29000, (32, n), generator=calib_gen)
    calib = [(calib_ids.to(device, torch.int32), torch.full((32,), n, device=device))]
    variants = speed_variants(base, calib, args.no_compile)
    table: dict[str, Any] = {}
    result["speed"] = table
    outputs: dict[str, torch.Tensor] = {}
    for name, make in variants:
        if time.monotonic() > deadline:
            table[name] = {"skipped": "time budget spent"}
            continue
        t0 = time.monotonic()
        try:
            forward = make()
            if forward is None:
                table[name] = {"skipped": "not available"}
                continue
            seqs, ms, out = graph_speed(forward, b, n, args.iters, device)
            outputs[name] = out
            table[name] = {"seq_per_s": round(seqs, 1), "ms_per_batch": round(ms, 3)}
        except Exception as exc:
            traceback.print_exc()
            table[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        table[name]["setup_s"] = round(time.monotonic() - t0, 1)
        log.info("speed %s: %s", name, table[name])
        torch.cuda.empty_cache()
        save()
    cosines_vs_fp16(table, outputs)


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout
    )
    args = parse_args()
    deadline = time.monotonic() + args.budget_s
    if not torch.cuda.is_available():
        sys.exit("quant_gpu.py needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    path = out_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "date": datetime.date.today().isoformat(),
        "variant": None,
        "speedup_b128_n128": None,
        "mean_cosine": None,
        "min_cosine": None,
        "intent_agreement": None,
        "torch": torch.__version__,
        "fp8_scales": "one per weight (tensor-wise), static input scales",
        "fp8_weights": "e4m3 codes rounded by GPTQ on the calibration texts",
        "fp8_kept_fp16": sorted(quantize.FP8_KEEP),
        "reference": "float32 on the GPU (TF32 off) from the same stored weights",
    }

    def save() -> None:
        summarize(result)
        path.write_text(json.dumps(result, indent=2) + "\n")

    repo = find_repository(args.model_repository)
    log.info("default models from %s", repo)
    result["model_repository"] = str(repo)
    result["checkpoint_dtype"] = checkpoint_dtype(load_repository(repo)["minilm"])
    result["row_wise_products"] = quant.rowwise_scaled_mm_works(device)
    accuracy(repo, device, result)
    save()
    quant.use_compiled_quantize()
    speed(args, device, result, save, deadline)
    save()
    print_table(result, BERT_BASE)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
