"""Cross-encoders served as rerank models, against sentence-transformers'
CrossEncoder in float32.

Each case writes a tiny random ``*ForSequenceClassification`` checkpoint of
one label with transformers (every parameter scrambled, the head's and the
token-type table's included), tokenizes (query, text) pairs with the
gateway's own encoder, runs them on the torch and onnxruntime backends and
compares the scores with ``CrossEncoder.predict``; then the real stack
serves one through ``berth serve --model DIR`` and answers the Rerank call,
unary and streamed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from engine.model import load_served_model
from engine.onnx_backend import OnnxRuntimeBackend
from gateway.batcher_client import BatcherClient
from gateway.berth import Berth, activated
from gateway.pipeline import Gateway
from gateway.tokenize import Limits, TextEncoder
from services import hf_classifier
from services.errors import InvalidInput
from services.pair_fallback import PairFallback
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import RepositoryError, load_entry
from tests.engine.test_checkpoint_classifiers import add_entry, write_classifier
from tests.stack import ROOT, Stack, free_ports, serving

ARCHITECTURES = ["bert", "distilbert", "roberta", "xlm-roberta", "mpnet", "modernbert"]
QUERY = "How do transformer encoders rank passages?"
TEXTS = [
    "A cross-encoder reads the query and the passage together.",
    "Bananas are rich in potassium.",
    "berth serves transformer encoders over gRPC " * 3,
    "東京の天気は晴れです 🌤️ and emoji 🚀🚀",
    "a",
    "Naïve Café Façade — Résumé, numbers 12345 and symbols #@!",
]
SCORE_TOLERANCE = 1e-4


def write_cross_encoder(directory: Path, arch: str) -> None:
    """A tiny random one-label classifier named a CrossEncoder, as
    sentence-transformers saves one; positions for 64 tokens."""
    write_classifier(directory, arch, "regression")
    config = json.loads((directory / "config.json").read_text())
    config.pop("problem_type")
    config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    config["sentence_transformers"] = {
        "activation_fn": "torch.nn.modules.activation.Sigmoid"
    }
    (directory / "config.json").write_text(json.dumps(config))


def write_rerankers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository of one rerank entry per architecture."""
    root = tmp_path_factory.mktemp("rerankers")
    checkpoints = tmp_path_factory.mktemp("reranker_checkpoints")
    for arch in ARCHITECTURES:
        write_cross_encoder(checkpoints / arch, arch)
        add_entry(root, arch, checkpoints / arch, task="rerank")
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rerankers(tmp_path_factory)


def cross_encoder_scores(checkpoint: Path, query: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(checkpoint), device="cpu")
    scores = model.predict([(query, t) for t in texts], convert_to_numpy=True)
    return np.asarray(scores, dtype=np.float64)


def padded(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(r) for r in rows], np.int32)
    batch = np.zeros((len(rows), int(lengths.max())), np.int32)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = row
    return batch, lengths


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scores_equal_sentence_transformers(
    built: Path, tmp_path: Path, arch: str, backend: str
) -> None:
    entry = load_entry(built / arch)
    assert entry.task == "rerank" and entry.checkpoint_head
    rows = TextEncoder(entry, Limits()).encode_pairs(QUERY, TEXTS, truncate=False)
    batch, lengths = padded(rows)
    if backend == "torch":
        model = load_served_model(entry)
        with torch.inference_mode():
            out = model(torch.from_numpy(batch).long(), torch.from_numpy(lengths))
        logits = out.numpy()
    else:
        onnx = OnnxRuntimeBackend("cpu", threads=2, cache=tmp_path)
        onnx.load(entry)
        logits = onnx.run(arch, batch, lengths)
    assert logits.shape == (len(TEXTS), 1)
    ours = activated(logits[:, 0], "sigmoid")
    theirs = cross_encoder_scores(entry.checkpoint_dir, QUERY, TEXTS)
    diff = float(np.abs(ours - theirs).max())
    print(f"{arch} on {backend}: max |score diff| {diff:.1e}")
    assert diff <= SCORE_TOLERANCE, diff
    assert list(np.argsort(-ours)) == list(np.argsort(-theirs))


