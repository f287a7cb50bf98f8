"""The fused forward's paths agree with each other on the CPU.

Packed rows (no padding computed) give what padded rows give; the few-token
GEMM plan (berth's Triton ``linear``, split-K partials summed in the
LayerNorm) gives what cuBLAS's path gives.

The fused forward's packed path (engine/cuda/forward.py) with torch's fallbacks of
berth's kernels (and, with ``TRITON_INTERPRET=1`` and Triton installed, the
kernels themselves): same outputs as the padded path and as the plain
ServedModel, for rows of every length including empty ones (batch padding)
and with tokens to spare past the last row (a graph's token bucket). Those
spare rows are never written (the GPU computes on whatever they hold, each
row on its own, and pooling never reads them): numpy's overflow warnings on
them under the interpreter are expected.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.cuda.forward import FusedForward
from engine.cuda.graphs import PACK_MIN_TOKENS, packed_tokens, token_ladder
from engine.cuda.kernels import (
    add_layer_norm_partials,
    attention,
    mean_pool,
    small_linear_plan,
)
from engine.cuda.tiles import PRELOAD_LINEAR, LinearConfig
from engine.torch_backend import TorchBackend

PROJECTIONS = ("qkv", "out", "ffn_in", "ffn_out")

LENGTHS = [9, 1, 0, 16, 5, 0, 12]


def _batch(vocab: int, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(5, vocab, (len(LENGTHS), length), generator=generator)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    ids[torch.arange(length)[None, :] >= lengths[:, None]] = 0
    return ids.to(torch.int32), lengths


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("model", ["minilm", "intent"])
def test_packed_rows_equal_padded_rows(backend: TorchBackend, model: str) -> None:
    served = backend.model(model)
    forward = FusedForward(served)
    ids, lengths = _batch(served.encoder.config.vocab_size)
    shape = (len(LENGTHS), int(ids.shape[1]))
    forward.chosen[shape] = "triton"  # a kernel that takes row starts
    assert forward.packs(*shape)
    needed = int(lengths.clamp(min=1).sum())
    with torch.inference_mode():
        padded = forward(ids, lengths)
        plain = served(ids.long(), lengths)
        for tokens in (needed, needed + 13):
            packed = forward(ids, lengths, tokens)
            assert packed.shape == padded.shape
            torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(padded, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", ["minilm", "intent"])
@pytest.mark.parametrize("kind", ["sdpa", "triton"])
def test_full_rows_run_without_a_mask(
    backend: TorchBackend, model: str, kind: str
) -> None:
    """tokens = B * L: every row full, the graph of engine/cuda/graphs.py's
    top rung. It runs the padded layout with no attention mask (SDPA), or
    berth's kernel, and gives what the masked padded path gives."""
    served = backend.model(model)
    forward = FusedForward(served)
    ids, _ = _batch(served.encoder.config.vocab_size)
    ids[ids == 0] = 7  # no padding left
    rows, length = ids.shape
    forward.full_rows[(rows, length)] = kind
    lengths = torch.full((rows,), length, dtype=torch.int32)
    with torch.inference_mode():
        padded = forward(ids, lengths)
        full = forward(ids, lengths, rows * length)
        plain = served(ids.long(), lengths)
    torch.testing.assert_close(full, padded, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(full, plain, rtol=1e-4, atol=1e-5)


def test_sdpa_with_a_mask_does_not_pack(backend: TorchBackend) -> None:
    forward = FusedForward(backend.model("minilm"))
    ids, lengths = _batch(100)
    assert forward.kinds == ["sdpa"]  # off the GPU
    assert not forward.packs(*ids.shape)
    with pytest.raises(ValueError, match="cannot run packed rows"):
        forward(ids, lengths, 64)


def test_token_ladder() -> None:
    assert token_ladder(8, 128) == []  # 1024 tokens: stays padded
    # Steps of B * L / 16 from half up; then B * L - 1 (any batch with a row
    # short of full) and B * L (every row full: its own graph, no mask).
    steps = [8192 + 1024 * i for i in range(8)]
    assert token_ladder(128, 128) == [*steps, 16383, 16384]
    full = 256 * 512
    ladder = token_ladder(256, 512)
    assert ladder[-2:] == [full - 1, full] and ladder[0] == full // 2
    assert len(ladder) == 10
    for batch, length in ((32, 128), (170, 96), (256, 16), (3, 4096)):
        ladder = token_ladder(batch, length)
        assert ladder[-2:] == [batch * length - 1, batch * length]
        assert batch * length >= PACK_MIN_TOKENS
        assert ladder == sorted(set(ladder)) and ladder[0] >= batch * length // 2
        # one row short of full never reaches the top rung
        short = packed_tokens([length] * (batch - 1) + [length - 1], batch)
        assert short == batch * length - 1


def test_packed_tokens_count_every_row() -> None:
    assert packed_tokens([5, 0, 3], 3) == 9  # an empty row holds a [PAD]
    assert packed_tokens([5, 0, 3], 8) == 14  # 5 padding rows, 1 token each


# Preloading tiles that fit MiniLM (K = 384 and 1536) in at most 4 chunks.
PRELOADED = {
    "qkv": LinearConfig(16, 32, 128, 1, preload=True),
    "ffn_in": LinearConfig(32, 64, 128, 1, preload=True),
}
# split -> (out's tiles, FFN-out's tiles): (block_m, block_n, K chunk).
PRELOADED_SPLIT = {
    split: tuple(LinearConfig(16, 32, chunk, split, preload=True) for chunk in chunks)
    for split, chunks in {1: (128, 512), 2: (64, 256), 3: (128, 128)}.items()
}


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_few_token_gemm_plan_equals_cublas_path(
    backend: TorchBackend, split: int, preload: bool
) -> None:
    served = backend.model("minilm")  # hidden 384, inner 1536
    forward = FusedForward(served)
    ids, lengths = _batch(served.encoder.config.vocab_size)
    tokens = ids.numel()
    with torch.inference_mode():
        plain = forward(ids, lengths)
        tiles = LinearConfig(16, 32, 64, split)
        plan = {
            "qkv": LinearConfig(16, 32, 64, 1),
            "out": tiles,
            "ffn_in": LinearConfig(32, 64, 64, 1),
            "ffn_out": tiles,
        }
        if preload:
            out, ffn_out = PRELOADED_SPLIT[split]
            plan = {**PRELOADED, "out": out, "ffn_out": ffn_out}
            assert out.fits(384) and ffn_out.fits(1536)
            forward.preloaded[tuple(ids.shape)] = True
        forward._plans[(tokens, preload)] = plan
        planned = forward(ids, lengths)
    torch.testing.assert_close(planned, plain, rtol=1e-4, atol=1e-5)


def test_preloading_tiles_fit_their_models() -> None:
    """Every PRELOAD_LINEAR row fits its projection's K in at most
    PRELOAD_CHUNKS chunks, and each table covers all four projections at
    every token count (a plan missing one is no plan: small_linear_plan)."""
    dims = {768: 3072, 384: 1536}
    limits = {}
    for (name, hidden), rows in PRELOAD_LINEAR.items():
        k = dims[hidden] if name == "ffn_out" else hidden
        for limit, config in rows:
            assert config.preload and config.fits(k), (name, hidden, limit)
        limits[(name, hidden)] = [limit for limit, _ in rows]
    for hidden in dims:
        assert len({tuple(limits[(n, hidden)]) for n in PROJECTIONS}) == 1
    assert not LinearConfig(16, 32, 64, 1, preload=True).fits(384)  # 6 chunks
    assert LinearConfig(16, 32, 64, 1).fits(384)


def test_choose_plan_times_nothing_off_the_gpu(
    backend: TorchBackend,
) -> None:
    forward = FusedForward(backend.model("minilm"))
    assert not forward.preload_eligible(16)
    assert forward.choose_plan(1, 16) is False
    assert forward.preloaded[(1, 16)] is False
    weight = forward.encoder.embeddings.word.weight
    assert small_linear_plan(weight, 16, 384, 1536, preload=True) == {}


def test_few_token_plan_is_empty_off_the_gpu(backend: TorchBackend) -> None:
    weight = backend.model("minilm").encoder.embeddings.word.weight
    assert small_linear_plan(weight, 128, 384, 1536) == {}


def test_attention_reads_an_empty_row_as_one_token() -> None:
    """A batch's padding rows have length 0; the attention kernel takes the
    raw lengths (no clamp kernel in the graph) and reads 0 as 1 key."""
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(3 * 8, 3 * 2 * 16, generator=generator)
    empty = attention(qkv, torch.tensor([8, 0, 5]), 3, 8, 2)
    one = attention(qkv, torch.tensor([8, 1, 5], dtype=torch.int32), 3, 8, 2)
    assert torch.isfinite(empty).all()
    torch.testing.assert_close(empty, one)


def test_layer_norm_of_partials_takes_no_partials() -> None:
    """A product that added the residual itself (cuBLAS with beta = 1, the
    large-batch layers) leaves LayerNorm(residual + bias) to finish."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(11)
    residual = torch.randn(5, 24, generator=generator)
    bias, weight, ln_bias = torch.randn(3, 24, generator=generator)
    want = F.layer_norm(residual + bias, (24,), weight, ln_bias, 1e-12)
    got = add_layer_norm_partials(None, bias, residual, weight, ln_bias, 1e-12)
    torch.testing.assert_close(got, want)
    parts = torch.randn(2, 5, 24, generator=generator)
    summed = add_layer_norm_partials(parts, bias, residual, weight, ln_bias, 1e-12)
    torch.testing.assert_close(
        summed,
        F.layer_norm(parts.sum(0) + residual + bias, (24,), weight, ln_bias, 1e-12),
    )


def test_mean_pool_writes_into_the_buffer_it_is_given() -> None:
    """The zero-copy graphs hand the pooling their pinned output buffer."""
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 8, 16, generator=generator)
    lengths = torch.tensor([8, 0, 3])
    out = torch.full((3, 16), float("nan"))
    assert mean_pool(hidden, lengths, out=out) is out
    torch.testing.assert_close(out, mean_pool(hidden, lengths))
    assert torch.equal(out[1], torch.zeros(16))
    with pytest.raises(ValueError, match=r"float32 \[3, 16\]"):
        mean_pool(hidden, lengths, out=torch.empty(3, 8))


def test_tuned_products_are_none_off_the_gpu(backend: TorchBackend) -> None:
    """cuBLASLt's timed products (engine/cuda/products.HalfGemm) are made only for
    weights on a GPU: on the CPU every layer keeps torch's, on or off."""
    from engine.cuda.products import half_gemm

    served = backend.model("minilm")
    for tuned in (True, False):
        forward = FusedForward(served, fp16_tuned=tuned)
        assert forward.half == [None] * len(forward.layers)
    assert half_gemm(served.encoder.layers[0].ffn_in) is None
    assert half_gemm(torch.nn.LayerNorm(8)) is None  # no nn.Linear


def test_the_tile_tables_load_checked_and_a_bad_file_is_refused(
    tmp_path: Path,
) -> None:
    """engine/cuda/tuning/sm_90.json is the Hopper tables; a device kind with
    no file has none (cuBLAS everywhere); a file with a bad entry stops the
    engine naming the file and the entry."""
    from engine.cuda import tiles

    hopper = tiles.tables_for((9, 0))
    assert hopper is tiles.tables_for((9, 0))  # one object: a search edits it
    assert hopper.preload is PRELOAD_LINEAR
    assert set(PRELOAD_LINEAR) == {(p, h) for p in PROJECTIONS for h in (384, 768)}
    assert all(config.preload for rows in PRELOAD_LINEAR.values() for _, config in rows)
    assert not any(c.preload for rows in hopper.small.values() for _, c in rows)
    assert tiles.tables_for((8, 0)) == tiles.TileTables({}, {})
    good = json.loads((tiles.TUNING / "sm_90.json").read_text())
    bad = dict(good, small_linear={"qkv/768": [{"up_to_tokens": 16, "block_m": 24}]})
    path = tmp_path / "sm_99.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(tiles.TuningError, match=r"sm_99.json: 'qkv/768' up to 16"):
        tiles.load(path)
    rising = [{"up_to_tokens": n, "block_m": 16} for n in (32, 16)]
    path.write_text(json.dumps(dict(good, preload_linear={"out/384": rising})))
    with pytest.raises(tiles.TuningError, match="token counts must rise"):
        tiles.load(path)
