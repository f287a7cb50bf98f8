"""The Python client (clients/python, berth_client): installed into a virtual
environment of its own, with grpcio and protobuf at its floors and nothing
of berth's server, and used there (tests/clients/python_client_calls.py)
against real `berth serve` stacks: API keys, two gateways round-robin, a
cross-encoder reranking, mutual TLS; and against fake gateways for its retry
policy. Its stubs are generated from protos/ when it is built
(clients/python/setup.py)."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.metrics import requests, scrape
from tests.pki import Pki, issue
from tests.stack import ROOT, Stack, serving
from tests.test_dependencies import FIXED_IN, pins
from tests.test_rerank import QUERY, TEXTS, write_cross_encoder

CLIENT = ROOT / "clients" / "python"
CALLS = Path(__file__).with_name("python_client_calls.py")
KEY = "client-test-key-0123456789abcdef"
LIMITED_KEY = "client-test-key-minilm-only-0123"
# What the client's environment may hold: the client, what it requires, and
# what grpcio requires.
ALLOWED = {"berth-client", "grpcio", "protobuf", "typing-extensions"}


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "generate_stubs", CLIENT / "generate_stubs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def floors() -> dict[str, Version]:
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())
    out = {}
    for raw in project["project"]["dependencies"]:
        req = Requirement(raw)
        (low,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
        out[canonicalize_name(req.name)] = low
    return out


def test_the_floors_are_what_the_stubs_need_and_past_advisories(
    tmp_path: Path,
) -> None:
    """The stubs a build writes (the public API alone, never internal.proto)
    need no newer grpcio or protobuf than the client's floors."""
    out = tmp_path / "berth_client" / "_proto"
    names = {str(p.relative_to(out)) for p in generator().generate(out)}
    assert "berth/v1/berth_pb2.py" in names
    assert not any("internal" in name for name in names)
    stubs = out / "berth" / "v1"
    grpc_file = (stubs / "berth_pb2_grpc.py").read_text()
    pb2 = (stubs / "berth_pb2.py").read_text()
    generated = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", grpc_file, re.M)
    gencode = re.search(r"^# Protobuf Python Version: (\S+)$", pb2, re.M)
    assert generated and gencode
    low = floors()
    assert set(low) == {"grpcio", "protobuf"}, low
    assert low["grpcio"] >= Version(generated[1])
    assert low["protobuf"] >= Version(gencode[1])
    pinned = pins()
    for name, version in low.items():
        assert version >= Version(FIXED_IN[name][0]), f"{name} admits {FIXED_IN[name]}"
        assert pinned[name] >= version, f"constraints.txt pins {name} below its floor"


def install(folder: Path) -> tuple[Path, float]:
    """A venv without pip holding the client, built from a copy of its folder
    and of protos/, laid out as in a checkout (the build writes build/ and
    *.egg-info beside the sources, and reads ../../protos), with grpcio and
    protobuf at the client's floors and everything else as constraints.txt
    pins it; the venv's python and the seconds it took."""
    started = time.monotonic()
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    leftovers = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "_proto")
    source = shutil.copytree(
        CLIENT, folder / "checkout" / "clients" / "python", ignore=leftovers
    )
    shutil.copytree(ROOT / "protos", folder / "checkout" / "protos")
    constraints = folder / "constraints.txt"
    low = floors()
    constraints.write_text(
        "".join(
            f"{name}=={low[name]}\n" if name in low else f"{line}\n"
            for line in (ROOT / "constraints.txt").read_text().splitlines()
            for name in [canonicalize_name(line.partition("==")[0])]
        )
    )
    python = venv / "bin" / "python"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", python, "install", "-q"),
            *("-c", constraints, "--build-constraint", ROOT / "constraints.txt"),
            source,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return python, time.monotonic() - started


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python, seconds = install(tmp_path_factory.mktemp("berth-client"))
    print(f"berth-client installed in a fresh venv in {seconds:.1f} s")
    return python


