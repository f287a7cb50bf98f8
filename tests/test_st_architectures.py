"""sentence-transformers models of every architecture berth's encoder loads.

Each case writes a tiny random encoder with transformers' config classes
(BERT, DistilBERT, RoBERTa, XLM-R, MPNet, ModernBERT; every parameter
scrambled, so that LayerNorm weights, biases and MPNet's position bias all
count) and MiniLM's WordPiece tokenizer, wraps it as a sentence-transformers
model (a Transformer of a short max_seq_length, a Pooling module, Dense and
Normalize on some) saved by sentence-transformers itself. Every pooling mode
is some architecture's; two cases pool by several modes, and one saves a
``truncate_dim``. berth serves each from one repository: the gateway's
TextEncoder (truncating) into the torch and onnxruntime backends, and the
whole stack through ``berth serve``; each must give what
``SentenceTransformer.encode`` gives in float32 on texts past
max_seq_length, CJK and emoji: cosine at least 0.99999 per text, and the
same length within 1e-4.
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
import tritonclient.grpc as triton

from services.cli.default_models import minilm_checkpoint
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import ModelEntry, RepositoryError, load_repository
from tests.engine.test_checkpoint_classifiers import encoder_config
from tests.stack import Stack, serving
from tests.test_sentence_transformers import (
    COSINE,
    MAX_SEQ_LENGTH,
    TEXTS,
    add_entry,
    agreement,
    loaded_backends,
    reference,
    save_model,
    served,
)

TRUNCATE_DIM = 40  # inside the second of modernbert-several's three modes
# name -> (architecture, sentence-transformers model; see save_model).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": ("bert", {"modes": ["weightedmean"]}),
    "distilbert": ("distilbert", {"modes": ["max"]}),
    "roberta": ("roberta", {"modes": ["lasttoken"]}),
    "xlm-roberta": ("xlm-roberta", {"modes": ["mean_sqrt_len_tokens"]}),
    "mpnet": (
        "mpnet",
        {"modes": ["mean"], "dense": [(16, "tanh", True, False)], "norm": True},
    ),
    "modernbert": ("modernbert", {"modes": ["cls"]}),
    "distilbert-several": (
        "distilbert",
        {
            "modes": ["cls", "weightedmean", "mean_sqrt_len_tokens"],
            "dense": [(24, "relu", True, False)],
            "norm": True,
        },
    ),
    "modernbert-several": ("modernbert", {"modes": ["lasttoken", "max", "mean"]}),
}


def write_encoder(directory: Path, arch: str) -> Path:
    """A random ``arch`` encoder, every parameter scrambled, saved by
    transformers with MiniLM's tokenizer files."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModel.from_config(encoder_config(arch)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if "relative_attention_bias" in name else 0.2
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_checkpoint() / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def repository_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository of every case, each a sentence-transformers checkpoint."""
    from sentence_transformers import SentenceTransformer

    root = tmp_path_factory.mktemp("st_arch_repository")
    encoders = tmp_path_factory.mktemp("st_arch_encoders")
    checkpoints = tmp_path_factory.mktemp("st_arch_checkpoints")
    for name, (arch, spec) in CASES.items():
        encoder = write_encoder(encoders / name, arch)
        checkpoint = save_model(checkpoints / name, encoder, spec)
        add_entry(root, name, checkpoint)
    # truncate_dim, as sentence-transformers saves it in its own config.
    several = str(checkpoints / "modernbert-several")
    model = SentenceTransformer(several, device="cpu", truncate_dim=TRUNCATE_DIM)
    model.save(several)
    return root


@pytest.fixture(scope="module")
def entries(repository_dir: Path) -> dict[str, ModelEntry]:
    return load_repository(repository_dir)


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ONNX exports, shared by the backends here and the stack's engine."""
    return tmp_path_factory.mktemp("st_arch_cache")


@pytest.fixture(scope="module")
def backends(entries: dict[str, ModelEntry], onnx_cache: Path) -> dict[str, Any]:
    return loaded_backends(entries, onnx_cache)


def test_each_case_is_read_as_saved(entries: dict[str, ModelEntry]) -> None:
    for name, (arch, spec) in CASES.items():
        entry = entries[name]
        config = json.loads((entry.checkpoint_dir / "config.json").read_text())
        assert config["model_type"] == arch, name
        modes = [m.removesuffix("_tokens") for m in spec["modes"]]
        assert entry.pooling == "+".join(modes), name
        assert entry.max_tokens == MAX_SEQ_LENGTH, name
        assert entry.normalize == bool(spec.get("norm")), name
        assert len(entry.dense) == len(spec.get("dense", [])), name
    assert entries["modernbert-several"].dimensions == TRUNCATE_DIM
    assert entries["modernbert-several"].output_width() == 96
    assert all(entries[n].dimensions is None for n in CASES if "several" not in n)
    every = {m for _, spec in CASES.values() for m in spec["modes"]}
    assert len(every) == 6  # every pooling mode sentence-transformers has


