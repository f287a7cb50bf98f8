"""Which GPU path each architecture takes, and what it costs, on one GPU.

    python benchmarks/architectures.py --out benchmarks/results/architectures_h200.json

all-mpnet-base-v2's shape (MPNet, 12 layers, hidden 768, 514 positions)
and ModernBERT-base's (22 layers, hidden 768, alternating local and global
attention) get random weights from transformers' own config classes, in
fp16. Per (batch, length), lengths drawn from (L/2, L] with the first row
full:

- baseline: transformers' model in fp16 with ``attn_implementation="sdpa"``
  where the model has it (MPNet has only transformers' eager attention),
  eager (what most users run), with the attention mask, plus mean pooling:
  10 calls between CUDA events, the best of 3;

and berth's sides, each in a CUDA graph of 10 forwards, the best of 3
replays (engine/cuda/timing.py's ``time_in_graph``):

- plain: berth's torch encoder (engine/architectures/) in a CUDA graph, the
  CUDA backend's path for architectures its fused kernels do not compute
  (engine/cuda/plain.py): ModernBERT's path;
- fused: berth's fused forward (engine/cuda/forward.py) with the attention
  kernel timed per shape as the engine chooses it, rows packed where the
  engine packs them (B x L >= PACK_MIN_TOKENS): MPNet's path.

Ratios are the baseline's time over each side's (> 1: faster than
transformers). Outputs are checked: each side's mean-pooled rows against
the baseline's (min cosine, reported).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    sys.path[0] = str(ROOT)

from engine.cuda.forward import FusedForward  # noqa: E402
from engine.cuda.graphs import PACK_MIN_TOKENS  # noqa: E402
from engine.cuda.plain import unfused_reason  # noqa: E402
from engine.cuda.timing import time_in_graph, timing_lengths  # noqa: E402
from engine.model import ServedModel, load_served_model  # noqa: E402
from services.repository import ModelEntry  # noqa: E402

SHAPES = [(1, 128), (32, 128), (128, 128), (32, 512)]


def _checkpoint(arch: str, directory: Path) -> Any:
    """transformers' model of ``arch``'s base shape, random, fp16, saved."""
    import transformers as tf

    config: Any
    if arch == "mpnet":
        config = tf.MPNetConfig(
            vocab_size=30527, num_hidden_layers=12, hidden_size=768,
            num_attention_heads=12, intermediate_size=3072,
            max_position_embeddings=514,
        )  # fmt: skip
    else:
        config = tf.ModernBertConfig(
            vocab_size=50368, num_hidden_layers=22, hidden_size=768,
            num_attention_heads=12, intermediate_size=1152,
            max_position_embeddings=8192, pad_token_id=50283,
        )  # fmt: skip
    torch.manual_seed(0)
    try:
        model = tf.AutoModel.from_config(config, attn_implementation="sdpa")
    except ValueError:  # MPNet: transformers has its own attention only
        model = tf.AutoModel.from_config(config, attn_implementation="eager")
    model.save_pretrained(directory, safe_serialization=True)
    return model.half().cuda().eval()


def _served(arch: str, directory: Path) -> ServedModel:
    entry = ModelEntry(
        name=arch, task="embed", checkpoint=str(directory), root="/",
        backend="torch", max_tokens=512,
    )  # fmt: skip
    return load_served_model(entry, device="cuda", dtype=torch.float16)


def _batch(batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = timing_lengths(batch, length, torch.device("cuda")).to(torch.int32)
    ids = torch.randint(5, vocab, (batch, length), device="cuda", dtype=torch.int32)
    ids[torch.arange(length, device="cuda")[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def _pooled(reference: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' hidden states, mean-pooled over each row's tokens."""
    hidden = reference(input_ids=ids.long(), attention_mask=mask).last_hidden_state
    weights = mask[..., None].float() / mask.sum(1)[:, None, None].float()
    out: torch.Tensor = (hidden.float() * weights).sum(1)
    return out


def eager_ms(fn: Any, calls: int = 10, rounds: int = 3) -> float:
    """Milliseconds per eager call: ``calls`` calls between CUDA events,
    the best of ``rounds``, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def measure(arch: str, work: Path) -> list[dict[str, Any]]:
    reference = _checkpoint(arch, work / arch)
    served = _served(arch, work / arch)
    fused = FusedForward(served) if unfused_reason(served) is None else None
    vocab = served.encoder.config.vocab_size
    rows = []
    for batch, length in SHAPES:
        ids, lengths = _batch(batch, length, vocab)
        mask = (torch.arange(length, device="cuda")[None, :] < lengths[:, None]).long()

        baseline = partial(_pooled, reference, ids, mask)
        sides = {"plain": partial(served, ids, lengths)}
        row: dict[str, Any] = {
            "model": arch, "batch": batch, "length": length,
            "transformers_attention": reference.config._attn_implementation,
        }  # fmt: skip
        if fused is not None:
            packed = batch * length >= PACK_MIN_TOKENS
            row["attention"] = fused.choose_attention(batch, length, packed)
            tokens = None
            if packed and fused.packs(batch, length):
                tokens = int(lengths.clamp(min=1).sum())
            row["packed"] = tokens is not None
            sides["fused"] = partial(fused, ids, lengths, tokens)
        with torch.inference_mode():
            want = baseline()
            row["baseline_ms"] = eager_ms(baseline)
            for side, run in sides.items():
                row[f"{side}_ms"] = time_in_graph(run)
                cosine = F.cosine_similarity(run().float(), want)
                row[f"{side}_min_cosine"] = round(cosine.min().item(), 6)
                row[f"{side}_x"] = row["baseline_ms"] / row[f"{side}_ms"]
        print(_line(row), flush=True)
        rows.append(row)
    return rows


def _line(row: dict[str, Any]) -> str:
    def side(name: str) -> str:
        if f"{name}_ms" not in row:
            return f"{'-':>9} {'-':>6}"
        return f"{row[f'{name}_ms']:9.3f} {row[f'{name}_x']:5.2f}x"

    attention = row.get("attention", "-") + (" packed" if row.get("packed") else "")
    return (
        f"{row['model']:<11} {row['batch']:>5} {row['length']:>6} "
        f"{row['baseline_ms']:9.3f} {side('plain')} {side('fused')}  {attention}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--archs", default="mpnet,modernbert")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: ms per forward in a CUDA graph; "
          "x = transformers eager fp16 time / this side's")  # fmt: skip
    print(f"{'model':<11} {'batch':>5} {'length':>6} {'baseline':>9} "
          f"{'plain':>9} {'':>6} {'fused':>9} {'':>6}  attention")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for arch in args.archs.split(","):
            rows += measure(arch, Path(work))
    if args.out:
        result = {
            "benchmark": "architectures",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