def run(python: Path, scenario: str, **args: Any) -> Any:
    """A scenario of python_client_calls.py in the client's venv (-I: no
    path of berth's, no PYTHON* variable): what it printed last."""
    done = subprocess.run(
        [python, "-I", CALLS, scenario, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=python.parent,
    )
    assert done.returncode == 0, f"{scenario}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.splitlines()[-1])


def test_the_client_needs_only_grpcio_and_protobuf(client_python: Path) -> None:
    found = run(client_python, "installed")
    versions = {canonicalize_name(n): v for n, v in found["distributions"].items()}
    assert set(versions) <= ALLOWED and "berth-client" in versions, versions
    assert found["present"] == [], found["present"]
    loaded = {m.split(".")[0] for m in found["modules"]}
    assert not loaded & {"numpy", "torch", "services", "gateway"}
    for name, low in floors().items():
        assert Version(versions[name]) == low, f"{name} {versions[name]}, floor {low}"


@pytest.fixture(scope="module")
def keyed(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Two gateways, each also on a port of its own, taking API keys; the
    default models and a tiny cross-encoder, "ranker"."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{KEY}\n{LIMITED_KEY} minilm\n")
    ranker = tmp_path_factory.mktemp("ranker") / "cross-encoder"
    write_cross_encoder(ranker, "bert")
    stack = Stack(
        repository,
        gateways=2,
        own_ports=True,
        extra_args=["--api-keys-file", str(keys), "--model", f"ranker={ranker}"],
    )
    with serving(stack):
        deadline = time.monotonic() + 120
        while stack.logs().count("gateway SERVING on") < 2:
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.2)
        yield stack


def test_calls_and_their_errors(client_python: Path, keyed: Stack) -> None:
    found = run(
        client_python, "calls", address=keyed.gateway, key=KEY, limited_key=LIMITED_KEY
    )
    assert {"minilm", "intent"} <= set(found["models"])
    assert found["best"], found
    assert found["truncated_tokens"] == found["max_tokens"]
    assert found["deadline"] == "DEADLINE_EXCEEDED"


def test_stream_pipelines_in_order(client_python: Path, keyed: Stack) -> None:
    found = run(client_python, "stream", address=keyed.gateway, key=KEY)
    assert found["answers"] == 100


