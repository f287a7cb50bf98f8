"""`berth serve --model DIR`: names, tasks and refusals of checkpoint
directories, the generated repository, and one real serve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.cli.checkpoints import (
    derive_name,
    generated_names,
    plan_models,
    split_spec,
    write_repository,
)
from services.cli.default_models import minilm_checkpoint
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.repository import load_repository
from tests.engine.test_checkpoint_classifiers import LABELS, write_classifier
from tests.stack import ROOT, Stack, serving

MINILM = minilm_checkpoint()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A classifier, a bare encoder (BertModel) and a copy of the
    sentence-transformers minilm checkpoint."""
    import transformers as tf

    root = tmp_path_factory.mktemp("checkpoints")
    write_classifier(root / "My_Sentiment v2", "roberta", "single")
    bare = root / "bare"
    config = tf.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
    )  # fmt: skip
    tf.BertModel(config).save_pretrained(bare, safe_serialization=True)
    shutil.copy(MINILM / "tokenizer.json", bare / "tokenizer.json")
    return {
        "classifier": root / "My_Sentiment v2",
        "bare": bare,
        "sentence": MINILM,
    }


def test_names_from_the_flag_or_the_directory() -> None:
    assert split_spec("intent=/m/x") == ("intent", "/m/x")
    assert split_spec("/m/a=b") == (None, "/m/a=b")
    assert split_spec("/m/x") == (None, "/m/x")
    assert derive_name(Path("/m/My_Sentiment v2")) == "my_sentiment-v2"
    assert derive_name(Path("/m/BAAI--bge.small!")) == "baai--bge.small"


def test_the_task_comes_from_the_checkpoint(checkpoints: dict[str, Path]) -> None:
    models = plan_models(
        [str(checkpoints["classifier"]), f"enc={checkpoints['bare']}"]
        + [str(checkpoints["sentence"])]
    )
    assert [(m.name, m.task) for m in models] == [
        ("my_sentiment-v2", "classify"),
        ("enc", "embed"),
        ("model", "embed"),
    ]


def _broken(tmp_path: Path, source: Path, name: str) -> Path:
    directory = tmp_path / name
    shutil.copytree(source, directory)
    return directory


def test_bad_directories_are_refused_naming_them(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    def refusal(spec: str) -> str:
        with pytest.raises(ValueError) as caught:
            plan_models([spec])
        return str(caught.value)

    missing = tmp_path / "missing"
    assert refusal(str(missing)) == f"--model {missing}: {missing}: not a directory"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in refusal(str(empty))
    no_tokenizer = _broken(tmp_path, checkpoints["bare"], "no_tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    assert f"{no_tokenizer}: no tokenizer.json" in refusal(str(no_tokenizer))
    gpt = _broken(tmp_path, checkpoints["bare"], "gpt")
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "model_type 'gpt2' is not supported" in refusal(str(gpt))
    albert = _broken(tmp_path, checkpoints["classifier"], "albert")
    config = json.loads((albert / "config.json").read_text())
    config["architectures"] = ["AlbertForSequenceClassification"]
    (albert / "config.json").write_text(json.dumps(config))
    message = refusal(str(albert))
    assert "AlbertForSequenceClassification is not supported" in message
    pickled = _broken(tmp_path, checkpoints["bare"], "pickled")
    (pickled / "model.safetensors").unlink()
    assert "no model.safetensors" in refusal(str(pickled))
    bare = checkpoints["bare"]
    with pytest.raises(ValueError, match="the name 'bare' is taken by --model"):
        plan_models([str(bare), str(bare)])
    assert "is no model name" in refusal(f"-x={bare}")


def test_the_generated_repository(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    """--model entries next to the repository's; a clash is refused; other
    flags, another directory."""
    repository = tmp_path / "repository"
    (repository / "enc").mkdir(parents=True)
    spec = {"name": "enc", "task": "embed", "checkpoint": str(checkpoints["bare"])}
    (repository / "enc" / "berth.json").write_text(json.dumps(spec))
    cache = tmp_path / "cache"
    models = plan_models([f"sentiment={checkpoints['classifier']}"])
    root = write_repository(models, repository, cache)
    entries = load_repository(root)
    assert sorted(entries) == ["enc", "sentiment"]
    assert entries["sentiment"].checkpoint_head
    assert entries["sentiment"].label_names() == LABELS
    assert entries["sentiment"].checkpoint_dir == checkpoints["classifier"]
    assert (root / "enc").is_symlink() and generated_names(root) == ["sentiment"]
    assert write_repository(models, repository, cache) == root
    other = write_repository(plan_models([str(checkpoints["bare"])]), repository, cache)
    assert other != root and generated_names(other) == ["bare"]
    with pytest.raises(ValueError, match="already has a model 'enc'"):
        write_repository(plan_models([f"enc={checkpoints['bare']}"]), repository, cache)


def test_serve_refuses_a_bad_model_before_anything_starts(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--model", str(missing)]
        + ["--model-repository", str(tmp_path / "repository")],
        cwd=ROOT,
        env={**os.environ, "BERTH_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--model {missing}: {missing}: not a directory" in done.stderr


def test_serve_model_answers(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    """A checkpoint directory served with no repository: its fallback built,
    a Classify answered by the model with the checkpoint's labels."""
    cache = tmp_path / "cache"
    stack = Stack(
        tmp_path / "no-repository",
        env={"BERTH_CACHE_DIR": str(cache)},
        extra_args=["--model", str(checkpoints["classifier"])],
    )
    with (
        serving(stack, timeout=300) as stack,
        grpc.insecure_channel(stack.gateway) as channel,
    ):
        stub = berth_pb2_grpc.BerthStub(channel)
        request = berth_pb2.ClassifyRequest(
            model="my_sentiment-v2", texts=["hello world", "berth"], top_k=3
        )
        response = stub.Classify(request, timeout=60)
    assert not response.degraded
    for result in response.results:
        assert sorted(label.label for label in result.labels) == sorted(LABELS)
        assert abs(sum(label.score for label in result.labels) - 1) < 1e-5
    assert list(cache.glob("serve-repositories/*/my_sentiment-v2/fallback.safetensors"))
