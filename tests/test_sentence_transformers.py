"""sentence-transformers checkpoints, served as their authors define them.

Tiny random BERT encoders (hidden 32, MiniLM's WordPiece vocabulary) are
wrapped as sentence-transformers models (every pooling mode and several at
once, Dense layers, Normalize, prompts, lowercasing, a short
max_seq_length) and saved by sentence-transformers itself. berth reads each
from a repository, tokenizes with the gateway's TextEncoder, computes with
the torch and onnxruntime backends (and the whole stack, for a few), and
must give what ``SentenceTransformer.encode`` gives in float32: cosine at
least 0.99999 per text, and the same length.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from engine.onnx_backend import OnnxRuntimeBackend
from engine.torch_backend import TorchBackend
from gateway.pipeline import Model
from gateway.tokenize import Limits
from services.cli.default_models import minilm_checkpoint
from services.errors import InvalidInput
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import ModelEntry, RepositoryError, load_repository
from tests.stack import Stack, serving

COSINE = 0.99999
MAX_SEQ_LENGTH = 48
TEXTS = [
    "Hello World",
    "The Quick Brown FOX jumps over the Lazy Dog.",
    "我们今天去公园散步，天气非常好。",
    "🙂🚀🔥 emoji only? 👍🏽",
    "Naïve Café Façade — Résumé",
    "Mixed 中文 and English, numbers 12345 and symbols #@!",
    "a",
    "Word " * 100,  # over max_seq_length: truncated
    " ".join(f"Token{i}" for i in range(40)),  # over it too, with word pieces
]
# name -> how the sentence-transformers model is made (see save_model).
MODELS: dict[str, dict[str, Any]] = {
    "cls": {"modes": ["cls"]},
    "max": {"modes": ["max"]},
    "mean": {"modes": ["mean"]},
    "mean_sqrt_len": {"modes": ["mean_sqrt_len_tokens"]},
    "weightedmean": {"modes": ["weightedmean"]},
    "lasttoken": {"modes": ["lasttoken"]},
    "several": {"modes": ["lasttoken", "cls", "mean"]},
    "dense": {"modes": ["mean"], "dense": [(16, "tanh", True, False)], "norm": True},
    "dense_chain": {
        "modes": ["cls", "max"],
        "dense": [(48, "identity", False, False), (24, "gelu", True, True)],
    },
    "prompt": {"modes": ["mean"], "prompt": "query: ", "norm": True},
    "prompt_excluded": {
        "modes": ["weightedmean", "lasttoken", "cls", "max", "mean"],
        "prompt": "Represent this sentence for searching: ",
        "include_prompt": False,
        "dense": [(8, "relu", True, False)],
        "norm": True,
    },
}
ACTIVATIONS = {
    "tanh": torch.nn.Tanh,
    "identity": torch.nn.Identity,
    "gelu": torch.nn.GELU,
    "relu": torch.nn.ReLU,
}


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer BERT (hidden 32) with all-MiniLM-L6-v2's tokenizer."""
    import transformers

    directory = tmp_path_factory.mktemp("encoder")
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_checkpoint() / name, directory / name)
    return directory


