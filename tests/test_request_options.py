"""A call's prompt and dimensions, as sentence-transformers' encode applies
them: ``encode(texts, prompt_name=..., prompt=..., truncate_dim=N,
normalize_embeddings=...)`` against berth's answer for Options.prompt_name,
Options.prompt, Options.dimensions and normalize, on tiny random
sentence-transformers models with several prompts (built as
tests/test_sentence_transformers.py builds its own), through the torch and
onnxruntime backends and through `berth serve` (berth.v1, its Stream,
KServe v2 and `berth embed`): cosine at least 0.99999 per text. The errors
are checked where they are raised, and through the stack once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from gateway.cache import ModelCache
from gateway.options import check_dimensions
from gateway.pipeline import Model
from gateway.tokenize import Limits
from services.errors import InvalidInput
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import ModelEntry, load_repository
from tests.kserve_inputs import text_input
from tests.stack import Stack, serving
from tests.test_sentence_transformers import (  # noqa: F401  (a fixture)
    COSINE,
    TEXTS,
    add_entry,
    agreement,
    encoder_dir,
    loaded_backends,
    save_model,
)

MODELS: dict[str, dict[str, Any]] = {
    # Width 24 (a Dense layer), no Normalize: normalize is off by default.
    "prompted": {
        "modes": ["mean"],
        "dense": [(24, "tanh", True, False)],
        "prompts": {
            "query": "query: ",
            "passage": "passage: ",
            "long": "Represent this document for retrieval: ",
        },
        "default_prompt": "query",
    },
    # The prompt left out of pooling: [CLS] and 4 tokens of "query" and
    # "passage" alike, 2 of "short".
    "excluded": {
        "modes": ["mean", "cls"],
        "include_prompt": False,
        "norm": True,
        "prompts": {
            "query": "Represent this query: ",
            "passage": "Represent this passage: ",
            "short": "q: ",
        },
        "default_prompt": "query",
    },
    "unprompted": {"modes": ["mean"], "norm": True},
}
# (model, options): each a call, compared with encode of the same options.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("prompted", {"prompt_name": "passage"}),
    ("prompted", {"prompt_name": "long", "dimensions": 8, "normalize": True}),
    ("prompted", {"prompt": "Instruct: find it\nQuery: ", "dimensions": 16}),
    ("prompted", {"prompt": ""}),
    ("prompted", {"dimensions": 24, "normalize": True}),
    ("excluded", {"prompt_name": "passage", "dimensions": 16}),
    ("excluded", {"prompt": "Represent this text: ", "normalize": False}),
    ("excluded", {"dimensions": 5, "normalize": False}),
    ("unprompted", {"prompt": "query: ", "dimensions": 4}),
]
STACKED = ("prompted", "excluded")


@pytest.fixture(scope="module")
def repository_dir(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Path:
    """MODELS, on tests/test_sentence_transformers.py's random encoder."""
    encoder: Path = request.getfixturevalue("encoder_dir")
    root = tmp_path_factory.mktemp("options_repository")
    checkpoints = tmp_path_factory.mktemp("options_checkpoints")
    for name, spec in MODELS.items():
        add_entry(root, name, save_model(checkpoints / name, encoder, spec))
    return root


@pytest.fixture(scope="module")
def entries(repository_dir: Path) -> dict[str, ModelEntry]:
    return load_repository(repository_dir)


