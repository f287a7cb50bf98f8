"""berth's encoder against transformers' on tiny random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.cuda.graphs import capturing
from engine.encoder import EncoderLoadError, load_encoder
from engine.heads import ClassifierHead, MeanPooling

VOCAB = 120
LENGTHS = [7, 16, 1, 11, 3]


def _config(model_type: str, act: str) -> Any:
    import transformers as tf

    if model_type == "distilbert":
        return tf.DistilBertConfig(
            vocab_size=VOCAB,
            dim=48,
            n_layers=2,
            n_heads=4,
            hidden_dim=96,
            max_position_embeddings=40,
            activation=act,
        )
    kinds = {
        "bert": tf.BertConfig,
        "roberta": tf.RobertaConfig,
        "xlm-roberta": tf.XLMRobertaConfig,
    }
    return kinds[model_type](
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        hidden_act=act,
        pad_token_id=0 if model_type == "bert" else 1,
    )


# (model_type, transformers class, activation, shard the checkpoint)
CASES = [
    ("bert", "AutoModel", "gelu", False),
    ("bert", "AutoModelForMaskedLM", "gelu_new", True),  # `bert.` prefix
    ("distilbert", "AutoModel", "gelu", False),
    ("distilbert", "AutoModelForSequenceClassification", "relu", False),
    ("roberta", "AutoModel", "gelu", False),
    ("roberta", "AutoModelForMaskedLM", "gelu", True),  # `roberta.` prefix
    ("xlm-roberta", "AutoModel", "gelu", False),
]


def _checkpoint(
    tmp_path: Path, model_type: str, kind: str, act: str, shard: bool
) -> tuple[Any, Any]:
    """Save a tiny random model; return its base model and config."""
    import transformers as tf

    torch.manual_seed(0)
    config = _config(model_type, act)
    config._attn_implementation = "eager"  # the textbook reference
    model = getattr(tf, kind).from_config(config).eval()
    size = "20KB" if shard else "1GB"
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size=size)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    base = getattr(model, model.base_model_prefix, model)
    return base, config


@pytest.mark.parametrize(("model_type", "kind", "act", "shard"), CASES)
def test_hidden_states_match_transformers(
    tmp_path: Path, model_type: str, kind: str, act: str, shard: bool
) -> None:
    reference, config = _checkpoint(tmp_path, model_type, kind, act, shard)
    ours = load_encoder(tmp_path)
    pad_id = config.pad_token_id if model_type != "distilbert" else 0
    batch, length = len(LENGTHS), max(LENGTHS)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (batch, length), generator=generator)
    real = torch.arange(length)[None, :] < torch.tensor(LENGTHS)[:, None]

    hf_ids = torch.where(real, tokens, pad_id)
    with torch.inference_mode():
        expected = reference(
            input_ids=hf_ids, attention_mask=real.long()
        ).last_hidden_state
        # berth's contract: padded with 0, int32, lengths per row.
        our_ids = torch.where(real, tokens, 0).int()
        got = ours(our_ids, torch.tensor(LENGTHS, dtype=torch.int32))

    assert got.shape == expected.shape
    diff = (got - expected).abs()[real]  # real positions only
    assert diff.max().item() < 1e-4


def test_empty_rows_stay_finite_and_do_not_change_others(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "bert", "AutoModel", "gelu", False)
    encoder = load_encoder(tmp_path)
    ids = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        alone = encoder(ids[:1], torch.tensor([5], dtype=torch.int32))
        padded = encoder(ids, torch.tensor([5, 0, 8], dtype=torch.int32))
        pooled = MeanPooling()(padded, torch.tensor([5, 0, 8]))
    assert torch.isfinite(padded).all() and torch.isfinite(pooled).all()
    assert torch.allclose(alone[0, :5], padded[0, :5], atol=1e-5)


def test_half_precision_runs(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "roberta", "AutoModel", "gelu", False)
    full = load_encoder(tmp_path)
    half = load_encoder(tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([6, 4], dtype=torch.int32)
    with torch.inference_mode():
        a = MeanPooling()(full(ids, lengths), lengths)
        b = MeanPooling()(half(ids, lengths), lengths)
    assert b.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(a, b).min().item() > 0.99


def test_too_long_for_positions(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "roberta", "AutoModel", "gelu", False)
    encoder = load_encoder(tmp_path)  # 40 positions - (pad 1 + 1) = 38 tokens
    assert encoder.config.max_length == 38
    with pytest.raises(ValueError, match="over the model's 38 positions"):
        encoder(torch.ones(1, 39, dtype=torch.int32), torch.tensor([39]))


def test_unsupported_checkpoints_say_why(tmp_path: Path) -> None:
    with pytest.raises(EncoderLoadError, match="config.json"):
        load_encoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(EncoderLoadError, match="'gpt2' is not supported"):
        load_encoder(tmp_path)
    _checkpoint(tmp_path, "bert", "AutoModel", "gelu", False)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(EncoderLoadError, match="never loads pickled weights"):
        load_encoder(tmp_path)


def test_one_vs_rest_head_matches_sklearn_rule() -> None:
    weight, bias = torch.randn(4, 3), torch.randn(4)
    head = ClassifierHead(weight, bias, probability="ovr")
    x = torch.randn(2, 3)
    scores = torch.sigmoid(x @ weight.T + bias)
    expected = scores / scores.sum(dim=1, keepdim=True)
    assert torch.allclose(head(x), expected, atol=1e-6)
    assert torch.allclose(head(x).sum(dim=1), torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert"])
def test_cuda_half_precision_in_a_cuda_graph(tmp_path: Path, model_type: str) -> None:
    reference, config = _checkpoint(tmp_path, model_type, "AutoModel", "gelu", False)
    encoder = load_encoder(tmp_path, device="cuda", dtype=torch.float16)
    pool = MeanPooling()
    batch, length = len(LENGTHS) + 1, 16  # one empty row, as in a padded bucket
    ids = torch.zeros(batch, length, dtype=torch.int32, device="cuda")
    lengths = torch.zeros(batch, dtype=torch.int32, device="cuda")

    # Warm up on a side stream, then capture the whole forward once.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        pool(encoder(ids, lengths), lengths)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), capturing(graph):
        pooled = pool(encoder(ids, lengths), lengths)

    tokens = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator())
    real_lengths = torch.tensor([*LENGTHS, 0], dtype=torch.int32)
    real = torch.arange(length)[None, :] < real_lengths[:, None]
    ids.copy_(torch.where(real, tokens, 0))
    lengths.copy_(real_lengths)
    graph.replay()
    torch.cuda.synchronize()

    pad_id = config.pad_token_id if model_type != "distilbert" else 0
    with torch.inference_mode():
        hidden = reference(
            input_ids=torch.where(real, tokens, pad_id)[:-1],
            attention_mask=real.long()[:-1],
        ).last_hidden_state
        expected = pool(hidden, real_lengths[:-1])
    got = pooled.cpu()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got[:-1] - expected).abs().max().item() < 2e-2
    assert torch.nn.functional.cosine_similarity(got[:-1], expected).min() > 0.999
