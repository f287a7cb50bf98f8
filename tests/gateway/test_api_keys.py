"""API keys (--api-keys-file): a gateway serves berth.v1 and KServe only to
callers with a key, a restricted key only for its models; health stays open;
the file reloads on SIGHUP and when it changes; callers never share response
cache entries.

The gateways here have no batcher, so the CPU fallback answers (enough to
test who is let in); the cache test runs `berth serve`, whose engines
answer (a fallback's answer is never cached).

KServe messages are built with tritonclient's stubs: a test process holds
only one set of the `inference` protobuf names (see test_kserve.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as kserve_pb2
from tritonclient.grpc import service_pb2_grpc as kserve_grpc

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.stack import Stack, free_ports
from tests.test_gateways import Service, service

FULL = "full-access-key-0123456789"
MINILM_ONLY = "minilm-only-key-0123456789"
NEW = "the-new-key-after-reload-42"
KEYS = f"# test keys\n\n{FULL}\n{MINILM_ONLY} minilm  # embeddings only\n"
EMBED = berth_pb2.EmbedRequest(model="minilm", texts=["who may call me?"])
CLASSIFY = berth_pb2.ClassifyRequest(model="intent", texts=["book a flight"])
DENIED = "missing or invalid API key"


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


@contextlib.contextmanager
def start(repository: Path, keys: Path) -> Iterator[Service]:
    (nowhere,) = free_ports(1)
    flags = ("--batcher", f"127.0.0.1:{nowhere}", "--startup-wait-s", "0")
    with service("gateway", repository, *flags, "--api-keys-file", str(keys)) as g:
        g.wait_for("NOT_SERVING")
        yield g


@pytest.fixture(scope="module")
def gateway(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(KEYS)
    with start(repository, keys) as started:
        yield started


@pytest.fixture(scope="module")
def channel(gateway: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.address) as opened:
        yield opened


def code_of(call: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30, **kwargs)  # type: ignore[operator]
    return info.value


def test_a_call_without_a_valid_key_is_unauthenticated(channel: grpc.Channel) -> None:
    stub = berth_pb2_grpc.BerthStub(channel)
    for metadata in (
        (),
        bearer("not-a-key-of-the-file-xx"),
        (("authorization", FULL),),
    ):
        for call, request in (
            (stub.Embed, EMBED),
            (stub.ModelInfo, berth_pb2.ModelInfoRequest()),
            (stub.Tokenize, berth_pb2.TokenizeRequest(model="minilm", texts=["a"])),
        ):
            error = code_of(call, request, metadata=metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert error.details() == DENIED
    # A stream is refused as it starts.
    stream = stub.Stream(iter([berth_pb2.StreamRequest(embed=EMBED)]), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_key_is_served(channel: grpc.Channel) -> None:
    stub = berth_pb2_grpc.BerthStub(channel)
    reply = stub.Embed(EMBED, timeout=30, metadata=bearer(FULL))
    assert len(reply.embeddings[0].values) == 384
    classified = stub.Classify(CLASSIFY, timeout=30, metadata=bearer(FULL))
    assert classified.results[0].labels
    info = stub.ModelInfo(berth_pb2.ModelInfoRequest(), metadata=bearer(FULL))
    assert {m.name for m in info.models} == {"minilm", "intent"}


def test_a_restricted_key_only_for_its_models(channel: grpc.Channel) -> None:
    stub = berth_pb2_grpc.BerthStub(channel)
    key = bearer(MINILM_ONLY)
    assert stub.Embed(EMBED, timeout=30, metadata=key).embeddings
    error = code_of(stub.Classify, CLASSIFY, metadata=key)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'intent'" in error.details()
    long_name = berth_pb2.EmbedRequest(model="m" * 5000, texts=["a"])
    error = code_of(stub.Embed, long_name, metadata=key)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "(5000 characters)" in error.details()
    info = stub.ModelInfo(berth_pb2.ModelInfoRequest(), metadata=key)
    assert [m.name for m in info.models] == ["minilm"]
    # In a stream, each request is checked: the other model's is refused
    # in the stream, which stays open.
    requests = [
        berth_pb2.StreamRequest(
            embed=berth_pb2.EmbedRequest(model="minilm", texts=["a"], request_id=1)
        ),
        berth_pb2.StreamRequest(
            classify=berth_pb2.ClassifyRequest(
                model="intent", texts=["a"], request_id=2
            )
        ),
    ]
    answers = list(stub.Stream(iter(requests), timeout=30, metadata=key))
    errors = {a.error.request_id: a.error.code for a in answers if a.HasField("error")}
    assert errors == {2: "PERMISSION_DENIED"}
    assert len(answers) == 2


def test_kserve_needs_a_key(channel: grpc.Channel) -> None:
    stub = kserve_grpc.GRPCInferenceServiceStub(channel)
    for call, request in (
        (stub.ServerMetadata, kserve_pb2.ServerMetadataRequest()),
        (stub.ServerLive, kserve_pb2.ServerLiveRequest()),
        (stub.ModelMetadata, kserve_pb2.ModelMetadataRequest(name="minilm")),
    ):
        error = code_of(call, request)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.details() == DENIED
    assert (
        stub.ServerMetadata(
            kserve_pb2.ServerMetadataRequest(), timeout=30, metadata=bearer(FULL)
        ).name
        == "berth"
    )
    key = bearer(MINILM_ONLY)
    meta = stub.ModelMetadata(
        kserve_pb2.ModelMetadataRequest(name="minilm"), timeout=30, metadata=key
    )
    assert meta.name == "minilm"
    error = code_of(
        stub.ModelConfig, kserve_pb2.ModelConfigRequest(name="intent"), metadata=key
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    stats = stub.ModelStatistics(
        kserve_pb2.ModelStatisticsRequest(), timeout=30, metadata=key
    )
    assert [s.name for s in stats.model_stats] == ["minilm"]


def test_health_and_reflection_stay_open(channel: grpc.Channel) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=30
    )
    assert reply.status in (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "berth.v1.Berth" in names


def test_the_keys_reload(repository: Path, tmp_path: Path) -> None:
    """SIGHUP reads the file again; so does a change noticed on a call; a
    file that is not valid keeps the old keys."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    with start(repository, keys) as gateway:
        with grpc.insecure_channel(gateway.address) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)

            def works(key: str) -> bool:
                try:
                    stub.ModelInfo(
                        berth_pb2.ModelInfoRequest(), timeout=30, metadata=bearer(key)
                    )
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    return False
                return True

            assert works(FULL) and not works(NEW)
            keys.write_text(f"{NEW}\n")
            os.kill(gateway.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 10
            while not works(NEW):
                assert time.monotonic() < deadline, gateway.logs()
                time.sleep(0.1)
            assert not works(FULL)
            # A short key: refused, the old keys stay.
            keys.write_text("short\n")
            os.kill(gateway.proc.pid, signal.SIGHUP)
            time.sleep(1.5)
            assert works(NEW)
            assert "line 1: the key has 5 characters" in gateway.logs()
            # Changed without a signal: noticed within a second.
            keys.write_text(f"{FULL}\n")
            deadline = time.monotonic() + 10
            while not works(FULL):
                assert time.monotonic() < deadline, gateway.logs()
                time.sleep(0.2)
            assert not works(NEW)
        logs = gateway.logs()
        assert "API keys on: 2 keys" in logs
        assert FULL not in logs and NEW not in logs


def test_a_short_key_is_refused_at_start(repository: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{FULL}\n# fine so far\nshort-key model\n")
    process = Service("gateway", repository, "--api-keys-file", str(keys))
    assert process.proc.wait(60) == 2
    assert "line 3: the key has 9 characters" in process.logs()


def test_callers_do_not_share_cache_entries(repository: Path, tmp_path: Path) -> None:
    """`berth serve --api-keys-file`: the same text from a second key is a
    cache miss, from the first key again a hit."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    stack = Stack(repository, extra_args=["--api-keys-file", str(keys)])
    try:
        stack.wait_serving()
        with grpc.insecure_channel(stack.gateway) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)
            kserve = kserve_grpc.GRPCInferenceServiceStub(channel)

            def hits_and_misses() -> tuple[int, int]:
                stats = (
                    kserve.ModelStatistics(
                        kserve_pb2.ModelStatisticsRequest(name="minilm"),
                        timeout=30,
                        metadata=bearer(FULL),
                    )
                    .model_stats[0]
                    .inference_stats
                )
                return stats.cache_hit.count, stats.cache_miss.count

            request = berth_pb2.EmbedRequest(model="minilm", texts=["mine alone"])
            start_hits, start_misses = hits_and_misses()
            for key in (FULL, MINILM_ONLY, FULL, MINILM_ONLY):
                assert not stub.Embed(
                    request, timeout=60, metadata=bearer(key)
                ).degraded
            hits, misses = hits_and_misses()
            assert (hits - start_hits, misses - start_misses) == (2, 2)
            error = code_of(stub.Embed, request)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stack.stop()
