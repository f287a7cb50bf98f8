"""Quantization: scale arithmetic, the INT8 and FP8 linears, calibration, accuracy."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from engine import quant
from engine.build import calibration, quantize
from engine.encoder import Encoder, EncoderConfig
from engine.model import ServedModel, load_served_model
from services.repository import ModelEntry, load_repository

TINY = EncoderConfig("bert", 200, 64, 2, 4, 128, 64, "gelu", 1e-12, 0)


def _tiny_model() -> ServedModel:
    torch.manual_seed(0)
    entry = ModelEntry(name="tiny", task="embed", checkpoint="")
    return ServedModel(entry, Encoder(TINY)).eval().requires_grad_(False)


def _tiny_batches(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(1, 200, (4, 16), generator=gen, dtype=torch.int32),
            torch.tensor([16, 9, 3, 0], dtype=torch.int32),
        )
        for _ in range(count)
    ]


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


# ---- the calibration texts -------------------------------------------------


def test_calibration_texts_are_real_and_disjoint() -> None:
    calib, held_out = calibration.calibration_texts(), calibration.evaluation_texts()
    assert len(calib) == calibration.CALIBRATION_COUNT
    assert len(held_out) >= 500
    assert not set(calib) & set(held_out)
    assert all(t.strip() and not t.startswith("#") for t in calib + held_out)
    assert len({len(t.split()) for t in held_out}) > 30  # varied lengths


def test_texts_are_labelled_utterance_or_prose(tmp_path: Path) -> None:
    kinds = calibration.evaluation_kinds()
    assert len(kinds) == len(calibration.evaluation_texts())
    labelled = calibration.read_labelled()
    assert [k for k, _ in labelled].count("utterance") == 680  # as built (header)
    assert [k for k, _ in labelled].count("prose") == 360
    assert kinds.count("utterance") >= 500
    bad = tmp_path / "texts.txt"
    bad.write_text("# a comment\nutterance\tset a timer\nset an alarm\n")
    with pytest.raises(ValueError, match=r"texts.txt:3: not '<utterance\|prose>"):
        calibration.read_labelled(bad)


def test_intent_agreement_counts_utterances_apart() -> None:
    reference = np.eye(4)[[0, 1, 2, 3]]
    probs = np.eye(4)[[0, 1, 3, 3]]  # the third text (prose) flips
    kinds = ["utterance", "utterance", "prose", "utterance"]
    got = calibration.intent_agreement(probs, reference, kinds)
    assert got == {
        "intent_agreement": 0.75,
        "intent_disagreements": 1,
        "intent_agreement_utterances": 1.0,
        "intent_disagreements_utterances": 0,
    }


def test_pad_batches_groups_by_bucket_and_restores_order() -> None:
    seqs = [[1] * n for n in (3, 9, 4, 17, 1)]
    batches = calibration.pad_batches(seqs, [4, 8, 32], batch_size=2)
    assert [b.ids.shape for b in batches] == [(2, 4), (1, 4), (2, 32)]
    for b in batches:
        assert b.ids.dtype == np.int32 and b.lengths.dtype == np.int32
        for row, length in enumerate(b.lengths):
            assert b.ids[row, :length].all() and not b.ids[row, length:].any()
    outputs = (b.lengths[:, None].astype(np.float32) for b in batches)
    restored = calibration.gather_rows(batches, outputs)
    assert restored[:, 0].tolist() == [3, 9, 4, 17, 1]
    with pytest.raises(ValueError, match="truncate"):
        calibration.pad_batches([[1] * 40], [32], 2)


# ---- scale arithmetic (the reference for the GPU path) ---------------------


def test_weight_scales_map_row_max_to_the_format_max() -> None:
    w = torch.tensor([[1.0, -4.0, 2.0], [0.5, 0.25, -0.125], [0.0, 0.0, 0.0]])
    assert torch.allclose(quant.int8_weight_scales(w)[:2], torch.tensor([4, 0.5]) / 127)
    assert torch.allclose(quant.fp8_weight_scales(w)[:2], torch.tensor([4, 0.5]) / 448)
    assert (quant.fp8_weight_scales(w) > 0).all()  # an all-zero row: no 0/0
    w8, scales = quant.fp8_weight(w)
    assert w8.dtype == torch.float8_e4m3fn
    assert w8.float()[0].abs().max() == 448.0
    assert torch.allclose(w8.float() * scales[:, None], w, rtol=2**-4)


def test_e4m3_saturates_instead_of_nan() -> None:
    x = torch.tensor([1e6, -1e6, 0.0, 1.0, float("inf")])
    q = quant.quantize_e4m3(x, torch.tensor(1.0)).float()
    assert q.tolist() == [448.0, -448.0, 0.0, 1.0, 448.0]
    assert quant.fp8_input_scale(448.0) == 1.0
    assert quant.fp8_input_scale(0.0) > 0


def test_smoothing_moves_input_outliers_into_weights() -> None:
    x_max = torch.tensor([100.0, 1.0, 1.0])
    w = torch.ones(4, 3)
    s = quantize.smoothing_factors(x_max, w, alpha=0.5)
    assert torch.allclose(s, torch.tensor([10.0, 1.0, 1.0]))


# ---- the layers ------------------------------------------------------------


@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_linear_matches_linear(rowwise: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(5, 7, 64)
    fp8 = quant.Fp8Linear(linear, float(x.abs().max()), rowwise, torch.float32)
    with torch.inference_mode():
        got, want = fp8(x), linear(x)
    assert got.shape == want.shape == (5, 7, 32)
    assert _cos(got, want).min() > 0.995
    assert fp8.weight8.dtype == torch.float8_e4m3fn
    # one scale per output channel, else one for the weight
    assert fp8.weight_scale.shape == ((1, 32) if rowwise else ())
    assert fp8.static_tensorwise is not rowwise


def test_fp8_linear_takes_e4m3_input_in_its_own_scale() -> None:
    """What the fused forward's LayerNorm and GELU kernels hand it: the same
    product as from the fp16 input it quantizes itself."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(6, 64)
    fp8 = quant.Fp8Linear(linear, float(x.abs().max()), out_dtype=torch.float32)
    x8 = quant.quantize_e4m3(x, fp8.input_inv_scale)
    with torch.inference_mode():
        assert torch.equal(fp8(x8), fp8(x))
        assert _cos(fp8(x8), linear(x)).min() > 0.995