def test_pairs_carry_their_token_types(built: Path) -> None:
    """A BERT pair's second text is moved past the vocabulary (its segment
    folded into the ids); a RoBERTa-shaped one of a single type is not."""
    from transformers import AutoTokenizer

    entry = load_entry(built / "bert")
    vocab = json.loads((entry.checkpoint_dir / "config.json").read_text())["vocab_size"]
    assert entry.token_type_offset() == vocab
    hf = AutoTokenizer.from_pretrained(str(entry.checkpoint_dir))
    (ours,) = TextEncoder(entry, Limits()).encode_pairs(QUERY, TEXTS[:1], False)
    theirs = hf(QUERY, TEXTS[0])
    types = np.asarray(theirs["token_type_ids"])
    assert types.max() == 1  # both segments are there
    assert list(ours) == list(np.asarray(theirs["input_ids"]) + types * vocab)
    assert load_entry(built / "mpnet").token_type_offset() == 0
    assert load_entry(built / "distilbert").token_type_offset() == 0


def test_a_long_pair_is_refused_or_cut_as_transformers_cuts_it(built: Path) -> None:
    from transformers import AutoTokenizer

    entry = load_entry(built / "bert")
    limit = entry.max_tokens
    assert limit == 64
    encoder = TextEncoder(entry, Limits())
    long_text = "transformer encoders rank passages " * 12
    long_query = "which passage answers this question " * 14

    with pytest.raises(InvalidInput, match=r"query and texts\[1\] have \d+ tokens"):
        encoder.encode_pairs(QUERY, ["short", long_text], truncate=False)
    hf = AutoTokenizer.from_pretrained(str(entry.checkpoint_dir))
    for query, text in [
        (QUERY, long_text),
        (long_query, "short"),
        (long_query, long_text),
    ]:
        (ours,) = encoder.encode_pairs(query, [text], truncate=True)
        theirs = hf(query, text, truncation="longest_first", max_length=limit)
        types = np.asarray(theirs["token_type_ids"])
        assert len(ours) == limit
        assert list(ours) == list(np.asarray(theirs["input_ids"]) + types * 30522)


def test_what_a_rerank_entry_cannot_be(tmp_path: Path) -> None:
    checkpoint = tmp_path / "three_labels"
    write_classifier(checkpoint, "bert", "single")
    with pytest.raises(RepositoryError, match="has 3 labels"):
        load_entry(add_entry(tmp_path / "repo", "r", checkpoint, task="rerank"))
    scorer = tmp_path / "scorer"
    write_cross_encoder(scorer, "bert")
    entry_dir = add_entry(
        tmp_path / "repo", "h", scorer, task="rerank", head="h.safetensors"
    )
    with pytest.raises(RepositoryError, match="leave head and labels out"):
        load_entry(entry_dir)


def test_which_checkpoints_are_rerankers(tmp_path: Path) -> None:
    """A one-label classifier named a CrossEncoder, or of no problem_type,
    is a reranker; a regression one and a many-label one classify."""
    write_cross_encoder(tmp_path / "ce", "bert")
    assert hf_classifier.checkpoint_task(tmp_path / "ce") == "rerank"
    write_classifier(tmp_path / "regression", "bert", "regression")
    assert hf_classifier.checkpoint_task(tmp_path / "regression") == "classify"
    write_classifier(tmp_path / "labels", "bert", "single")
    assert hf_classifier.checkpoint_task(tmp_path / "labels") == "classify"
    config = json.loads((tmp_path / "ce/config.json").read_text())
    config["sentence_transformers"]["activation_fn"] = (
        "torch.nn.modules.linear.Identity"
    )
    (tmp_path / "ce/config.json").write_text(json.dumps(config))
    classifier = hf_classifier.read_classifier(tmp_path / "ce")
    assert classifier is not None and classifier.activation == "identity"
    config["sentence_transformers"]["activation_fn"] = "my.module.Activation"
    (tmp_path / "ce/config.json").write_text(json.dumps(config))
    with pytest.raises(hf_classifier.ClassifierConfigError, match="not supported"):
        hf_classifier.read_classifier(tmp_path / "ce")


