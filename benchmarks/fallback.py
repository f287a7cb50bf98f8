"""Level-3 fallbacks against their primaries, on texts never used for fitting.

Run: ``python -m benchmarks.fallback [--repository DIR]`` (or
``python benchmarks/fallback.py``). The repository defaults to
$BERTH_MODEL_REPOSITORY, else ./model_repository; when its models have no
fallback yet, they are built into a temporary copy (the repository itself is
never written). Prints a table, then one JSON line (the last line).

- cosine: between the fallback's and the primary's (minilm) embeddings.
- agreement: the intent fallback's top-1 label equals the primary's.
- µs/text: one text per call (the degraded path answers requests as they
  come), best of several rounds, both on this machine's CPU; the primary is
  berth's torch encoder in float32 (on a GPU it is much faster).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file: import berth's packages from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.build.fallback import (  # noqa: E402
    HELDOUT_GENERAL,
    HELDOUT_UTTERANCES,
    build_fallbacks,
    load_tokenizer,
    read_texts,
    tokenize,
)
from engine.model import ServedModel, load_served_model  # noqa: E402
from services.fallback_model import FallbackModel, fallback_path  # noqa: E402
from services.repository import ModelEntry, load_repository  # noqa: E402
from tests.texts import UTTERANCES, VARIED  # noqa: E402

MODELS = ("minilm", "intent")


def repository(path: Path, workdir: Path) -> Path:
    """``path`` if its fallbacks are built, else a copy with them built."""
    if not (path / "minilm" / "berth.json").is_file():
        from services.cli.default_models import build_default_repository

        path = workdir / "model_repository"
        build_default_repository(path)
    entries = load_repository(path)
    if all(fallback_path(entries[name]).is_file() for name in MODELS):
        return path
    copy = workdir / "with_fallbacks"
    for name in MODELS:
        source = Path(entries[name].root)
        shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("*.tmp"))
    print(f"{path} has no fallbacks: building them in {copy}", file=sys.stderr)
    build_fallbacks(copy)
    return copy


def primary_run(model: ServedModel, ids_list: list[np.ndarray]) -> np.ndarray:
    """The primary on each text alone (no padding): [N, width]."""
    with torch.inference_mode():
        rows = [
            model(
                torch.from_numpy(ids.astype(np.int64))[None], torch.tensor([len(ids)])
            )
            for ids in ids_list
        ]
    return torch.cat(rows).numpy()


def per_text_us(
    run: Callable[[list[np.ndarray]], object], ids_list: list[np.ndarray], rounds: int
) -> float:
    """Mean µs per one-text call over ``ids_list``; the best of ``rounds`` (the
    CPU is shared: the best round is the least disturbed one)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for ids in ids_list:
            run([ids])
        best = min(best, time.perf_counter() - started)
    return 1e6 * best / len(ids_list)


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    default = os.environ.get("BERTH_MODEL_REPOSITORY", "model_repository")
    parser.add_argument("--repository", type=Path, default=Path(default))
    args = parser.parse_args()
    logging.basicConfig(level="WARNING")
    with tempfile.TemporaryDirectory() as workdir:
        root = repository(args.repository, Path(workdir))
        entries: dict[str, ModelEntry] = load_repository(root)
        embed_entry = entries["minilm"]
        tokenizer = load_tokenizer(embed_entry)
        sets = {
            "tests UTTERANCES": UTTERANCES,
            "held-out utterances": read_texts(HELDOUT_UTTERANCES),
            "held-out general": read_texts(HELDOUT_GENERAL),
            "tests VARIED": VARIED,
        }
        ids = {
            name: tokenize(tokenizer, texts, embed_entry.max_tokens)
            for name, texts in sets.items()
        }
        fallbacks = {name: FallbackModel.load(entries[name]) for name in MODELS}
        primaries = {name: load_served_model(entries[name]) for name in MODELS}

        print(f"{'texts':<22}{'n':>5}{'cos mean':>10}{'cos min':>9}{'agree':>8}")
        cosines: list[float] = []
        agreements: list[bool] = []
        for name, ids_list in ids.items():
            ours = fallbacks["minilm"].embed(ids_list)
            theirs = primary_run(primaries["minilm"], ids_list)
            cosine = np.sum(unit(ours) * unit(theirs), axis=1)
            top = fallbacks["intent"].classify(ids_list).argmax(1)
            agree = top == primary_run(primaries["intent"], ids_list).argmax(1)
            cosines += cosine.tolist()
            if "utterances" in name.lower():  # intents: what the classifier is for
                agreements += agree.tolist()
            print(
                f"{name:<22}{len(ids_list):>5}{cosine.mean():>10.3f}"
                f"{cosine.min():>9.3f}{agree.mean():>8.3f}"
            )
        everything = [row for ids_list in ids.values() for row in ids_list]
        print(
            f"{'all':<22}{len(everything):>5}{np.mean(cosines):>10.3f}"
            f"{np.min(cosines):>9.3f}{np.mean(agreements):>8.3f}"
            "  (agreement: the utterance sets)"
        )
        fallback_us = per_text_us(fallbacks["intent"].classify, everything, 20)
        primary_us = per_text_us(
            lambda rows: primary_run(primaries["intent"], rows), everything, 3
        )
        print(
            f"µs per text, one per call: fallback {fallback_us:.1f}, primary "
            f"{primary_us:.0f} (x{primary_us / fallback_us:.0f}), "
            f"{torch.get_num_threads()} torch threads"
        )
        print(
            json.dumps(
                {
                    "intent_agreement": round(float(np.mean(agreements)), 4),
                    "intent_utterances": len(agreements),
                    "embedding_cosine_mean": round(float(np.mean(cosines)), 4),
                    "embedding_cosine_min": round(float(np.min(cosines)), 4),
                    "embedding_texts": len(cosines),
                    "fallback_us_per_text": round(fallback_us, 1),
                    "primary_us_per_text": round(primary_us, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