def test_fp8_per_token_scales_keep_small_rows_precise() -> None:
    """A token 1e5x larger than the rest ruins a static scale for the others
    (they fall under e4m3's smallest steps); per-token scales do not care."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    x[0] *= 1e5
    amax = float(x.abs().max())
    static = quant.Fp8Linear(linear, amax, True, torch.float32)
    dynamic = quant.Fp8Linear(linear, amax, True, torch.float32, dynamic=True)
    with torch.inference_mode():
        want = linear(x)[1:]
        err_static = (static(x)[1:] - want).abs().mean()
        err_dynamic = (dynamic(x)[1:] - want).abs().mean()
    assert _cos(dynamic(x), linear(x)).min() > 0.995
    assert err_dynamic < 0.2 * err_static
    with pytest.raises(ValueError, match="row-wise"):
        quant.Fp8Linear(linear, amax, False, torch.float32, dynamic=True)


@pytest.mark.parametrize("rowwise", [False, True])
def test_gptq_rounds_for_the_product_not_each_weight(rowwise: bool) -> None:
    """On inputs with correlated channels (as a LayerNorm's are), GPTQ's codes
    give products closer to the exact weight's than nearest rounding does,
    on held-out inputs too; the codes stay e4m3 in the weight's own scale."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=gen)
    calib = torch.randn(2048, 64, generator=gen) @ mix
    held_out = torch.randn(512, 64, generator=gen) @ mix
    weight = torch.randn(48, 64, generator=gen)
    nearest, scale = quant.fp8_weight(weight, rowwise)
    codes = quantize.gptq_e4m3(weight, calib.t() @ calib, scale)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == weight.shape
    assert codes.float().abs().max() <= 448.0
    columns = scale[:, None] if rowwise else scale

    def error(q: torch.Tensor, x: torch.Tensor) -> float:
        return float((x @ (weight - q.float() * columns).t()).norm())

    assert not torch.equal(codes.float(), nearest.float())
    ratios = [error(codes, x) / error(nearest, x) for x in (calib, held_out)]
    print(f"GPTQ / nearest product error: {ratios[0]:.3f}, held out {ratios[1]:.3f}")
    assert ratios[0] < 0.8 and ratios[1] < 0.85


def test_gptq_rounds_the_largest_inputs_first() -> None:
    """Input channels 100 times larger at one end than at the other, the
    largest last: rounded in their own order, the largest inputs' columns go
    last, with none left to take their errors; in act-order (the default)
    they go first, and the product's error is smaller, held out too."""
    gen = torch.Generator().manual_seed(0)
    mix, spread = torch.randn(64, 64, generator=gen), torch.logspace(-1, 1, 64)
    calib = (torch.randn(2048, 64, generator=gen) @ mix) * spread
    held_out = (torch.randn(512, 64, generator=gen) @ mix) * spread
    weight = torch.randn(48, 64, generator=gen)
    nearest, scale = quant.fp8_weight(weight, rowwise=False)
    gram = calib.t() @ calib
    ordered = quantize.gptq_e4m3(weight, gram, scale)
    plain = quantize.gptq_e4m3(weight, gram, scale, act_order=False)

    def error(q: torch.Tensor, x: torch.Tensor) -> float:
        return float((x @ (weight - q.float() * scale).t()).norm())

    for x in (calib, held_out):
        assert error(ordered, x) < 0.9 * error(plain, x) < 0.9 * error(nearest, x)


def test_gptq_ignores_inputs_never_seen() -> None:
    """A channel no calibration input used has X^T X's row and column zero:
    its weights spread no error and keep their nearest codes (they still
    count, should the channel fire), and the rest still round well."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=gen)
    x[:, 5] = 0.0
    weight = torch.randn(16, 32, generator=gen)
    nearest, scale = quant.fp8_weight(weight, rowwise=False)
    codes = quantize.gptq_e4m3(weight, x.t() @ x, scale)
    assert torch.isfinite(codes.float()).all()
    assert torch.equal(codes.float()[:, 5], nearest.float()[:, 5])
    exact = x @ weight.t()
    err_gptq = (x @ (codes.float() * scale).t() - exact).norm()
    assert err_gptq < (x @ (nearest.float() * scale).t() - exact).norm()


def test_gptq_falls_back_to_nearest_when_x_t_x_is_not_positive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An X^T X no damping makes positive definite (it cannot come from real
    inputs, but a load must not fail on it): nearest codes, logged."""
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    nearest, scale = quant.fp8_weight(weight, rowwise=False)
    with caplog.at_level("WARNING", logger="berth.engine"):
        codes = quantize.gptq_e4m3(weight, -torch.eye(16), scale)
    assert torch.equal(codes.float(), nearest.float())
    assert "rounded to nearest" in caplog.text


def test_fp8_linear_refuses_shapes_scaled_mm_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        quant.Fp8Linear(nn.Linear(24, 32), 1.0)


def test_int8_linear_matches_linear() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 10, 64)
    for smooth in (None, torch.rand(64) + 0.5):
        int8 = quant.Int8DynamicLinear(linear, smooth)
        with torch.inference_mode():
            got, want = int8(x), linear(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert _cos(got, want).min() > 0.995


def test_record_input_amax_sees_every_linear_and_cleans_up() -> None:
    model = _tiny_model()
    amax = quantize.record_input_amax(model, _tiny_batches())
    names = [name for name, _ in quant.encoder_linears(model)]
    assert sorted(amax) == sorted(names) and len(names) == 4 * TINY.num_layers
    assert all(
        a.shape == (m.in_features,)
        for (_, m), a in zip(
            quant.encoder_linears(model), (amax[n] for n in names), strict=True
        )
    )
    for _, module in quant.encoder_linears(model):
        assert not module._forward_pre_hooks
    with pytest.raises(ValueError, match="at least one batch"):
        quantize.record_input_amax(model, [])


def test_quantize_int8_replaces_encoder_linears_only() -> None:
    model = _tiny_model()
    reference = copy.deepcopy(model)
    assert quantize.quantize_int8_cpu(model, _tiny_batches()) == 4 * TINY.num_layers
    assert not quant.encoder_linears(model)
    ids, lengths = _tiny_batches(1)[0]
    with torch.inference_mode():
        got, want = model(ids, lengths), reference(ids, lengths)
    assert _cos(got[:3], want[:3]).min() > 0.99
    assert torch.isfinite(got).all()


def test_record_inputs_weighs_only_real_tokens() -> None:
    """X^T X (GPTQ's weights) counts each real token's row once: padded
    positions and empty rows add nothing; the max |x| sees them all."""
    ids, lengths = _tiny_batches(1)[0]
    _, gram = quantize.record_inputs(_tiny_model(), [(ids, lengths)], hessians=True)
    padded = torch.cat([ids, torch.randint(1, 200, (2, 16), dtype=torch.int32)])
    longer = torch.cat([lengths, torch.tensor([0, 0], dtype=torch.int32)])
    _, same = quantize.record_inputs(_tiny_model(), [(padded, longer)], hessians=True)
    names = [name for name, _ in quant.encoder_linears(_tiny_model())]
    assert sorted(gram) == sorted(same) == sorted(names)
    for name in names:
        torch.testing.assert_close(gram[name], same[name], rtol=1e-4, atol=1e-3)
    # the first QKV's input is the embeddings' LayerNorm: 28 real rows of it
    model = _tiny_model()
    with torch.inference_mode():
        real = torch.arange(16)[None, :] < lengths[:, None]
        rows = model.encoder.embeddings(ids)[real]
    assert rows.shape[0] == int(lengths.sum())
    qkv = "encoder.layers.0.attention.qkv"
    torch.testing.assert_close(gram[qkv], rows.t() @ rows, rtol=1e-4, atol=1e-3)
    assert quantize.record_inputs(_tiny_model(), [(ids, lengths)])[1] == {}


def test_quantize_fp8_on_the_reference_path() -> None:
    model = _tiny_model()
    reference = copy.deepcopy(model)
    assert quantize.quantize_fp8(model, _tiny_batches()) == 4 * TINY.num_layers
    assert isinstance(model.get_submodule("encoder.layers.0.ffn_in"), quant.Fp8Linear)
    kept = copy.deepcopy(reference)
    assert quantize.quantize_fp8(kept, _tiny_batches(), keep=frozenset({"out"})) == 6
    out = kept.get_submodule("encoder.layers.0.attention.out")
    assert isinstance(out, nn.Linear) and out.weight.dtype == torch.float16
    assert "rounding=gptq" in repr(model.get_submodule("encoder.layers.1.ffn_out"))
    norm = model.get_submodule("encoder.layers.0.norm1")
    # a float32 model runs in fp16 around its FP8 products, as the engine's does
    assert isinstance(norm, nn.LayerNorm) and norm.weight.dtype == torch.float16
    ids, lengths = _tiny_batches(1)[0]
    with torch.inference_mode():
        got, want = model(ids, lengths), reference(ids, lengths)
    assert got.dtype == torch.float32  # pooling upcasts
    assert _cos(got[:3], want[:3]).min() > 0.98


def test_the_engines_fused_forward_runs_fp8_layers() -> None:
    """The CUDA backend runs every model through engine/cuda/forward.py: quantized
    layers are called as modules there (their weights are not an nn.Linear's)."""
    from engine.cuda.forward import FusedForward

    for rowwise, keep in [
        (False, quantize.FP8_KEEP),
        (False, frozenset({"out"})),  # attention-out kept fp16 in an FP8 layer
        (True, quantize.FP8_KEEP),
    ]:
        model = _tiny_model()
        quantize.quantize_fp8(model, _tiny_batches(), rowwise=rowwise, keep=keep)
        ids, lengths = _tiny_batches(1)[0]
        forward = FusedForward(model)
        # tensor-wise layers run as FP8 layers, e4m3 written by their producers
        assert [p is not None for p in forward.fp8] == [not rowwise] * TINY.num_layers
        with torch.inference_mode():
            fused, plain = forward(ids, lengths), model(ids, lengths)
        real = lengths > 0
        assert torch.isfinite(fused).all()
        assert _cos(fused[real], plain[real]).min() > 0.999


def test_fp8_kernels_fall_back_to_what_they_compute() -> None:
    """engine/cuda/kernels' e4m3 writers off the GPU: act(x) / scale saturated at
    ±448 (tests/gpu checks the Triton kernels against the same on the H200)."""
    from engine.cuda import kernels

    x = torch.randn(8, 64) * 40
    inv = torch.tensor(4.0)
    q = kernels.quantize_e4m3(x, inv, kernels.ACT_GELU_TANH)
    gelu = torch.nn.functional.gelu(x, approximate="tanh")
    want = (gelu * 4.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.float(), want.float())
    assert q.float().abs().max() == 448.0  # saturated, no NaN
    relu = kernels.quantize_e4m3(x, inv, kernels.ACT_RELU).float()
    assert relu.min() == 0.0 and relu.abs().max() == 448.0
    # the LayerNorm: fp16 rows out, and e4m3 of the same float32 rows
    x16, r16 = x.half(), torch.randn(8, 64).half()
    w, b = torch.randn(64), torch.randn(64)
    out, out8 = kernels.add_layer_norm_e4m3(x16, r16, w, b, 1e-12, inv)
    rows = torch.nn.functional.layer_norm(x16.float() + r16.float(), (64,), w, b, 1e-12)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, rows.half())
    want8 = (rows * 4.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(out8.float(), want8.float())


def test_quantize_for_entry_checks_mode_and_device() -> None:
    entry: Any = SimpleNamespace(name="m", quantize="none")
    assert (
        quantize.quantize_for_entry(_tiny_model(), entry, torch.device("cpu")) == "none"
    )
    entry.quantize = "fp8"
    with pytest.raises(ValueError, match="runs on cuda"):
        quantize.quantize_for_entry(_tiny_model(), entry, torch.device("cpu"))
    entry.quantize = "int4"
    with pytest.raises(ValueError, match="must be one of"):
        quantize.quantize_for_entry(_tiny_model(), entry, torch.device("cpu"))


# ---- accuracy on the default intent model ----------------------------------


@pytest.fixture(scope="module")
def intent(repository: Path) -> ModelEntry:
    return load_repository(repository)["intent"]


def _outputs(model: nn.Module, batches: list[calibration.TokenBatch]) -> np.ndarray:
    with torch.inference_mode():
        parts = (
            model(torch.from_numpy(b.ids), torch.from_numpy(b.lengths)).float().numpy()
            for b in batches
        )
        return calibration.gather_rows(batches, parts)


def test_int8_keeps_intent_answers(intent: ModelEntry) -> None:
    """Full numbers: benchmarks/quant_cpu.py (784 texts, 98.3 % agreement)."""
    texts = calibration.evaluation_texts()[:160]
    batches = calibration.text_batches(intent.tokenizer_file, texts, [32, 64, 256], 32)
    model = load_served_model(intent)
    reference = _outputs(model, batches)
    entry: Any = SimpleNamespace(
        name=intent.name,
        quantize="int8",
        buckets=intent.buckets,
        tokenizer_file=intent.tokenizer_file,
    )
    assert quantize.quantize_for_entry(model, entry, torch.device("cpu")) == "int8"
    quantized = _outputs(model, batches)
    agreement = (quantized.argmax(1) == reference.argmax(1)).mean()
    print(f"int8 intent agreement on {len(texts)} texts: {agreement:.4f}")
    assert agreement >= 0.95
