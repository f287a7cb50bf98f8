"""A model repository for the end-to-end GPU run: one model per repository.

    python -m benchmarks.gpu_repository OUT [--minilm CHECKPOINT]

writes OUT/bert-base/ (a BERT-base-sized encoder, 12 layers, hidden 768, with
random weights, saved by transformers, and the MiniLM tokenizer: the speed of
BERT-base on real token ids) and OUT/minilm/ (the default embedding model,
from CHECKPOINT, e.g. the carried fp16 copy, else the installed package).
Each is a repository of its own, so a stack loads (and captures graphs for)
only the model it is measured on. Buckets are the default models' own.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import torch

from benchmarks.random_models import write_random_checkpoint
from services.cli.default_models import (
    GPU_BUCKETS,
    SHORT_TEXT_BUCKETS,
    minilm_checkpoint,
)
from services.repository import ModelEntry

log = logging.getLogger("berth.bench")


def write_bert_base(checkpoint: Path, tokenizer: Path) -> None:
    """Random BERT-base weights in fp16 (what the engine runs) plus tokenizer."""
    if (checkpoint / "model.safetensors").exists():
        return
    write_random_checkpoint("bert-base", checkpoint, torch.float16)
    shutil.copy(tokenizer, checkpoint / "tokenizer.json")
    log.info("bert-base: random weights written to %s", checkpoint)


def write_entry(root: Path, name: str, checkpoint: Path) -> Path:
    entry = ModelEntry(
        name=name,
        task="embed",
        checkpoint=str(checkpoint.resolve()),
        pooling="mean",
        normalize=True,
        buckets=list(SHORT_TEXT_BUCKETS),
        gpu_buckets=list(GPU_BUCKETS),
    )
    entry_dir = root / name / name
    entry_dir.mkdir(parents=True, exist_ok=True)
    (entry_dir / "berth.json").write_text(entry.to_json())
    return root / name


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--minilm", type=Path, help="MiniLM checkpoint directory")
    args = parser.parse_args()
    minilm = args.minilm or minilm_checkpoint()
    bert = args.out / "checkpoints" / "bert-base"
    write_bert_base(bert, minilm / "tokenizer.json")
    for name, checkpoint in (("bert-base", bert), ("minilm", minilm)):
        print(f"{name}: repository {write_entry(args.out, name, checkpoint)}")


if __name__ == "__main__":
    main()
