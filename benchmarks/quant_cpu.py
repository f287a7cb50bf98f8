"""INT8 against fp32 on the CPU: berth's torch backend and onnxruntime, same texts.

    python benchmarks/quant_cpu.py [--out FILE] [--repeats 2] [--texts N]

The default models (minilm, intent) run the held-out texts of
engine/data/calibration_texts.txt (those after the 256 calibration ones),
padded per length bucket in batches of 64 as the batcher would, through:

- torch fp32: berth's torch backend on the CPU (the reference);
- torch int8: the same with quantize "int8" (engine/quant.py: per-channel
  int8 weights, dynamic int8 activations, SmoothQuant calibrated on the
  calibration texts);
- onnxruntime fp32 / int8: the ONNX export in onnxruntime, and onnxruntime's
  own dynamic INT8 quantization of it.

Speed is sequences/s over all the texts (best of --repeats passes,
interleaved across variants); accuracy is intent top-1 agreement and minilm
embedding cosine against torch fp32.
Prints a table, then as its last line a JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.build import calibration  # noqa: E402
from engine.build.quantize import quantize_for_entry  # noqa: E402
from engine.torch_backend import TorchBackend  # noqa: E402
from services.repository import ModelEntry, load_repository  # noqa: E402

log = logging.getLogger("berth.bench")
Run = Callable[[np.ndarray, np.ndarray], np.ndarray]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = ROOT / "benchmarks" / "results" / "quant_cpu.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--model-repository", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--texts", type=int, default=0, help="0: all held-out texts")
    return parser.parse_args()


def find_repository(arg: Path | None) -> Path:
    for path in (arg, ROOT / "model_repository"):
        if path and (path / "intent" / "berth.json").is_file():
            return path
    from services.cli.default_models import build_default_repository

    root = Path(tempfile.mkdtemp(prefix="berth-models-"))
    build_default_repository(root)
    return root


def one_pass(
    run: Run, batches: list[calibration.TokenBatch]
) -> tuple[np.ndarray, float]:
    """(outputs in text order, sequences/s) of one pass over ``batches``."""
    start = time.perf_counter()
    parts = [run(b.ids, b.lengths) for b in batches]
    elapsed = time.perf_counter() - start
    rows = sum(len(b.index) for b in batches)
    return calibration.gather_rows(batches, iter(parts)), rows / elapsed


def with_quantize(entry: ModelEntry, quantize: str) -> ModelEntry:
    """A copy of ``entry`` with the proposed ``quantize`` field set."""
    copy = dataclasses.replace(entry)
    setattr(copy, "quantize", quantize)  # noqa: B010 (not yet a ModelEntry field)
    return copy


def torch_runner(entry: ModelEntry, quantize: str) -> Run:
    backend = TorchBackend("cpu")
    backend.load(entry)
    if quantize != "none":
        spec = with_quantize(entry, quantize)
        quantize_for_entry(backend.model(entry.name), spec, torch.device("cpu"))
    return lambda ids, lengths: backend.run(entry.name, ids, lengths)


def onnx_runner(entry: ModelEntry, quantize: str, cache: Path) -> Run:
    from engine.onnx_backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend("cpu", cache=cache)
    backend.load(with_quantize(entry, quantize))
    return lambda ids, lengths: backend.run(entry.name, ids, lengths)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


Variant = tuple[str, Callable[[ModelEntry], Run]]


def make_variants(cache: Path) -> list[Variant]:
    """torch fp32 and int8, then onnxruntime's where it is installed."""
    variants: list[Variant] = [
        ("torch fp32", lambda e: torch_runner(e, "none")),
        ("torch int8", lambda e: torch_runner(e, "int8")),
    ]
    try:
        import onnxruntime  # noqa: F401

        variants += [
            ("onnxruntime fp32", lambda e: onnx_runner(e, "none", cache)),
            ("onnxruntime int8", lambda e: onnx_runner(e, "int8", cache)),
        ]
    except ImportError:
        log.warning("onnxruntime is not installed: its rows are skipped")
    return variants