@pytest.fixture(scope="module")
def backends(
    entries: dict[str, ModelEntry], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    return loaded_backends(entries, tmp_path_factory.mktemp("c"))


_ST_MODELS: dict[Path, Any] = {}


def expected(entry: ModelEntry, options: dict[str, Any]) -> np.ndarray:
    """SentenceTransformer.encode of TEXTS as ``options`` ask, float64;
    normalize_embeddings as berth resolves it (the model's default)."""
    from sentence_transformers import SentenceTransformer

    model = _ST_MODELS.get(entry.checkpoint_dir)
    if model is None:
        model = SentenceTransformer(str(entry.checkpoint_dir), device="cpu")
        _ST_MODELS[entry.checkpoint_dir] = model
    vectors = model.encode(
        TEXTS,
        prompt_name=options.get("prompt_name"),
        prompt=options.get("prompt"),
        truncate_dim=options.get("dimensions") or None,
        normalize_embeddings=options.get("normalize", entry.normalize),
        convert_to_numpy=True,
    )
    return np.asarray(vectors, np.float64)


def check(
    entry: ModelEntry, options: dict[str, Any], ours: np.ndarray, where: str
) -> None:
    """berth's answer agrees with sentence-transformers': direction always,
    length where both normalize or neither has a Normalize module (without
    normalize, berth answers the vector before it, encode after it)."""
    theirs = expected(entry, options)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    cosine, length = agreement(ours, theirs)
    print(f"{entry.name} {options} {where}: 1 - least cosine {1 - cosine:.1e}")
    assert cosine >= COSINE, cosine
    if options.get("normalize", entry.normalize) or not entry.normalize:
        assert length <= 1e-4, length


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize(("name", "options"), CASES)
def test_options_as_sentence_transformers(
    entries: dict[str, ModelEntry],
    backends: dict[str, Any],
    name: str,
    options: dict[str, Any],
    backend: str,
) -> None:
    entry = entries[name]
    model = Model(entry, Limits())
    asked = berth_pb2.Options(truncate=True, **options)
    ids = model.encoder.encode(TEXTS, True, model.prompt(asked))
    lengths = np.array([len(row) for row in ids], np.int32)
    batch = np.zeros((len(ids), int(lengths.max())), np.int32)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = row
    out = backends[backend].run(name, batch, lengths)
    check(entry, options, np.asarray(model.embeddings(out, asked), np.float64), backend)


def refused(model: Model, **options: Any) -> str:
    with pytest.raises(InvalidInput) as info:
        model.prompt(berth_pb2.Options(**options))
    return str(info.value)


def test_what_a_model_cannot_do_is_refused(entries: dict[str, ModelEntry]) -> None:
    prompted = Model(entries["prompted"], Limits())
    message = refused(prompted, prompt_name="nope")
    assert "no prompt named 'nope'" in message
    # sentence-transformers saves "query" and "document" prompts ("" unless given).
    assert "its prompts are 'document', 'long', 'passage', 'query'" in message
    assert "not both" in refused(prompted, prompt_name="query", prompt="q: ")
    message = refused(prompted, dimensions=25)
    assert "whose embeddings have 24 values: ask for 1 to 24" in message
    assert "characters, over the limit" in refused(prompted, prompt="x" * 10**6)
    unprompted = Model(replace(entries["unprompted"], prompts={}), Limits())
    assert "has no prompts" in refused(unprompted, prompt_name="query")
    assert unprompted.prompt(berth_pb2.Options(prompt="query: ")) == "query: "
    classifier = replace(entries["unprompted"], task="classify")
    with pytest.raises(InvalidInput, match="classify model"):
        check_dimensions(classifier, 32, 8)
    check_dimensions(classifier, 32, 0)
    excluded = Model(entries["excluded"], Limits())
    assert excluded.prompts.skip == 5
    message = refused(excluded, prompt_name="short")
    assert "include_prompt false" in message and "a fixed 5 leading" in message
    assert "'short' makes 3 tokens" in message
    assert "no tokens (no prompt)" in refused(excluded, prompt="")
    assert "no tokens (no prompt)" in refused(excluded, prompt_name="document")
    for options in ({"prompt_name": "passage"}, {"prompt": "Represent x y: "}, {}):
        excluded.prompt(berth_pb2.Options(**options))


def test_over_the_limit_counts_the_calls_prompt(entries: dict[str, ModelEntry]) -> None:
    model = Model(entries["prompted"], Limits())
    long = model.prompts.named["long"]
    (ids,) = model.encoder.encode(["Word " * 42], False, "")
    assert len(ids) == 44  # fits without a prompt, not with "long"
    with pytest.raises(InvalidInput, match="its prompt's included"):
        model.encoder.encode(["Word " * 42], False, long)


def test_the_cache_keeps_each_prompts_row_apart() -> None:
    cache = ModelCache(max_entries=10, max_bytes=1 << 20)
    cache.put("", False, "x", np.ones(4, np.float32), 3, prompt="query: ")
    assert cache.get("", False, "x", "passage: ") is None
    assert cache.get("", False, "x") is None
    found = cache.get("", False, "x", "query: ")
    assert found is not None and found[1] == 3


@pytest.fixture(scope="module")
def options_stack(
    repository_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """`berth serve` of two of the models (onnxruntime, the CPU default),
    with the gateway's response cache on (its default)."""
    import shutil

    root = tmp_path_factory.mktemp("options_stack")
    for name in STACKED:
        shutil.copytree(repository_dir / name, root / name)
    cache = tmp_path_factory.mktemp("options-stack-cache")
    with serving(Stack(root, env={"BERTH_CACHE_DIR": str(cache)})) as stack:
        yield stack


@pytest.fixture(scope="module")
def stub(options_stack: Stack) -> Iterator[berth_pb2_grpc.BerthStub]:
    with grpc.insecure_channel(options_stack.gateway) as channel:
        yield berth_pb2_grpc.BerthStub(channel)


def embed(
    stub: berth_pb2_grpc.BerthStub, name: str, texts: list[str], **options: Any
) -> np.ndarray:
    request = berth_pb2.EmbedRequest(
        model=name, texts=texts, options=berth_pb2.Options(truncate=True, **options)
    )
    response = stub.Embed(request, timeout=60)
    return np.array([e.values for e in response.embeddings], np.float64)


@pytest.mark.parametrize(
    ("name", "options"), [case for case in CASES if case[0] in STACKED]
)
def test_the_stack_applies_options_as_sentence_transformers(
    stub: berth_pb2_grpc.BerthStub,
    entries: dict[str, ModelEntry],
    name: str,
    options: dict[str, Any],
) -> None:
    check(entries[name], options, embed(stub, name, TEXTS, **options), "berth.v1")
    stream_request = berth_pb2.StreamRequest(
        embed=berth_pb2.EmbedRequest(
            model=name,
            texts=TEXTS,
            options=berth_pb2.Options(truncate=True, **options),
            request_id=7,
        )
    )
    (answer,) = stub.Stream(iter([stream_request]), timeout=60)
    assert answer.WhichOneof("response") == "embed", answer
    streamed = np.array([e.values for e in answer.embed.embeddings], np.float64)
    check(entries[name], options, streamed, "Stream")


def test_the_stack_caches_each_prompt_apart(stub: berth_pb2_grpc.BerthStub) -> None:
    """The same text with two prompts (or none) gives each its own answer,
    whichever is cached first; dimensions cut a cached full row."""
    text = f"cached {uuid.uuid4().hex}"
    query = embed(stub, "prompted", [text])  # the default prompt, "query"
    passage = embed(stub, "prompted", [text], prompt_name="passage")
    bare = embed(stub, "prompted", [text], prompt="")
    assert not np.allclose(query, passage) and not np.allclose(query, bare)
    np.testing.assert_array_equal(
        query, embed(stub, "prompted", [text], prompt_name="query")
    )
    short = embed(stub, "prompted", [text], prompt_name="passage", dimensions=8)
    np.testing.assert_allclose(short, passage[:, :8], rtol=1e-6)
    unit = embed(stub, "prompted", [text], dimensions=8, normalize=True)
    unit_query = query[:, :8] / np.linalg.norm(query[:, :8])
    np.testing.assert_allclose(unit, unit_query, rtol=1e-6)  # float32 against 64


def test_the_stack_refuses_what_the_model_cannot_do(
    stub: berth_pb2_grpc.BerthStub,
) -> None:
    for name, options, words in (
        ("prompted", {"prompt_name": "nope"}, "its prompts are 'document', 'long'"),
        ("prompted", {"dimensions": 100}, "have 24 values"),
        ("excluded", {"prompt_name": "short"}, "include_prompt false"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            embed(stub, name, ["hello"], **options)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (info.value.details() or "")
    info_reply = stub.ModelInfo(berth_pb2.ModelInfoRequest(model="prompted"))
    (described,) = info_reply.models
    assert list(described.prompt_names) == ["document", "long", "passage", "query"]
    assert (described.default_prompt_name, described.dimension) == ("query", 24)


def test_kserve_parameters_as_sentence_transformers(
    options_stack: Stack, entries: dict[str, ModelEntry]
) -> None:
    options = {"prompt_name": "long", "dimensions": 8, "normalize": True}
    client = triton.InferenceServerClient(url=options_stack.gateway)
    try:
        cut = {"truncate": True}
        asked = {**options, **cut}
        result = client.infer("prompted", [text_input(TEXTS)], parameters=asked)
        ours = np.asarray(result.as_numpy("EMBEDDING"), np.float64)
        assert ours.shape == (len(TEXTS), 8)
        check(entries["prompted"], options, ours, "KServe")
        raw = {"prompt": "Instruct: find it\nQuery: ", "dimensions": 16}
        result = client.infer(
            "prompted", [text_input(TEXTS)], parameters={**raw, **cut}
        )
        ours = np.asarray(result.as_numpy("EMBEDDING"), np.float64)
        check(entries["prompted"], raw, ours, "KServe")
        for bad, words in (
            ({"prompt_name": "nope"}, "its prompts are"),
            ({"dimensions": -1}, "ask for 1 to 24"),
            ({"dimensions": 1.5}, "must be an integer"),
        ):
            with pytest.raises(InferenceServerException) as info:
                client.infer("prompted", [text_input(["hi"])], parameters=bad)
            assert "INVALID_ARGUMENT" in str(info.value.status())
            assert words in str(info.value.message())
        metadata = client.get_model_metadata("prompted", as_json=True)
        assert metadata["outputs"][0]["shape"] == ["-1", "24"]  # the full width
    finally:
        client.close()


def test_berth_embed_takes_the_options(
    options_stack: Stack, entries: dict[str, ModelEntry]
) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "services.cli", "embed", "--model", "excluded"),
            *("--truncate", "--prompt-name", "passage", "--dimensions", "16"),
            *("--address", options_stack.gateway, *TEXTS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ours = np.array([e["embedding"] for e in json.loads(done.stdout)], np.float64)
    check(
        entries["excluded"], {"prompt_name": "passage", "dimensions": 16}, ours, "CLI"
    )


def test_tokenize_shows_the_prompt_a_call_names(
    stub: berth_pb2_grpc.BerthStub,
) -> None:
    """Tokenize tokenizes after the prompt its options name, as Embed runs
    the text: the default prompt when they name none, none with prompt ''."""

    def tokens(**options: Any) -> list[str]:
        request = berth_pb2.TokenizeRequest(
            model="prompted", texts=["hello"], options=berth_pb2.Options(**options)
        )
        return list(stub.Tokenize(request, timeout=30).results[0].tokens)

    bare = tokens(prompt="")
    assert bare == ["[CLS]", "hello", "[SEP]"]
    default, passage = tokens(), tokens(prompt_name="passage")
    assert default == tokens(prompt_name="query") != passage
    assert default[-2:] == passage[-2:] == ["hello", "[SEP]"]
    assert len(default) > len(bare) and len(passage) > len(bare)
    with pytest.raises(grpc.RpcError) as refused:
        tokens(prompt_name="nope")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as no_pairs:
        stub.Tokenize(
            berth_pb2.TokenizeRequest(model="prompted", texts=["a"], query="q"),
            timeout=30,
        )
    assert "query is for rerank models" in (no_pairs.value.details() or "")