def same_results(found: list[list[Any]], expected: list[list[Any]]) -> None:
    """[index, score, tokens, text] items: equal, the scores to float32's
    precision (another gateway of the stack may have computed them)."""
    assert [[i, n, t] for i, _, n, t in found] == [
        [i, n, t] for i, _, n, t in expected
    ], (found, expected)
    for (_, ours, _, _), (_, theirs, _, _) in zip(found, expected, strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (found, expected)


def fields_at_fault(trailer: str) -> list[str]:
    """The BadRequest fields of a google.rpc.Status trailer, base64."""
    status = status_pb2.Status.FromString(base64.b64decode(trailer))
    fields = []
    for packed in status.details:
        if packed.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            packed.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


def test_rerank_unary_async_and_streamed(client_python: Path, keyed: Stack) -> None:
    """The client's Rerank answers, sync, async and streamed, are the
    gateway's own (asked here with berth's stubs); a refused call names the
    field at fault."""
    found = run(
        client_python,
        "rerank",
        address=keyed.gateway,
        key=KEY,
        limited_key=LIMITED_KEY,
        query=QUERY,
        texts=TEXTS,
    )
    auth = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(keyed.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)

        def gateway(**fields: Any) -> list[list[Any]]:
            request = berth_pb2.RerankRequest(
                model="ranker", query=QUERY, texts=TEXTS, **fields
            )
            reply = stub.Rerank(request, metadata=auth, timeout=60)
            return [[r.index, r.score, r.tokens, r.text] for r in reply.results]

        plain = gateway()
        best = gateway(top_k=3, return_text=True)
        raw = gateway(sort=True, raw_scores=True)
    assert [item[3] for item in best] == [TEXTS[item[0]] for item in best]
    for kind, expected in (("plain", plain), ("best", best), ("raw", raw)):
        same_results(found[kind], expected)
    for side in (found, found["async"]):
        for streamed, expected in zip(
            side["streamed"], (plain, best, raw), strict=True
        ):
            same_results(streamed, expected)
    same_results(found["async"]["plain"], plain)
    same_results(found["async"]["best"], best)
    # The ranker's limit is 64 tokens: the long pair cut to it.
    assert found["cut_tokens"][1] == 64 and found["cut_tokens"][0] < 64
    assert "texts[1]" in found["refused"]["message"]
    assert fields_at_fault(found["refused"]["details"]) == ["texts[1]"]
    assert fields_at_fault(found["async"]["refused"]) == ["texts[1]"]
    assert fields_at_fault(found["option_refused"]) == ["options.dimensions"]


def test_round_robin_reaches_both_gateways(client_python: Path, keyed: Stack) -> None:
    # /metrics: gateway 0, the batcher, the engine, then gateway 1.
    urls = (keyed.metrics[0], keyed.metrics[3])

    def counts() -> list[float]:
        return [requests(scrape(u), "minilm", "embed", "ok") for u in urls]

    before = counts()
    run(client_python, "round_robin", addresses=keyed.own_gateways, key=KEY, calls=20)
    gained = [a - b for a, b in zip(counts(), before, strict=True)]
    assert sum(gained) == 20 and min(gained) >= 5, gained


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca, other_ca = issue("client test CA"), issue("another CA")
    pki = Pki(
        tmp_path_factory.mktemp("client-pki"),
        ca,
        issue("berth gateway", ca, server=True),
        issue("a caller", ca),
        other_ca,
        issue("stranger", other_ca),
    )
    for name, data in (
        ("ca.pem", ca.cert_pem),
        ("other-ca.pem", other_ca.cert_pem),
        ("server.pem", pki.server.cert_pem),
        ("server.key", pki.server.key_pem),
        ("client.pem", pki.client.cert_pem),
        ("client.key", pki.client.key_pem),
    ):
        pki.write(name, data)
    return pki


def test_mutual_tls(client_python: Path, repository: Path, pki: Pki) -> None:
    files = {name: str(pki.folder / name) for name in ("ca.pem", "client.pem")}
    stack = Stack(
        repository,
        extra_args=[
            *("--tls-cert", str(pki.folder / "server.pem")),
            *("--tls-key", str(pki.folder / "server.key")),
            *("--tls-client-ca", files["ca.pem"]),
        ],
    )
    credentials = grpc.ssl_channel_credentials(
        pki.ca.cert_pem, pki.client.key_pem, pki.client.cert_pem
    )
    try:
        stack.wait_serving(credentials=credentials)
        found = run(
            client_python,
            "tls",
            address=stack.gateway,
            ca=files["ca.pem"],
            cert=files["client.pem"],
            key=str(pki.folder / "client.key"),
            other_ca=str(pki.folder / "other-ca.pem"),
        )
    finally:
        code = stack.stop()
    assert code == 0, stack.logs()
    assert max(found["refused_seconds"]) < 8, found


def test_retries(client_python: Path) -> None:
    found = run(client_python, "retries")
    # UNAVAILABLE twice, then answered: three attempts, one call.
    assert found["unavailable_attempts"] == 3
    assert found["no_retry_attempts"] == 1
    # RESOURCE_EXHAUSTED is not retried unless asked; then after the
    # gateway's push-back.
    assert found["overloaded"] == {"attempts": 1, "retry_after_ms": 300}
    assert found["overloaded_retried"]["attempts"] == 2
    assert found["overloaded_async_retry_after_ms"] == 300
    assert found["overloaded_retried"]["seconds"] >= 0.3
    assert found["nothing_listening_seconds"] < 5
    assert 0.5 < found["waited_seconds"] < 10
    # The first stream ends at its 6th request, having answered up to 4;
    # the second takes the rest, the unanswered ones resent.
    first, second = found["stream"]["streams"]
    assert first == 6 and 36 <= second <= 40, found["stream"]