def intent_speed(
    variants: list[Variant],
    entry: ModelEntry,
    batches: list[calibration.TokenBatch],
    repeats: int,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """(intent probabilities, best sequences/s) of each variant on ``entry``.

    Passes interleaved across variants, best of ``repeats`` each, so load
    from other processes on the machine weighs on all of them alike."""
    runners = {name: make(entry) for name, make in variants}
    probs: dict[str, np.ndarray] = {}
    speed = dict.fromkeys(runners, 0.0)
    for run in runners.values():
        run(batches[0].ids, batches[0].lengths)  # warm-up
    for _ in range(repeats):
        for name, run in runners.items():
            probs[name], rate = one_pass(run, batches)
            speed[name] = max(speed[name], rate)
    return probs, speed


def variant_rows(
    variants: list[Variant],
    entry: ModelEntry,
    batches: list[calibration.TokenBatch],
    probs: dict[str, np.ndarray],
    speed: dict[str, float],
    kinds: list[str],
) -> dict[str, dict[str, float]]:
    """Each variant's speed, intent agreement and minilm (``entry``) cosine
    against torch fp32."""
    rows: dict[str, dict[str, float]] = {}
    reference = probs["torch fp32"]
    ref_emb: np.ndarray | None = None
    for name, make in variants:
        emb, _ = one_pass(make(entry), batches)
        ref_emb = emb if ref_emb is None else ref_emb
        cos = cosines(emb, ref_emb)
        rows[name] = {
            "seq_per_s": round(speed[name], 1),
            **calibration.intent_agreement(probs[name], reference, kinds),
            "mean_cosine": round(float(cos.mean()), 6),
            "min_cosine": round(float(cos.min()), 6),
        }
        print(f"measured {name}: {rows[name]}", file=sys.stderr, flush=True)
    return rows


def print_table(rows: dict[str, dict[str, float]], texts: int) -> None:
    base = rows["torch fp32"]["seq_per_s"]
    print(
        f"\nCPU: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"{texts} held-out texts, batches of 64 per bucket"
    )
    print(
        f"{'variant':<18}{'seq/s':>9}{'speedup':>9}{'intent agree':>14}"
        f"{'utterances':>12}{'mean cos':>10}"
    )
    for name, row in rows.items():
        print(
            f"{name:<18}{row['seq_per_s']:>9.1f}{row['seq_per_s'] / base:>9.2f}"
            f"{row['intent_agreement']:>14.4f}"
            f"{row['intent_agreement_utterances'] or float('nan'):>12.4f}"
            f"{row['mean_cosine']:>10.5f}"
        )


def summary(rows: dict[str, dict[str, float]], texts: int) -> dict[str, Any]:
    """The JSON object: every variant, and torch int8 against torch fp32."""
    base = rows["torch fp32"]["seq_per_s"]
    int8 = rows["torch int8"]
    return {
        "date": datetime.date.today().isoformat(),
        "texts": texts,
        "threads": torch.get_num_threads(),
        "variants": rows,
        "cpu_int8_min_cosine": int8["min_cosine"],
        "cpu_int8_mean_cosine": int8["mean_cosine"],
        "cpu_int8_speedup": round(int8["seq_per_s"] / base, 3),
        "cpu_intent_agreement": int8["intent_agreement"],
        "cpu_intent_agreement_utterances": int8["intent_agreement_utterances"],
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = parse_args()
    entries = load_repository(find_repository(args.model_repository))
    texts, kinds = calibration.evaluation_texts(), calibration.evaluation_kinds()
    texts, kinds = (
        (texts[: args.texts], kinds[: args.texts]) if args.texts else (texts, kinds)
    )
    cache = Path(tempfile.mkdtemp(prefix="berth-cache-"))
    variants = make_variants(cache)
    batches = {
        name: calibration.text_batches(
            entries[name].tokenizer_file, texts, entries[name].buckets, 64
        )
        for name in ("intent", "minilm")
    }
    probs, speed = intent_speed(
        variants, entries["intent"], batches["intent"], args.repeats
    )
    rows = variant_rows(
        variants, entries["minilm"], batches["minilm"], probs, speed, kinds
    )
    print_table(rows, len(texts))
    result = summary(rows, len(texts))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
