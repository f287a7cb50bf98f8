"""The report of benchmarks/quant_gpu.py: its summary fields and printed tables."""

from __future__ import annotations

import json
from typing import Any

from engine.encoder import EncoderConfig

# The FP8 variant the engine serves (``quantize: fp8``), whose accuracy row is "fp8".
SERVED_FP8 = "fp8 engine (fused kernels)"


def summarize(result: dict[str, Any]) -> None:
    """The top-level fields: the served FP8 variant against the fp16 engine
    (and the fastest FP8 variant of the table, where another was faster)."""
    table = result.get("speed", {})
    rate = {k: v["seq_per_s"] for k, v in table.items() if "seq_per_s" in v}
    baseline = next(
        (k for k in ("fp16 engine (fused kernels)", "fp16 eager") if k in rate), None
    )
    fp8 = [k for k in rate if k.startswith("fp8")]
    acc = result.get("accuracy", {}).get("fp8", {})
    result.update(
        {
            "mean_cosine": acc.get("mean_cosine"),
            "min_cosine": acc.get("min_cosine"),
            "intent_agreement": acc.get("intent_agreement"),
            "intent_agreement_utterances": acc.get("intent_agreement_utterances"),
        }
    )
    if baseline and fp8:
        fastest = max(fp8, key=lambda k: rate[k])
        headline = SERVED_FP8 if SERVED_FP8 in rate else fastest
        result["variant"] = f"{headline} (e4m3, {result.get('fp8_scales')})"
        result["baseline"] = baseline
        result["speedup_b128_n128"] = round(rate[headline] / rate[baseline], 3)
        result["fastest_fp8"] = {
            "variant": fastest,
            "speedup_b128_n128": round(rate[fastest] / rate[baseline], 3),
        }
        for other in ("fp16 eager", "fp16 compiled layers"):
            if other in rate:
                key = "speedup_vs_" + other.replace(" ", "_")
                result[key] = round(rate[headline] / rate[other], 3)


def print_table(result: dict[str, Any], config: EncoderConfig) -> None:
    """Both tables, then the headline fields as a JSON line; ``config`` is the
    speed table's encoder."""
    print(f"\n{result['device']}  torch {result['torch']}  {result['date']}")
    print(
        f"\naccuracy vs fp32 on {result.get('accuracy_texts')} texts "
        f"({result.get('accuracy_utterances')} of them utterances)"
    )
    print(
        f"{'variant':<20}{'mean cos':>10}{'min cos':>10}{'intent agree':>14}"
        f"{'utterances':>12}"
    )
    for name, row in result.get("accuracy", {}).items():
        if "error" in row:
            print(f"{name:<20}  error: {row['error']}")
            continue
        print(
            f"{name:<20}{row['mean_cosine']:>10.5f}{row['min_cosine']:>10.5f}"
            f"{row['intent_agreement']:>14.4f}"
            f"{row['intent_agreement_utterances'] or float('nan'):>12.4f}"
        )
    print(f"\nspeed, BERT-base {config.num_layers}x{config.hidden_size}, b128 n128")
    print(f"{'variant':<30}{'seq/s':>10}{'ms/batch':>10}{'x fp16':>8}{'setup s':>9}")
    speed = result.get("speed", {})
    base = speed.get(result.get("baseline") or "", {}).get("seq_per_s")
    for name, row in speed.items():
        if "seq_per_s" in row:
            ratio = f"{row['seq_per_s'] / base:>8.3f}" if base else f"{'':>8}"
            print(
                f"{name:<30}{row['seq_per_s']:>10.0f}{row['ms_per_batch']:>10.3f}"
                f"{ratio}{row['setup_s']:>9.1f}"
            )
        else:
            print(f"{name:<30}  {row.get('error') or row.get('skipped')}")
    print()
    keys = ["variant", "baseline", "speedup_b128_n128", "mean_cosine"]
    keys += ["min_cosine", "intent_agreement", "intent_agreement_utterances"]
    print(json.dumps({k: result.get(k) for k in keys}))
