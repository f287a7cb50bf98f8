"""Checkpoints served as their authors define them, on a GPU, in the CUDA
backend's graphs: cross-encoders' pairs (BERT's segments folded into the
word table), ``*ForSequenceClassification`` heads, and MPNet's relative
position bias in the fused attention kernels.

Each is compared with its float32 reference on the CPU (sentence-transformers'
CrossEncoder, transformers' classifier, berth's own torch encoder, itself
exact against transformers: tests/engine/test_architectures.py), at the
tolerance of the served dtype (fp16 by default).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.cuda.forward import FusedForward
from engine.cuda.plain import PlainForward
from engine.model import load_served_model
from gateway.berth import activated
from gateway.tokenize import Limits, TextEncoder
from services.repository import load_entry
from tests.engine.test_architectures import VOCAB, _entry, write_checkpoint
from tests.engine.test_checkpoint_classifiers import (
    add_entry,
    reference,
    token_batch,
    write_classifier,
)
from tests.test_rerank import (
    ARCHITECTURES,
    QUERY,
    TEXTS,
    cross_encoder_scores,
    padded,
    write_rerankers,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FUSED = {"bert", "distilbert", "roberta", "xlm-roberta", "mpnet"}
SCORE_TOLERANCE = 1e-2  # fp16 weights and activations, sigmoid scores


def _shapes(longest: int) -> list[tuple[int, int]]:
    """Graphs to capture: 128 rows of the longest (over PACK_MIN_TOKENS, so
    packed) and two small padded shapes."""
    return [(128, longest), (8, longest), (8, 32)]


def _forward_kind(backend: object, name: str, arch: str) -> None:
    forward = backend.runner(name).forward  # type: ignore[attr-defined]
    expected = FusedForward if arch in FUSED else PlainForward
    assert isinstance(forward, expected), (arch, type(forward))


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rerankers(tmp_path_factory)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rerank_scores_equal_the_cross_encoders(rerankers: Path, arch: str) -> None:
    """(query, text) pairs, their second segment past the vocabulary where
    the architecture has token types, scored in the graphs as
    ``CrossEncoder.predict`` scores them in float32."""
    from engine.cuda.backend import CudaBackend

    entry = load_entry(rerankers / arch)
    rows = TextEncoder(entry, Limits()).encode_pairs(QUERY, TEXTS, truncate=False)
    batch, lengths = padded(rows)
    if entry.token_type_offset():
        assert batch.max() >= entry.token_type_offset()  # segment 1 is there
    backend = CudaBackend("cuda")
    backend.load(entry)
    _forward_kind(backend, arch, arch)
    backend.warmup(arch, _shapes(entry.max_tokens))
    scores = activated(backend.run(arch, batch, lengths)[:, 0], "sigmoid")
    # The same pairs 20 times: the packed graph.
    many = np.tile(batch, (20, 1)), np.tile(lengths, 20)
    packed = activated(backend.run(arch, *many)[:, 0], "sigmoid")
    theirs = cross_encoder_scores(entry.checkpoint_dir, QUERY, TEXTS)
    diff = float(np.abs(scores - theirs).max())
    print(f"{arch}: max |score diff| {diff:.1e} against CrossEncoder in float32")
    assert diff <= SCORE_TOLERANCE, diff
    np.testing.assert_allclose(packed, np.tile(scores, 20), atol=2e-3)


@pytest.mark.parametrize("arch", ["bert", "roberta", "mpnet", "modernbert"])
@pytest.mark.parametrize("problem", ["single", "multi"])
def test_classifier_heads_label_as_transformers_does(
    tmp_path: Path, arch: str, problem: str
) -> None:
    from engine.cuda.backend import CudaBackend

    model = write_classifier(tmp_path / "checkpoint", arch, problem)
    entry = load_entry(add_entry(tmp_path / "repo", "c", tmp_path / "checkpoint"))
    ids, batch, lengths = token_batch(entry)
    backend = CudaBackend("cuda")
    backend.load(entry)
    _forward_kind(backend, "c", arch)
    backend.warmup("c", _shapes(entry.max_tokens))
    ours = backend.run("c", batch, lengths)
    theirs = reference(model, ids)
    diff = float(np.abs(ours - theirs).max())
    print(f"{arch} {problem}-label: max |probability diff| {diff:.1e}")
    assert diff <= SCORE_TOLERANCE, diff
    assert (ours.argmax(1) == theirs.argmax(1)).all()


@pytest.mark.parametrize("kind", ["triton", "sdpa"])
def test_mpnet_attention_kernels_carry_the_position_bias(
    tmp_path: Path, kind: str
) -> None:
    """Each attention kernel the fused forward may choose for MPNet, padded
    and (berth's kernel) packed rows, against the float32 encoder on the CPU,
    on rows from 1 token to every position (distances past 128: the far
    buckets)."""
    write_checkpoint(tmp_path, "mpnet")
    entry = _entry(tmp_path, "mpnet")
    reference = load_served_model(entry)
    served = load_served_model(entry, device="cuda", dtype=torch.float16)
    forward = FusedForward(served)
    assert "flash" not in forward.kinds and kind in forward.kinds
    length = entry.max_tokens
    lengths = torch.tensor([length, 1, 0, 131, 7, 140], dtype=torch.int32)
    ids = torch.randint(3, VOCAB, (len(lengths), length), generator=torch.Generator())
    ids[torch.arange(length)[None, :] >= lengths[:, None]] = 0
    forward.chosen[(len(lengths), length)] = kind
    with torch.inference_mode():
        want = reference(ids.long(), lengths)
        got = forward(ids.int().cuda(), lengths.cuda()).float().cpu()
        outputs = [got]
        if kind == "triton":
            tokens = int(lengths.clamp(min=1).sum()) + 3
            packed = forward(ids.int().cuda(), lengths.cuda(), tokens)
            outputs.append(packed.float().cpu())
    real = lengths > 0
    for out in outputs:
        cosine = F.cosine_similarity(out[real], want[real])
        assert torch.isfinite(out).all() and cosine.min().item() > 0.999


def test_an_fp8_mpnet_runs_fp8_layers_around_its_biased_attention(
    tmp_path: Path,
) -> None:
    """quantize: fp8 on an MPNet classifier: every layer takes the fused FP8
    path, its attention still biased, and the graphs give what the eager
    fused forward gives."""
    from engine.cuda.backend import CudaBackend

    write_classifier(tmp_path / "checkpoint", "mpnet")
    entry_dir = add_entry(
        tmp_path / "repo", "c", tmp_path / "checkpoint", quantize="fp8"
    )
    entry = load_entry(entry_dir)
    backend = CudaBackend("cuda")
    backend.load(entry)
    forward = backend.runner("c").forward
    assert isinstance(forward, FusedForward) and forward.position_bias is not None
    assert all(plan is not None for plan in forward.fp8)
    backend.warmup("c", _shapes(entry.max_tokens))
    _, batch, lengths = token_batch(entry)
    graphed = backend.run("c", batch, lengths)
    with torch.inference_mode():
        eager = forward(
            torch.from_numpy(batch).cuda(), torch.from_numpy(lengths).cuda()
        )
    np.testing.assert_allclose(graphed, eager.float().cpu().numpy(), atol=1e-3)
    assert np.isfinite(graphed).all()
