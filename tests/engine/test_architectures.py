"""Every architecture berth's encoder loads, against transformers' own model.

Each case writes a tiny random checkpoint with transformers (its parameters
scrambled, so that LayerNorm weights, biases and MPNet's position bias all
count), loads it with ``load_encoder`` and compares the hidden states with
transformers' eager implementation in float32, on rows of several lengths:
1, the longest the positions allow, and for ModernBERT lengths past its
sliding window. The new architectures also serve through ``backend: auto``
on the CPU (onnxruntime, through berth's ONNX export) and, on a GPU, in the
CUDA runner's graphs: MPNet on the fused kernels (tests/engine/test_fused_mpnet.py),
ModernBERT as plain torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.backend import create_backend
from engine.backends_by_model import create_model_router
from engine.cuda.forward import FusedForward
from engine.cuda.plain import PlainForward, unfused_reason
from engine.encoder import Encoder, EncoderLoadError, load_encoder
from engine.model import load_served_model
from engine.onnx_backend import OnnxRuntimeBackend
from engine.torch_backend import TorchBackend
from services.repository import ModelEntry, position_limit

VOCAB = 160
WINDOW = 8  # ModernBERT's local_attention: keys within 4 positions
SMALL = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 48}


def _config(case: str) -> Any:
    import transformers as tf

    if case == "distilbert":
        return tf.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
            max_position_embeddings=40,
        )  # fmt: skip
    if case.startswith("modernbert"):
        biased = case == "modernbert-biased"
        return tf.ModernBertConfig(
            vocab_size=VOCAB, num_hidden_layers=4 if biased else 3,
            max_position_embeddings=40, local_attention=WINDOW,
            global_attn_every_n_layers=3 if biased else 2,
            global_rope_theta=1000.0, local_rope_theta=20.0,
            attention_bias=biased, mlp_bias=biased, norm_bias=biased,
            hidden_activation="gelu_pytorch_tanh" if biased else "gelu",
            pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
            sep_token_id=2, **SMALL,
        )  # fmt: skip
    if case == "mpnet":  # past 128 positions: the buckets' far end
        return tf.MPNetConfig(
            vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=160,
            **SMALL,
        )  # fmt: skip
    kinds = {
        "bert": tf.BertConfig,
        "roberta": tf.RobertaConfig,
        "xlm-roberta": tf.XLMRobertaConfig,
        "camembert": tf.CamembertConfig,
    }
    return kinds[case](
        vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=40,
        pad_token_id=0 if case == "bert" else 1, **SMALL,
    )  # fmt: skip


def _scramble(model: torch.nn.Module) -> None:
    """Random values everywhere: LayerNorm weights near 1, other tensors
    around their init; MPNet's relative position bias large enough to matter."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 1.0 if "relative_attention_bias" in name else 0.2
            param.add_(noise * scale)


def write_checkpoint(
    directory: Path, case: str, kind: str = "AutoModel"
) -> tuple[Any, Any]:
    """A tiny random ``case`` model saved as safetensors; (base model, config)."""
    import transformers as tf

    torch.manual_seed(0)
    config = _config(case)
    config._attn_implementation = "eager"  # the textbook reference
    model = getattr(tf, kind).from_config(config).eval()
    _scramble(model)
    model.save_pretrained(directory, safe_serialization=True)
    return getattr(model, model.base_model_prefix, model), config


def _pad_id(case: str, config: Any) -> int:
    # transformers derives RoBERTa's and MPNet's positions from the pad id.
    return 0 if case in ("distilbert", "bert") else int(config.pad_token_id)


def compare(reference: Any, ours: Encoder, pad_id: int) -> tuple[float, float]:
    """(max |diff| over real tokens / max |expected|, min mean-pooled cosine)
    of ``ours`` against ``reference`` on rows of lengths 1 to the longest."""
    longest = ours.config.max_length
    lengths = torch.tensor([1, 6, 17, longest, 9, 2])
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (len(lengths), longest), generator=generator)
    real = torch.arange(longest)[None, :] < lengths[:, None]
    with torch.inference_mode():
        expected = reference(
            input_ids=torch.where(real, tokens, pad_id), attention_mask=real.long()
        ).last_hidden_state
        # berth's contract: padded with 0, int32, lengths per row.
        got = ours(torch.where(real, tokens, 0).int(), lengths.int())
    assert got.shape == expected.shape and torch.isfinite(got).all()
    diff = (got - expected).abs()[real].max() / expected[real].abs().max()
    weights = real[..., None].float() / lengths[:, None, None]
    cosine = F.cosine_similarity((got * weights).sum(1), (expected * weights).sum(1))
    return diff.item(), cosine.min().item()


