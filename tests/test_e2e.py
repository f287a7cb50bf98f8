"""The whole data path: gateway -> batcher -> engine, started by `berth serve`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.stack import Stack, health
from tests.texts import UTTERANCES, VARIED


def berth(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args, "--address", stack.gateway],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def st_model(repository: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    from services.repository import load_repository

    entry = load_repository(repository)["minilm"]
    # As packaged: it cuts texts at its max_seq_length, 256 tokens, as berth
    # does with options.truncate.
    return SentenceTransformer(str(entry.checkpoint_dir), device="cpu")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return np.sum(a * b, axis=-1)


def test_cli_embed_matches_sentence_transformers(stack: Stack, st_model: Any) -> None:
    done = berth(stack, "embed", "--model", "minilm", "--truncate", *VARIED)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert len(out) == len(VARIED)
    ours = np.array([item["embedding"] for item in out], dtype=np.float32)
    assert ours.shape == (len(VARIED), 384)
    # The model normalizes by default.
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    reference = st_model.encode(
        VARIED, convert_to_numpy=True, normalize_embeddings=True
    )
    cos = cosine(ours, reference)
    print("cosine vs sentence-transformers:", np.round(cos, 6).tolist())
    assert cos.min() >= 0.9999, cos
    assert max(item["tokens"] for item in out) == 256  # ~398, cut


def test_text_alone_equals_text_in_mixed_batch(
    client: berth_pb2_grpc.BerthStub,
) -> None:
    cut = berth_pb2.Options(truncate=True)  # VARIED's last text is over 256
    mixed = client.Embed(
        berth_pb2.EmbedRequest(model="minilm", texts=VARIED, options=cut), timeout=60
    )
    for i in (0, 2, 8, 9):
        alone = client.Embed(
            berth_pb2.EmbedRequest(model="minilm", texts=[VARIED[i]], options=cut),
            timeout=60,
        )
        a = np.array(alone.embeddings[0].values)
        b = np.array(mixed.embeddings[i].values)
        assert cosine(a, b) >= 0.9999


def test_cli_classify_alarm(stack: Stack) -> None:
    done = berth(stack, "classify", "--model", "intent", "set an alarm for 7 am")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out[0]["label"] == "alarm"
    assert 0.0 < out[0]["score"] <= 1.0


def test_cli_reads_texts_from_stdin_in_calls_the_gateway_takes(
    stack: Stack, client: berth_pb2_grpc.BerthStub
) -> None:
    """`berth classify -`: one text per line, blank lines skipped, sent in
    calls of at most 256 (the gateway's --max-texts), answers in order."""
    texts = [f"{UTTERANCES[i % len(UTTERANCES)]} {i}" for i in range(300)]
    stdin = "\n".join(texts[:150]) + "\n\n  \n" + "\n".join(texts[150:]) + "\n"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "classify", "--model", "intent", "-"]
        + ["--address", stack.gateway],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = [item["label"] for item in json.loads(done.stdout)]
    want = [
        r.labels[0].label
        for chunk in (texts[:150], texts[150:])
        for r in client.Classify(
            berth_pb2.ClassifyRequest(model="intent", texts=chunk), timeout=60
        ).results
    ]
    assert got == want
    empty = subprocess.run(
        [sys.executable, "-m", "services.cli", "embed", "-"]
        + ["--address", stack.gateway],
        input="\n\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert empty.returncode != 0 and "no texts on stdin" in empty.stderr


def test_intent_agrees_with_package_head(
    client: berth_pb2_grpc.BerthStub, st_model: Any
) -> None:
    import joblib
    import rag_intent_classifier

    models = Path(rag_intent_classifier.__file__).parent / "models"
    clf = joblib.load(models / "LogisticRegression.joblib")
    label_map = joblib.load(models / "label_map.joblib")

    def name(cls: str) -> str:
        mapped = str(label_map.get(cls, cls))
        return cls if mapped.lstrip("-").isdigit() else mapped

    embeddings = st_model.encode(UTTERANCES, normalize_embeddings=True)
    expected = [name(str(c)) for c in clf.predict(embeddings)]
    response = client.Classify(
        berth_pb2.ClassifyRequest(model="intent", texts=UTTERANCES, top_k=3), timeout=60
    )
    got = [r.labels[0].label for r in response.results]
    agreement = np.mean([a == b for a, b in zip(got, expected, strict=True)])
    print(f"intent agreement with the package head: {agreement:.3f} on {len(got)}")
    assert len(UTTERANCES) >= 50
    assert agreement >= 0.95
    for r in response.results:
        scores = [s.score for s in r.labels]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    ("request_kwargs", "fragment"),
    [
        ({"texts": []}, "texts is empty"),
        ({"texts": ["ok", ""]}, "texts[1] is empty"),
        ({"texts": ["x"] * 257}, "too many texts: 257"),
        ({"texts": ["word " * 300]}, "302 tokens, over the limit of 256"),
        ({"texts": ["a" * 20_000]}, "characters, over the limit"),
        ({"texts": ["hi"], "model": "nope"}, "unknown model 'nope'"),
        ({"texts": ["hi"], "model": "intent"}, "is a classify model"),
    ],
)
def test_bad_input_is_rejected_clearly(
    client: berth_pb2_grpc.BerthStub, request_kwargs: dict[str, Any], fragment: str
) -> None:
    request = berth_pb2.EmbedRequest(**{"model": "minilm", **request_kwargs})
    with pytest.raises(grpc.RpcError) as info:
        client.Embed(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()
    # The service stays healthy and answers the next good call.
    ok = client.Embed(
        berth_pb2.EmbedRequest(model="minilm", texts=["fine"]), timeout=30
    )
    assert len(ok.embeddings) == 1


def test_truncate_option_cuts_to_the_limit(client: berth_pb2_grpc.BerthStub) -> None:
    request = berth_pb2.EmbedRequest(
        model="minilm", texts=["word " * 600], options=berth_pb2.Options(truncate=True)
    )
    response = client.Embed(request, timeout=60)
    assert response.embeddings[0].tokens == 256


def test_normalize_option(client: berth_pb2_grpc.BerthStub) -> None:
    request = berth_pb2.EmbedRequest(
        model="minilm",
        texts=["hello world"],
        options=berth_pb2.Options(normalize=False),
    )
    raw = np.array(client.Embed(request, timeout=30).embeddings[0].values)
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3


def test_stream_answers_each_request(client: berth_pb2_grpc.BerthStub) -> None:
    requests = [
        berth_pb2.StreamRequest(
            embed=berth_pb2.EmbedRequest(model="minilm", texts=["a b c"], request_id=1)
        ),
        berth_pb2.StreamRequest(
            classify=berth_pb2.ClassifyRequest(
                model="intent", texts=["set an alarm for 7 am"], request_id=2
            )
        ),
        berth_pb2.StreamRequest(
            embed=berth_pb2.EmbedRequest(model="minilm", texts=[""], request_id=3)
        ),
    ]
    answers = {}
    for response in client.Stream(iter(requests), timeout=60):
        kind = response.WhichOneof("response")
        inner = getattr(response, kind)
        answers[inner.request_id] = (kind, inner)
    assert answers[1][0] == "embed" and len(answers[1][1].embeddings[0].values) == 384
    assert answers[2][0] == "classify"
    assert answers[2][1].results[0].labels[0].label == "alarm"
    assert answers[3][0] == "error" and answers[3][1].code == "INVALID_ARGUMENT"


def test_models_and_tokenize(stack: Stack, client: berth_pb2_grpc.BerthStub) -> None:
    done = berth(stack, "models")
    assert done.returncode == 0, done.stderr
    models = {m["name"]: m for m in json.loads(done.stdout)}
    assert models["minilm"]["task"] == "embed"
    assert models["minilm"]["dimension"] == 384
    assert models["minilm"]["maxTokens"] == 256
    assert models["intent"]["task"] == "classify"
    assert len(models["intent"]["labels"]) == 157
    assert "connect_to_human" in models["intent"]["labels"]
    tokens = client.Tokenize(
        berth_pb2.TokenizeRequest(model="minilm", texts=["Hello world"]), timeout=10
    )
    assert tokens.results[0].tokens == ["[CLS]", "hello", "world", "[SEP]"]


def test_every_service_reports_health(stack: Stack) -> None:
    assert health(stack.gateway) == "SERVING"
    assert health(stack.gateway, "berth.v1.Berth") == "SERVING"
    assert health(stack.batcher) == "SERVING"
    for engine in stack.engines:
        assert health(engine) == "SERVING"
    done = berth(stack, "health")
    assert done.returncode == 0 and done.stdout.strip() == "SERVING"


def test_reflection_lists_services(stack: Stack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(stack.gateway) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
    names = {s.name for s in reply.list_services_response.service}
    assert {"berth.v1.Berth", "grpc.health.v1.Health"} <= names
