"""Phase 1 of the end-to-end benchmark: the offline baseline.

The ceiling a user gets with no server at all: the served texts encoded in
process by sentence-transformers on the same model, unless a throughput is
given on the command line (--offline-throughput), in which case the
baseline is labelled as given wherever it appears.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

GIVEN_NOTE = (
    "given on the command line (--offline-throughput), not measured in this run"
)
MEASURED_NOTE = "measured in this run, before any server started"


def baseline(
    given: float | None, checkpoint: Path, texts: list[str], batch_size: int
) -> dict[str, Any]:
    """Phase 1: the offline baseline, measured here on ``texts`` unless one
    is given (--offline-throughput), which is then labelled as given."""
    if given is not None:
        return {
            "source": "given",
            "given": True,
            "throughput": given,
            "note": GIVEN_NOTE,
        }
    return offline(checkpoint, texts, batch_size)


def baseline_label(base: dict[str, Any]) -> str:
    """Which baseline this is, for every line that quotes it or a ratio."""
    if base.get("given"):
        return f"a GIVEN baseline of {base['throughput']:.1f} texts/s, {GIVEN_NOTE}"
    return (
        f"the baseline measured in this run, {base['throughput']:.1f} texts/s "
        f"({base['implementation']}, batch {base['batch_size']}, "
        f"{base['texts']} of the same texts)"
    )


def ratio_name(base: dict[str, Any]) -> str:
    return "served/given baseline" if base.get("given") else "served/offline"


def offline(checkpoint: Path, texts: list[str], batch_size: int) -> dict[str, Any]:
    """sentence-transformers on the same texts, in process: texts per second.

    On a GPU the model runs in fp16, as berth's GPU engine does. Where
    sentence-transformers cannot be imported (the GPU machine has no scipy or
    scikit-learn, which it imports), the same procedure is run with
    transformers directly: sort by length, batch, pad to the longest, mean-
    pool, normalize, copy to the host; the result says which ran.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        encode = _transformers_encoder(checkpoint, device, batch_size)
        implementation = f"transformers, as sentence-transformers does ({exc})"
    else:
        model = SentenceTransformer(str(checkpoint), device=device)
        if device == "cuda":
            model.half()

        def encode(batch: list[str]) -> None:
            model.encode(batch, batch_size=batch_size, convert_to_numpy=True)

        implementation = "sentence-transformers"
    if device == "cpu":
        encode(texts[:256])  # warm up
    else:  # every batch shape once
        encode(texts[: batch_size * 16])
        torch.cuda.synchronize()
    start = time.perf_counter()
    encode(texts)
    seconds = time.perf_counter() - start
    return {
        "source": "measured",
        "given": False,
        "note": MEASURED_NOTE,
        "implementation": implementation,
        "device": device,
        "dtype": "float16" if device == "cuda" else "float32",
        "texts": len(texts),
        "seconds": round(seconds, 3),
        "throughput": round(len(texts) / seconds, 1),
        "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(),
    }


def _transformers_encoder(checkpoint: Path, device: str, batch_size: int) -> Any:
    import torch
    import transformers

    dtype = torch.float16 if device == "cuda" else torch.float32
    # The checkpoint's own limit, as sentence-transformers reads it.
    config = checkpoint / "sentence_bert_config.json"
    max_length = (
        json.loads(config.read_text())["max_seq_length"] if config.exists() else 512
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = transformers.AutoModel.from_pretrained(
        str(checkpoint), dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()

    @torch.inference_mode()
    def encode(texts: list[str]) -> np.ndarray:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out: list[np.ndarray] = []
        for start in range(0, len(order), batch_size):
            batch = [texts[i] for i in order[start : start + batch_size]]
            inputs = tokenizer(
                batch,
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(device)
            hidden = model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            out.append(pooled.cpu().numpy())
        return np.concatenate(out)

    return encode