def _report(name: str, where: str, cosine: float, length: float) -> None:
    print(f"{name} {where}: 1 - least cosine {1 - cosine:.1e}, length {length:.1e}")


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("name", list(CASES))
def test_served_like_sentence_transformers(
    entries: dict[str, ModelEntry], backends: dict[str, Any], name: str, backend: str
) -> None:
    entry = entries[name]
    theirs = reference(entry, TEXTS)
    ours = served(entry, backends[backend], TEXTS)
    assert ours.shape == theirs.shape
    cosine, length = agreement(ours, theirs)
    _report(name, f"on {backend}", cosine, length)
    assert cosine >= COSINE and length <= 1e-4, (cosine, length)


@pytest.fixture(scope="module")
def arch_stack(
    repository_dir: Path, backends: dict[str, Any], onnx_cache: Path
) -> Iterator[Stack]:
    """`berth serve` on the whole repository (onnxruntime, the CPU default),
    reading the exports the backends fixture wrote."""
    with serving(Stack(repository_dir, env={"BERTH_CACHE_DIR": str(onnx_cache)})) as s:
        yield s


@pytest.mark.parametrize("name", list(CASES))
def test_the_stack_serves_like_sentence_transformers(
    arch_stack: Stack, entries: dict[str, ModelEntry], name: str
) -> None:
    with grpc.insecure_channel(arch_stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        request = berth_pb2.EmbedRequest(
            model=name, texts=TEXTS, options=berth_pb2.Options(truncate=True)
        )
        response = stub.Embed(request, timeout=60)
        refused = berth_pb2.EmbedRequest(model=name, texts=[TEXTS[-2]])
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(refused, timeout=60)
    assert not response.degraded
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"over the limit of {MAX_SEQ_LENGTH}" in (info.value.details() or "")
    ours = np.array([e.values for e in response.embeddings], np.float64)
    theirs = reference(entries[name], TEXTS)
    assert ours.shape == theirs.shape
    cosine, length = agreement(ours, theirs)
    _report(name, "through the stack", cosine, length)
    assert cosine >= COSINE and length <= 1e-4, (cosine, length)
    assert max(e.tokens for e in response.embeddings) == MAX_SEQ_LENGTH


def test_a_calls_dimensions_win_over_truncate_dim(
    arch_stack: Stack, entries: dict[str, ModelEntry]
) -> None:
    """The entry's default width is truncate_dim; a call's dimensions (more
    or fewer) win, as encode's own truncate_dim argument does."""
    from sentence_transformers import SentenceTransformer

    entry = entries["modernbert-several"]
    model = SentenceTransformer(str(entry.checkpoint_dir), device="cpu")
    with grpc.insecure_channel(arch_stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        info = stub.ModelInfo(berth_pb2.ModelInfoRequest(model=entry.name))
        (described,) = info.models
        assert described.dimension == TRUNCATE_DIM
        assert described.max_dimensions == entry.output_width() > TRUNCATE_DIM
        plain = stub.Embed(
            berth_pb2.EmbedRequest(model=entry.name, texts=TEXTS[:2]), timeout=60
        )
        assert len(plain.embeddings[0].values) == TRUNCATE_DIM
        kserve = triton.InferenceServerClient(arch_stack.gateway)
        metadata = kserve.get_model_metadata(entry.name)
        assert [int(d) for d in metadata.outputs[0].shape] == [-1, TRUNCATE_DIM]
        text = triton.InferInput("TEXT", [2], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS[:2]], object))
        embedded = kserve.infer(entry.name, [text]).as_numpy("EMBEDDING")
        assert embedded.shape == (2, TRUNCATE_DIM)
        kserve.close()
        for dimensions in (96, 12):
            options = berth_pb2.Options(truncate=True, dimensions=dimensions)
            request = berth_pb2.EmbedRequest(
                model=entry.name, texts=TEXTS, options=options
            )
            response = stub.Embed(request, timeout=60)
            ours = np.array([e.values for e in response.embeddings], np.float64)
            theirs = model.encode(TEXTS, truncate_dim=dimensions)
            assert ours.shape == theirs.shape == (len(TEXTS), dimensions)
            cosine, length = agreement(ours, np.asarray(theirs, np.float64))
            assert cosine >= COSINE and length <= 1e-4, (dimensions, cosine)


def test_truncate_dim_is_checked(
    tmp_path: Path, entries: dict[str, ModelEntry]
) -> None:
    """The checkpoint's truncate_dim is the entry's dimensions unless
    berth.json writes its own; over the embedding's width, or not a positive
    integer: refused, naming the file."""
    checkpoint = Path(
        shutil.copytree(entries["modernbert"].checkpoint_dir, tmp_path / "ckpt")
    )
    config_file = checkpoint / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "truncate_dim": 10}))
    add_entry(tmp_path / "read", "m", checkpoint)
    assert load_repository(tmp_path / "read")["m"].dimensions == 10
    add_entry(tmp_path / "written", "m", checkpoint, dimensions=20)
    assert load_repository(tmp_path / "written")["m"].dimensions == 20
    add_entry(tmp_path / "wide", "m", checkpoint, dimensions=33)
    with pytest.raises(RepositoryError, match="dimensions 33 is over the"):
        load_repository(tmp_path / "wide")
    config_file.write_text(json.dumps({**config, "truncate_dim": 0}))
    add_entry(tmp_path / "zero", "m", checkpoint)
    with pytest.raises(RepositoryError, match="truncate_dim 0") as info:
        load_repository(tmp_path / "zero")
    assert str(config_file) in str(info.value)