CASES = [
    ("bert", "AutoModel"),
    ("distilbert", "AutoModel"),
    ("roberta", "AutoModel"),
    ("xlm-roberta", "AutoModel"),
    ("camembert", "AutoModel"),
    ("mpnet", "AutoModel"),
    ("mpnet", "AutoModelForMaskedLM"),  # weights under `mpnet.`
    ("modernbert", "AutoModel"),
    ("modernbert", "AutoModelForMaskedLM"),  # weights under `model.`
    ("modernbert-biased", "AutoModel"),  # biases, tanh GELU, 1 global in 3
]


@pytest.mark.parametrize(("case", "kind"), CASES)
def test_hidden_states_equal_transformers(tmp_path: Path, case: str, kind: str) -> None:
    reference, config = write_checkpoint(tmp_path, case, kind)
    ours = load_encoder(tmp_path)
    assert ours.config.model_type == config.model_type
    assert position_limit(tmp_path) == ours.config.max_length
    diff, cosine = compare(reference, ours, _pad_id(case, config))
    print(f"{case} ({kind}): max |diff| {diff:.1e} of max |h|, min cos {cosine}")
    assert diff <= 1e-5
    assert cosine >= 0.99999


def test_modernbert_reads_the_older_config_names(tmp_path: Path) -> None:
    """Checkpoints written by transformers 4 say global_rope_theta,
    local_rope_theta and global_attn_every_n_layers (no layer_types,
    rope_parameters); a null local_rope_theta is the global one."""
    reference, config = write_checkpoint(tmp_path, "modernbert")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"]["sliding_attention"]["rope_theta"] == 20.0
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw |= {"global_rope_theta": 1000.0, "local_rope_theta": 20.0}
    raw["global_attn_every_n_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_encoder(tmp_path)
    assert ours.config.local_layers == (False, True, False)
    assert compare(reference, ours, 0)[0] <= 1e-5
    raw["local_rope_theta"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_encoder(tmp_path).config.local_rope_theta == 1000.0


def test_modernbert_local_layers_see_only_their_window(tmp_path: Path) -> None:
    """A token past the window of a local layer's query changes nothing there
    in a model of local layers only; a global layer sees it."""
    write_checkpoint(tmp_path, "modernbert")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["layer_types"] = ["sliding_attention"] * 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    local = load_encoder(tmp_path)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[0, 29] = (ids[0, 29] + 1) % VOCAB
    lengths = torch.tensor([30])
    with torch.inference_mode():
        a, b = local(ids, lengths), local(changed, lengths)
    reach = 3 * WINDOW // 2  # three layers, each 4 positions further
    assert torch.equal(a[0, : 29 - reach], b[0, : 29 - reach])
    assert not torch.equal(a[0, 29 - reach :], b[0, 29 - reach :])


@pytest.mark.parametrize("case", ["mpnet", "modernbert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lower_precision(tmp_path: Path, case: str, dtype: torch.dtype) -> None:
    write_checkpoint(tmp_path, case)
    full, half = load_encoder(tmp_path), load_encoder(tmp_path, dtype=dtype)
    ids = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([24, 11, 0], dtype=torch.int32)  # 0: batch padding
    with torch.inference_mode():
        a, b = full(ids, lengths), half(ids, lengths)
    assert b.dtype == dtype and torch.isfinite(b).all()
    cosine = F.cosine_similarity(a[:2, :11].flatten(1), b[:2, :11].float().flatten(1))
    assert cosine.min().item() > 0.99


def test_unsupported_settings_say_why(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "modernbert")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"]["full_attention"]["rope_type"] = "yarn"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EncoderLoadError, match="rotary scaling 'yarn'"):
        load_encoder(tmp_path)
    write_checkpoint(tmp_path, "mpnet")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["relative_attention_num_buckets"] = 16
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EncoderLoadError, match="into 32"):
        load_encoder(tmp_path)


def _entry(directory: Path, case: str, backend: str = "auto") -> ModelEntry:
    ours = load_encoder(directory)
    return ModelEntry(
        name=case,
        task="embed",
        checkpoint=str(directory),
        root="/",
        backend=backend,
        max_tokens=ours.config.max_length,
    )


def _batch(longest: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    lengths = np.array([longest, 1, 0, 13, 2], dtype=np.int32)
    ids = rng.integers(3, VOCAB, (len(lengths), longest)).astype(np.int32)
    ids[np.arange(longest)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


@pytest.mark.parametrize("case", ["mpnet", "modernbert"])
def test_auto_serves_them_on_onnxruntime_on_the_cpu(tmp_path: Path, case: str) -> None:
    """backend auto on the CPU is onnxruntime, through berth's ONNX export of
    the encoder: the same answers as the torch backend."""
    checkpoint = tmp_path / "checkpoint"
    write_checkpoint(checkpoint, case)
    entry = _entry(checkpoint, case)

    def factory(name: str, device: str) -> Any:
        if name == "onnxruntime":
            return OnnxRuntimeBackend(device, threads=1, cache=tmp_path / "cache")
        return create_backend(name, device)

    router = create_model_router({case: entry}, "torch", "cpu", factory)
    assert router.chosen == {case: "onnxruntime"}
    router.load(entry)
    torch_backend = TorchBackend("cpu")
    torch_backend.load(entry)
    ids, lengths = _batch(entry.max_tokens)
    got, want = router.run(case, ids, lengths), torch_backend.run(case, ids, lengths)
    assert got.shape == want.shape == (5, 32)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_fused_kernels_refuse_modernbert_and_the_gpu_runner_runs_it_plain(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """engine/cuda's runner gives ModernBERT the plain forward, and
    its graph step computes what the served model computes (here on the
    CPU, through a stand-in for the CUDA backend's settings)."""
    from engine.cuda.runner import ModelRunner

    write_checkpoint(tmp_path / "bert", "bert")
    assert unfused_reason(load_served_model(_entry(tmp_path / "bert", "bert"))) is None
    backend: Any = SimpleNamespace(
        pdl=False, input_mode="zero-copy", pack=True, pool=None,
        stream=SimpleNamespace(device_index=0, cuda_stream=0),
        torch_device=torch.device("cpu"),
    )  # fmt: skip
    for case in ("modernbert",):
        write_checkpoint(tmp_path / case, case)
        served = load_served_model(_entry(tmp_path / case, case))
        reason = unfused_reason(served)
        assert reason is not None and case in reason
        with pytest.raises(ValueError, match="fused kernels compute"):
            FusedForward(served)
        with caplog.at_level("WARNING", logger="berth.engine"):
            runner = ModelRunner(served, backend, gelu_epilogue=True)
        assert isinstance(runner.forward, PlainForward)
        assert f"model {case}: {reason}; it runs as plain torch" in caplog.text
        assert not runner.forward.packs(5, 16)
        assert not runner.forward.clamps_inputs(5, 16, None)
        ids, lengths = _batch(16)
        io = torch.from_numpy(np.concatenate([ids.reshape(-1), lengths]))
        out = torch.zeros(8 * 32)
        with torch.inference_mode():
            got = runner.step(io, out, 5, 16)
            want = served(torch.from_numpy(ids), torch.from_numpy(lengths))
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["mpnet", "modernbert"])
def test_cuda_backend_runs_them_in_cuda_graphs(tmp_path: Path, case: str) -> None:
    """MPNet on the fused forward, ModernBERT as plain torch, in graphs."""
    from engine.cuda.backend import CudaBackend

    write_checkpoint(tmp_path, case)
    entry = _entry(tmp_path, case, backend="torch")
    want = TorchBackend("cpu")
    want.load(entry)
    cuda = CudaBackend("cuda")
    cuda.load(entry)
    kind = FusedForward if case == "mpnet" else PlainForward
    assert isinstance(cuda.runner(case).forward, kind)
    longest = entry.max_tokens
    cuda.warmup(case, [(1, longest), (8, longest), (8, 16)])
    assert len(cuda.runner(case).graphs) >= 3
    for length in (16, longest):
        ids, lengths = _batch(length)
        got = cuda.run(case, ids, lengths)
        expected = want.run(case, ids, lengths)
        real = lengths > 0
        cosine = F.cosine_similarity(
            torch.from_numpy(got[real]), torch.from_numpy(expected[real])
        )
        assert np.isfinite(got).all() and cosine.min().item() > 0.999