def save_model(directory: Path, encoder_dir: Path, spec: dict[str, Any]) -> Path:
    """A sentence-transformers model of ``spec``, saved by the library."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    transformer = modules.Transformer(str(encoder_dir), max_seq_length=MAX_SEQ_LENGTH)
    pooling = modules.Pooling(
        32,
        pooling_mode=tuple(spec["modes"]),
        include_prompt=spec.get("include_prompt", True),
    )
    layers: list[Any] = [transformer, pooling]
    width = 32 * len(spec["modes"])
    torch.manual_seed(1)
    for out, activation, bias, residual in spec.get("dense", []):
        layers.append(
            modules.Dense(
                width,
                out,
                bias=bias,
                activation_function=ACTIVATIONS[activation](),
                use_residual=residual,
            )
        )
        width = out
    if spec.get("norm"):
        layers.append(modules.Normalize())
    # "prompt": the one prompt, "query", the default; or "prompts" by name
    # and "default_prompt" (a name or None).
    prompt = spec.get("prompt")
    model = SentenceTransformer(
        modules=layers,
        device="cpu",
        prompts=spec.get("prompts", {"query": prompt} if prompt else None),
        default_prompt_name=spec.get("default_prompt", "query" if prompt else None),
    )
    model.save(str(directory))
    return directory


def add_entry(root: Path, name: str, checkpoint: Path, **fields: Any) -> Path:
    entry_dir = root / name
    entry_dir.mkdir(parents=True)
    data = {"name": name, "task": "embed", "checkpoint": str(checkpoint), **fields}
    (entry_dir / "berth.json").write_text(json.dumps(data))
    return entry_dir


@pytest.fixture(scope="module")
def repository_dir(tmp_path_factory: pytest.TempPathFactory, encoder_dir: Path) -> Path:
    """A model repository of every MODELS entry, plus "lowercase" and
    "legacy" (configurations as older sentence-transformers wrote them)."""
    root = tmp_path_factory.mktemp("st_repository")
    checkpoints = tmp_path_factory.mktemp("st_checkpoints")
    for name, spec in MODELS.items():
        add_entry(root, name, save_model(checkpoints / name, encoder_dir, spec))
    add_entry(root, "lowercase", lowercase_checkpoint(checkpoints, encoder_dir))
    add_entry(root, "legacy", legacy_checkpoint(checkpoints, encoder_dir))
    return root


def lowercase_checkpoint(root: Path, encoder_dir: Path) -> Path:
    """A cased tokenizer, and do_lower_case in sentence_bert_config.json."""
    directory = save_model(root / "lowercase", encoder_dir, {"modes": ["mean"]})
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["do_lower_case"] = False
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    legacy = {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": True}
    (directory / "sentence_bert_config.json").write_text(json.dumps(legacy))
    return directory


def legacy_checkpoint(root: Path, encoder_dir: Path) -> Path:
    """Pooling's older boolean keys: modes concatenate in the library's
    order (cls, max, mean, mean_sqrt_len, weightedmean, lasttoken)."""
    directory = save_model(root / "legacy", encoder_dir, {"modes": ["mean"]})
    pooling = {
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": True,
        "pooling_mode_mean_sqrt_len_tokens": True,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
    }
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return directory


@pytest.fixture(scope="module")
def entries(repository_dir: Path) -> dict[str, ModelEntry]:
    return load_repository(repository_dir)


def loaded_backends(entries: dict[str, ModelEntry], cache: Path) -> dict[str, Any]:
    """The torch and onnxruntime CPU backends with every entry loaded."""
    torch_backend = TorchBackend("cpu")
    onnx = OnnxRuntimeBackend("cpu", threads=2, cache=cache)
    for entry in entries.values():
        torch_backend.load(entry)
        onnx.load(entry)
    return {"torch": torch_backend, "onnxruntime": onnx}


@pytest.fixture(scope="module")
def backends(
    entries: dict[str, ModelEntry], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    return loaded_backends(entries, tmp_path_factory.mktemp("c"))


def reference(entry: ModelEntry, texts: list[str]) -> np.ndarray:
    """SentenceTransformer.encode of the entry's checkpoint, float32."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(entry.checkpoint_dir), device="cpu")
    return np.asarray(model.encode(texts, convert_to_numpy=True), np.float64)


def served(entry: ModelEntry, backend: Any, texts: list[str]) -> np.ndarray:
    """The gateway's tokens (truncated) through ``backend``, and the
    gateway's dimensions and normalization as the entry's defaults."""
    model = Model(entry, Limits())
    ids = model.encoder.encode(texts, truncate=True)
    lengths = np.array([len(row) for row in ids], np.int32)
    batch = np.zeros((len(ids), int(lengths.max())), np.int32)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = row
    out = backend.run(entry.name, batch, lengths)
    return np.asarray(model.embeddings(out, berth_pb2.Options()), np.float64)


def agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(least cosine, largest relative difference of length) over rows."""
    norms = np.linalg.norm(ours, axis=1), np.linalg.norm(theirs, axis=1)
    cosine = (ours * theirs).sum(axis=1) / (norms[0] * norms[1])
    return float(cosine.min()), float(np.abs(norms[0] / norms[1] - 1).max())


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("name", [*MODELS, "lowercase", "legacy"])
def test_served_like_sentence_transformers(
    entries: dict[str, ModelEntry], backends: dict[str, Any], name: str, backend: str
) -> None:
    entry = entries[name]
    theirs = reference(entry, TEXTS)
    ours = served(entry, backends[backend], TEXTS)
    assert ours.shape == theirs.shape
    cosine, length = agreement(ours, theirs)
    print(
        f"{name} on {backend}: 1 - least cosine {1 - cosine:.1e}, length {length:.1e}"
    )
    assert cosine >= COSINE and length <= 1e-4, (cosine, length)


@pytest.mark.parametrize("name", ["several", "dense_chain", "prompt_excluded"])
def test_the_fused_cuda_forward_pools_as_the_model(
    backends: dict[str, Any], name: str
) -> None:
    """engine/cuda/forward.py's FusedForward (here with its kernels' torch
    fallbacks, on the CPU) pools with the model's own module where its
    kernels do not (no packed rows then), and applies the Dense layers."""
    from engine.cuda.forward import FusedForward

    served = backends["torch"].model(name)
    forward = FusedForward(served)
    lengths = torch.tensor([9, 1, 16, 0, 5], dtype=torch.int32)
    ids = torch.randint(1000, 2000, (5, 16), generator=torch.Generator().manual_seed(0))
    ids[torch.arange(16)[None, :] >= lengths[:, None]] = 0
    for kind in forward.kinds:
        forward.chosen[(5, 16)] = kind
        assert not forward.packs(5, 16)
        out = torch.zeros(5, served.width)
        with torch.inference_mode():
            fused = forward(ids.to(torch.int32), lengths, out=out)
            plain = served(ids, lengths)
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


def test_the_checkpoints_configuration_is_read(entries: dict[str, ModelEntry]) -> None:
    assert entries["mean"].max_tokens == MAX_SEQ_LENGTH
    assert entries["mean"].buckets == [32, MAX_SEQ_LENGTH]
    assert (entries["mean"].pooling, entries["mean"].normalize) == ("mean", False)
    assert entries["several"].pooling == "lasttoken+cls+mean"
    assert entries["legacy"].pooling == "max+mean+mean_sqrt_len+lasttoken"
    assert entries["dense"].normalize and len(entries["dense"].dense) == 1
    assert entries["dense_chain"].output_width() == 24
    assert entries["prompt"].prompt == "query: "
    excluded = entries["prompt_excluded"]
    assert not excluded.include_prompt and excluded.pooling_skip() == 7
    lowercase = entries["lowercase"]
    assert lowercase.lowercase
    cased = ModelEntry(name="c", task="embed", checkpoint=lowercase.checkpoint)
    assert (
        cased.tokenizer().encode("Hello").ids
        != lowercase.tokenizer().encode("Hello").ids
    )


def test_over_max_seq_length_is_refused_without_truncate(
    entries: dict[str, ModelEntry],
) -> None:
    encoder = Model(entries["prompt"], Limits()).encoder
    with pytest.raises(InvalidInput) as info:
        encoder.encode(["Word " * 100], truncate=False)
    assert f"over the limit of {MAX_SEQ_LENGTH}" in str(info.value)
    assert "prompt" in str(info.value)
    (cut,) = encoder.encode(["Word " * 100], truncate=True)
    assert len(cut) == MAX_SEQ_LENGTH
    ids, tokens = encoder.tokens(["Hi"])[0]
    assert tokens == ["[CLS]", "query", ":", "hi", "[SEP]"]


def test_berth_json_fields_win_over_the_checkpoint(
    tmp_path: Path, entries: dict[str, ModelEntry], backends: dict[str, Any]
) -> None:
    checkpoint = entries["dense"].checkpoint_dir
    add_entry(
        tmp_path,
        "m",
        checkpoint,
        max_tokens=20,
        pooling="cls",
        normalize=False,
        dense=[],
        prompts={"q": "question: "},
        default_prompt_name="q",
    )
    entry = load_repository(tmp_path)["m"]
    assert (entry.max_tokens, entry.pooling, entry.normalize) == (20, "cls", False)
    assert (entry.dense, entry.prompt, entry.output_width()) == ([], "question: ", 32)
    add_entry(tmp_path / "bare", "m", checkpoint, sentence_transformers=False)
    bare = load_repository(tmp_path / "bare")["m"]
    assert (bare.max_tokens, bare.pooling, bare.normalize, bare.dense) == (
        512,
        "mean",
        True,
        [],
    )


def refusal(tmp_path: Path, checkpoint: Path, **fields: Any) -> str:
    add_entry(tmp_path, "m", checkpoint, **fields)
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "m" / "berth.json") in message, message
    return message


def copy_of(entries: dict[str, ModelEntry], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(entries[name].checkpoint_dir, tmp_path / "copy"))


def test_what_berth_cannot_serve_is_refused(
    tmp_path: Path, entries: dict[str, ModelEntry]
) -> None:
    checkpoint = copy_of(entries, "dense", tmp_path)
    (checkpoint / "2_Dense" / "model.safetensors").rename(
        checkpoint / "2_Dense" / "pytorch_model.bin"
    )
    message = refusal(tmp_path / "a", checkpoint)
    assert "pytorch_model.bin is a pickle" in message and "safetensors" in message
    assert '"sentence_transformers": false' in message

    modules_file = checkpoint / "modules.json"
    modules = json.loads(modules_file.read_text())
    modules[2]["type"] = "sentence_transformers.models.LSTM"
    modules_file.write_text(json.dumps(modules))
    assert "LSTM" in refusal(tmp_path / "b", checkpoint)

    modules[2]["type"] = "sentence_transformers.models.Normalize"
    modules[3]["type"] = "sentence_transformers.models.Dense"
    modules_file.write_text(json.dumps(modules))
    assert "in that order" in refusal(tmp_path / "c", checkpoint)

    pooling = copy_of(entries, "mean", tmp_path / "d")
    config = {"embedding_dimension": 32, "pooling_mode": "attention"}
    (pooling / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert "'attention'" in refusal(tmp_path / "e", pooling)
    assert "pooling" in refusal(tmp_path / "f", pooling, pooling="mean+avg")
    message = refusal(
        tmp_path / "g", entries["mean"].checkpoint_dir, default_prompt_name="nope"
    )
    assert "default_prompt_name" in message


def test_a_dense_activation_berth_does_not_know_is_refused(
    tmp_path: Path, entries: dict[str, ModelEntry]
) -> None:
    checkpoint = copy_of(entries, "dense", tmp_path)
    config_file = checkpoint / "2_Dense" / "config.json"
    config = json.loads(config_file.read_text())
    config["activation_function"] = "mypackage.Swish"
    config_file.write_text(json.dumps(config))
    assert "'mypackage.Swish'" in refusal(tmp_path / "a", checkpoint)


@pytest.fixture(scope="module")
def st_stack(
    repository_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """`berth serve` on a repository of three of the models (onnxruntime,
    the CPU default)."""
    root = tmp_path_factory.mktemp("st_stack")
    for name in ("legacy", "dense_chain", "prompt_excluded"):
        shutil.copytree(repository_dir / name, root / name)
    cache = tmp_path_factory.mktemp("stack-cache")
    with serving(Stack(root, env={"BERTH_CACHE_DIR": str(cache)})) as stack:
        yield stack


@pytest.mark.parametrize("name", ["legacy", "dense_chain", "prompt_excluded"])
def test_the_stack_serves_like_sentence_transformers(
    st_stack: Stack, entries: dict[str, ModelEntry], name: str
) -> None:
    with grpc.insecure_channel(st_stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        request = berth_pb2.EmbedRequest(
            model=name, texts=TEXTS, options=berth_pb2.Options(truncate=True)
        )
        response = stub.Embed(request, timeout=60)
        info = stub.ModelInfo(berth_pb2.ModelInfoRequest(model=name), timeout=30)
    ours = np.array([e.values for e in response.embeddings], np.float64)
    cosine, length = agreement(ours, reference(entries[name], TEXTS))
    print(
        f"{name} through the stack: 1 - least cosine {1 - cosine:.1e}, "
        f"length {length:.1e}"
    )
    assert cosine >= COSINE and length <= 1e-4
    assert max(e.tokens for e in response.embeddings) == MAX_SEQ_LENGTH
    assert info.models[0].dimension == ours.shape[1]
    assert info.models[0].max_tokens == MAX_SEQ_LENGTH


PARAGRAPH = (
    "berth serves transformer encoders over gRPC, batching requests by length "
    "so that the accelerator stays busy. 我们今天去公园散步，天气非常好。 "
    "🙂🚀🔥 Naïve café façade — résumé; numbers 12345 and symbols #@! "
)


def text_of(tokens: int, entry: ModelEntry) -> str:
    """The first words of PARAGRAPH (repeated) that make ``tokens`` tokens or
    just over, [CLS] and [SEP] included."""
    tokenizer = entry.tokenizer()
    words = (PARAGRAPH * 60).split()
    count = 1
    while len(tokenizer.encode(" ".join(words[:count])).ids) < tokens:
        count += 1
    return " ".join(words[:count])


def test_default_minilm_follows_its_max_seq_length(
    client: berth_pb2_grpc.BerthStub, repository: Path
) -> None:
    """The default model through the stack (onnxruntime on the CPU), on
    texts of 5 to 500 tokens, against sentence-transformers' own encoding of
    all-MiniLM-L6-v2, which cuts texts at its max_seq_length, 256."""
    entry = load_repository(repository)["minilm"]
    assert entry.max_tokens == 256
    sizes = [5, 10, 30, 64, 128, 200, 255, 256, 257, 300, 400, 500]
    texts = [text_of(n, entry) for n in sizes]
    request = berth_pb2.EmbedRequest(
        model="minilm", texts=texts, options=berth_pb2.Options(truncate=True)
    )
    response = client.Embed(request, timeout=120)
    tokens = [e.tokens for e in response.embeddings]
    assert tokens[-1] == tokens[-5] == 256 and tokens[0] < 10, tokens
    ours = np.array([e.values for e in response.embeddings], np.float64)
    cosine, length = agreement(ours, reference(entry, texts))
    print(f"minilm, {sizes} tokens: 1 - least cosine {1 - cosine:.1e}")
    assert cosine >= COSINE and length <= 1e-4
    over = berth_pb2.EmbedRequest(model="minilm", texts=[texts[-3]])
    with pytest.raises(grpc.RpcError) as info:
        client.Embed(over, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the limit of 256 for model 'minilm'" in (info.value.details() or "")
