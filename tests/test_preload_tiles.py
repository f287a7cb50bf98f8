"""benchmarks/preload_tiles.py's neighbours: only tiles the kernel can run."""

from __future__ import annotations

import pytest

from benchmarks.preload_tiles import SHARED_BYTES, neighbours, shared_bytes
from engine.cuda.tiles import PRELOAD_CHUNKS, PRELOAD_LINEAR, LinearConfig


def test_shared_bytes_match_what_the_compiler_asked() -> None:
    """What Triton 3.6 asked for on sm_90a: QKV's 128 x 32 tile
    at 128 tokens 180,224 bytes; FFN-out on 128 columns 262,144 (refused)."""
    assert shared_bytes(LinearConfig(128, 32, 256, 1, 8, preload=True), 768) == 180224
    ffn_out = LinearConfig(128, 128, 256, 6, 8, preload=True)
    assert shared_bytes(ffn_out, 3072) == 262144 > SHARED_BYTES


@pytest.mark.parametrize("hidden", [384, 768])
@pytest.mark.parametrize("projection", ["qkv", "out", "ffn_in", "ffn_out"])
def test_neighbours_fit_and_differ(projection: str, hidden: int) -> None:
    k = 4 * hidden if projection == "ffn_out" else hidden
    for limit, config in PRELOAD_LINEAR[(projection, hidden)]:
        found = neighbours(config, projection, k, limit)
        assert found, (projection, hidden, limit)
        for name, tile in found.items():
            assert tile != config, name
            assert tile.fits(k), name
            assert k // tile.split // tile.block_k <= PRELOAD_CHUNKS, name
            assert shared_bytes(tile, k) <= SHARED_BYTES, name
            assert tile.block_m <= max(16, limit), name
            assert tile.warps in (4, 8), name
            if projection in ("qkv", "ffn_in"):
                assert tile.split == 1, name


def test_neighbours_reach_attention_outs_searched_tiles() -> None:
    """Attention-out's 64 columns at 128 tokens, and its 4 slices of 64-wide
    chunks at 16, are one step from the tiles they were searched from."""
    before_128 = LinearConfig(64, 32, 128, 2, 4, preload=True)
    found = neighbours(before_128, "out", 768, 128).values()
    assert LinearConfig(64, 64, 128, 2, 4, preload=True) in found
    before_16 = LinearConfig(16, 32, 128, 2, 4, preload=True)
    found = neighbours(before_16, "out", 768, 16).values()
    assert LinearConfig(16, 32, 64, 4, 4, preload=True) in found


def test_the_searched_tiles_are_a_step_from_their_neighbours() -> None:
    """The few-token tiles the tile search chose are what it timed: one step
    from the tile each replaced, and that tile one step from them (each
    check timed the other tile as the chosen one's neighbour)."""
    taken = [
        ("out", 768, 16, LinearConfig(16, 64, 64, 4, 4, preload=True)),
        ("out", 768, 32, LinearConfig(32, 64, 64, 4, 4, preload=True)),
        ("ffn_in", 768, 64, LinearConfig(64, 32, 256, 1, 4, preload=True)),
        ("ffn_out", 3072, 16, LinearConfig(16, 64, 256, 6, 8, preload=True)),
        ("ffn_out", 3072, 64, LinearConfig(64, 64, 256, 6, 4, preload=True)),
    ]
    for projection, k, tokens, before in taken:
        table = PRELOAD_LINEAR[(projection, 768)]
        now = next(config for limit, config in table if tokens <= limit)
        assert now != before
        assert now in neighbours(before, projection, k, tokens).values()
        assert before in neighbours(now, projection, k, tokens).values()