def test_the_stack_reranks(tmp_path: Path) -> None:
    """``berth serve --model NAME=DIR`` serves a cross-encoder as a rerank
    model; Rerank answers as CrossEncoder scores, sorted, cut to top_k,
    with texts, raw; streamed too; bad calls get clear errors."""
    checkpoint = tmp_path / "ms-marco-tiny"
    write_cross_encoder(checkpoint, "bert")
    theirs = cross_encoder_scores(checkpoint, QUERY, TEXTS)
    env = {"BERTH_CACHE_DIR": str(tmp_path / "cache")}
    stack = Stack(
        tmp_path / "repo",
        env=env,
        extra_args=["--model", f"ranker={checkpoint}"],
    )
    with serving(stack), grpc.insecure_channel(stack.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        info = stub.ModelInfo(berth_pb2.ModelInfoRequest(model="ranker"))
        assert info.models[0].task == "rerank"
        plain = stub.Rerank(
            berth_pb2.RerankRequest(model="ranker", query=QUERY, texts=TEXTS),
            timeout=60,
        )
        assert not plain.degraded
        assert [r.index for r in plain.results] == list(range(len(TEXTS)))
        scores = np.array([r.score for r in plain.results])
        assert np.abs(scores - theirs).max() <= SCORE_TOLERANCE
        assert all(r.tokens > 2 and not r.text for r in plain.results)
        shown = stub.Tokenize(
            berth_pb2.TokenizeRequest(model="ranker", texts=TEXTS[:2], query=QUERY),
            timeout=60,
        )
        assert [len(t.ids) for t in shown.results] == [
            r.tokens for r in plain.results[:2]
        ]
        assert shown.results[1].tokens[-2:] == [".", "[SEP]"]
        assert list(shown.results[1].tokens).count("[SEP]") == 2

        best = stub.Rerank(
            berth_pb2.RerankRequest(
                model="ranker", query=QUERY, texts=TEXTS, top_k=3, return_text=True
            ),
            timeout=60,
        )
        order = list(np.argsort(-theirs, kind="stable")[:3])
        assert [r.index for r in best.results] == order
        assert [r.text for r in best.results] == [TEXTS[i] for i in order]
        command = [sys.executable, "-m", "services.cli", "rerank", "--model"]
        command += ["ranker", "--query", QUERY, "--top-k", "2"]
        command += ["--address", stack.gateway, *TEXTS]
        printed = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, check=True
        )
        ranked = json.loads(printed.stdout)
        assert [item["index"] for item in ranked] == order[:2]
        assert [item["text"] for item in ranked] == [TEXTS[i] for i in order[:2]]

        raw = stub.Rerank(
            berth_pb2.RerankRequest(
                model="ranker", query=QUERY, texts=TEXTS, raw_scores=True, sort=True
            ),
            timeout=60,
        )
        logits = np.log(theirs / (1 - theirs))
        assert [r.index for r in raw.results] == list(
            np.argsort(-theirs, kind="stable")
        )
        by_index = {r.index: r.score for r in raw.results}
        raw_scores = np.array([by_index[i] for i in range(len(TEXTS))])
        assert np.abs(raw_scores - logits).max() <= 1e-3

        streamed = list(
            stub.Stream(
                iter(
                    [
                        berth_pb2.StreamRequest(
                            rerank=berth_pb2.RerankRequest(
                                model="ranker", query=QUERY, texts=TEXTS, request_id=7
                            )
                        )
                    ]
                ),
                timeout=60,
            )
        )
        assert streamed[0].WhichOneof("response") == "rerank"
        assert streamed[0].rerank.request_id == 7
        assert [r.score for r in streamed[0].rerank.results] == [
            r.score for r in plain.results
        ]

        refusals = [
            (berth_pb2.RerankRequest(model="ranker", query="", texts=TEXTS), "query"),
            (
                berth_pb2.RerankRequest(
                    model="ranker", query=QUERY, texts=["fine", "word " * 300]
                ),
                "texts[1]",
            ),
            (
                berth_pb2.RerankRequest(
                    model="ranker",
                    query=QUERY,
                    texts=TEXTS,
                    options=berth_pb2.Options(dimensions=8),
                ),
                "options.dimensions",
            ),
        ]
        for request, field in refusals:
            with pytest.raises(grpc.RpcError) as refused:
                stub.Rerank(request, timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field.split("[")[0] in refused.value.details()
        with pytest.raises(grpc.RpcError) as wrong_call:
            stub.Embed(berth_pb2.EmbedRequest(model="ranker", texts=TEXTS), timeout=60)
        assert "call Rerank" in wrong_call.value.details()
        cut = stub.Rerank(
            berth_pb2.RerankRequest(
                model="ranker",
                query=QUERY,
                texts=["word " * 300],
                options=berth_pb2.Options(truncate=True),
            ),
            timeout=60,
        )
        assert cut.results[0].tokens == 64
        # The service is still whole after the refusals.
        again = stub.Rerank(
            berth_pb2.RerankRequest(model="ranker", query=QUERY, texts=TEXTS),
            timeout=60,
        )
        assert [r.score for r in again.results] == [r.score for r in plain.results]


@pytest.mark.parametrize("arch", ["bert", "roberta", "mpnet"])
def test_the_fallback_ranks_by_the_words_the_query_holds(
    built: Path, arch: str
) -> None:
    """With no batcher to reach, Rerank is answered degraded by the lexical
    fallback: the text holding the query's words ranks first, one holding
    none last; ids with and without a token-type offset split alike."""
    entry = load_entry(built / arch)
    query = "what is the capital of France"
    texts = [
        "Bananas are yellow and sweet.",
        "Paris is the capital of France.",
        "France is a country in Europe.",
    ]

    async def rerank() -> berth_pb2.RerankResponse:
        (nowhere,) = free_ports(1)
        batcher = BatcherClient(f"127.0.0.1:{nowhere}")
        try:
            gateway = Gateway({arch: entry}, batcher, Limits(), max_in_flight=4)
            gateway.started = True
            request = berth_pb2.RerankRequest(
                model=arch, query=query, texts=texts, sort=True
            )
            response, _ = await Berth(gateway).rerank(request, timeout_s=10)
            return response
        finally:
            await batcher.close()

    response = asyncio.run(rerank())
    assert response.degraded
    assert [r.index for r in response.results] == [1, 2, 0]
    scores = [r.score for r in response.results]
    assert 0.0099 < scores[-1] < scores[1] < scores[0] < 0.9901


def test_the_fallback_splits_a_pair_at_its_first_separator(built: Path) -> None:
    """<s> query </s></s> text </s> (RoBERTa's pair) splits as [CLS] query
    [SEP] text [SEP] does: special tokens are never words."""
    entry = load_entry(built / "mpnet")
    fallback = PairFallback("mpnet", entry.tokenizer(), 0)
    cls, sep = 101, 102
    query, text = [2054, 2003], [3000, 2003, 1996]
    for ids in ([cls, *query, sep, *text, sep], [cls, *query, sep, sep, *text, sep]):
        got_query, got_text = fallback.split(np.array(ids, np.int32))
        assert list(got_query) == query and list(got_text) == text
    offset = PairFallback("bert", entry.tokenizer(), 30522)
    moved = [cls, *query, sep, *(t + 30522 for t in text), sep + 30522]
    got_query, got_text = offset.split(np.array(moved, np.int32))
    assert list(got_query) == query and list(got_text) == text


def test_kserve_serves_a_rerank_model_with_two_inputs(tmp_path: Path) -> None:
    """KServe v2: QUERY [1] and TEXT [N] in, SCORE [N] out, as Rerank
    scores; metadata and config say so; a call without QUERY, or with an
    option a rerank model does not take, is refused naming the field."""
    import tritonclient.grpc as triton
    from google.rpc import error_details_pb2, status_pb2

    checkpoint = tmp_path / "ranker"
    write_cross_encoder(checkpoint, "bert")
    theirs = cross_encoder_scores(checkpoint, QUERY, TEXTS)
    env = {"BERTH_CACHE_DIR": str(tmp_path / "cache")}
    stack = Stack(tmp_path / "repo", env=env, extra_args=["--model", f"r={checkpoint}"])

    def tensors(query: list[str] | None) -> list[Any]:
        text = triton.InferInput("TEXT", [len(TEXTS)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], object))
        if query is None:
            return [text]
        asked = triton.InferInput("QUERY", [len(query)], "BYTES")
        asked.set_data_from_numpy(np.array([q.encode() for q in query], object))
        return [asked, text]

    with serving(stack):
        client = triton.InferenceServerClient(stack.gateway)
        metadata = client.get_model_metadata("r")
        shapes = {t.name: [int(d) for d in t.shape] for t in metadata.inputs}
        assert shapes == {"QUERY": [1], "TEXT": [-1]}
        assert [(t.name, list(t.shape)) for t in metadata.outputs] == [("SCORE", [-1])]
        config = client.get_model_config("r").config
        assert config.parameters["task"].string_value == "rerank"
        assert [i.name for i in config.input] == ["QUERY", "TEXT"]
        scores = client.infer("r", tensors([QUERY])).as_numpy("SCORE")
        assert scores.shape == (len(TEXTS),)
        assert np.abs(scores - theirs).max() <= SCORE_TOLERANCE
        raw = client.infer(
            "r", tensors([QUERY]), parameters={"raw_scores": True}
        ).as_numpy("SCORE")
        np.testing.assert_allclose(1 / (1 + np.exp(-raw)), scores, atol=1e-6)
        refusals = [
            (tensors(None), {}, "takes two inputs, QUERY (BYTES, shape [1]"),
            (tensors([QUERY, QUERY]), {}, "input QUERY holds 2 texts"),
            (tensors([QUERY]), {"prompt_name": "query"}, "options.prompt_name"),
            (tensors([QUERY]), {"dimensions": 4}, "it takes truncate, raw_scores"),
        ]
        for inputs, parameters, words in refusals:
            with pytest.raises(triton.InferenceServerException) as refused:
                client.infer("r", inputs, parameters=parameters)
            assert "INVALID_ARGUMENT" in str(refused.value.status())
            assert words in str(refused.value.message())
        client.close()
        with grpc.insecure_channel(stack.gateway) as channel:
            # tritonclient's stubs: berth's own register the same proto names.
            from tritonclient.grpc import service_pb2 as pb
            from tritonclient.grpc import service_pb2_grpc as pb_grpc

            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for query, field in ((None, "inputs"), ([QUERY, QUERY], "inputs[0].shape")):
                request = pb.ModelInferRequest(model_name="r")
                for name, values in (("QUERY", query), ("TEXT", TEXTS)):
                    if values is None:
                        continue
                    tensor = request.inputs.add(
                        name=name, datatype="BYTES", shape=[len(values)]
                    )
                    tensor.contents.bytes_contents.extend(v.encode() for v in values)
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ModelInfer(request, timeout=60)
                trailer = dict(refused.value.trailing_metadata() or ())
                status = status_pb2.Status.FromString(
                    trailer["grpc-status-details-bin"]
                )
                fields = []
                for detail in status.details:
                    if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                        bad = error_details_pb2.BadRequest()
                        detail.Unpack(bad)
                        fields += [v.field for v in bad.field_violations]
                assert fields == [field], (query, fields)
