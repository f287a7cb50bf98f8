"""TLS on the gateway's public port: a client that trusts the CA is
answered, a plaintext one is not; with --tls-client-ca only clients with a
certificate of that CA are; a certificate replaced on disk is served to new
connections without a restart. (No batcher: the CPU fallback answers.)"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.tls import TlsFiles, describe_certificate, tls_flags_problem
from tests.pki import Issued, Pki, issue
from tests.stack import Stack, free_ports, health
from tests.test_gateways import Service

NO_BATCHER = ("--batcher", "127.0.0.1:1", "--startup-wait-s", "0")
EMBED = berth_pb2.EmbedRequest(model="minilm", texts=["over TLS"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca, other_ca = issue("berth test CA"), issue("another CA")
    pki = Pki(
        tmp_path_factory.mktemp("pki"),
        ca,
        issue("berth gateway", ca, server=True),
        issue("good client", ca),
        other_ca,
        issue("stranger", other_ca),
    )
    pki.write("ca.pem", ca.cert_pem)
    pki.write("server.pem", pki.server.cert_pem)
    pki.write("server.key", pki.server.key_pem)
    return pki


def tls_gateway(repository: Path, pki: Pki, *flags: str) -> Service:
    gateway = Service(
        "gateway",
        repository,
        *NO_BATCHER,
        *("--tls-cert", str(pki.folder / "server.pem")),
        *("--tls-key", str(pki.folder / "server.key")),
        *flags,
        port=free_ports(1)[0],
    )
    deadline = time.monotonic() + 120
    while "gateway listening on" not in gateway.logs():
        assert gateway.proc.poll() is None, gateway.logs()
        assert time.monotonic() < deadline, gateway.logs()
        time.sleep(0.05)
    return gateway


@pytest.fixture(scope="module")
def gateway(repository: Path, pki: Pki) -> Iterator[Service]:
    service = tls_gateway(repository, pki)
    try:
        yield service
    finally:
        service.stop()


def embed(address: str, credentials: grpc.ChannelCredentials | None) -> None:
    with (
        grpc.secure_channel(address, credentials)
        if credentials
        else grpc.insecure_channel(address)
    ) as channel:
        reply = berth_pb2_grpc.BerthStub(channel).Embed(EMBED, timeout=60)
        assert len(reply.embeddings[0].values) == 384


def trusting(pki: Pki, client: Issued | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert_pem,
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None,
    )


def test_a_client_that_trusts_the_ca_is_answered(gateway: Service, pki: Pki) -> None:
    embed(gateway.address, trusting(pki))
    logs = gateway.logs()
    assert "TLS on the public port(s), no client certificates asked" in logs
    assert "commonName=berth gateway" in logs and "expires" in logs
    assert "PRIVATE KEY" not in logs


def test_a_plaintext_client_is_refused(gateway: Service) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        embed(gateway.address, None)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_takes_only_certificates_of_the_client_ca(
    repository: Path, pki: Pki
) -> None:
    client_ca = pki.write("client-ca.pem", pki.ca.cert_pem)
    gateway = tls_gateway(repository, pki, "--tls-client-ca", client_ca)
    try:
        for who in (None, pki.other_client):
            with pytest.raises(grpc.RpcError) as caught:
                embed(gateway.address, trusting(pki, who))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        embed(gateway.address, trusting(pki, pki.client))
        assert "mutual TLS (client certificates verified against" in gateway.logs()
    finally:
        gateway.stop()


def served_serial(address: str) -> int:
    """The serial of the certificate a new connection to ``address`` gets."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), 10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_rotated_certificate_is_served_to_new_connections(
    repository: Path, pki: Pki
) -> None:
    gateway = tls_gateway(repository, pki)
    try:
        assert served_serial(gateway.address) == pki.server.cert.serial_number
        # A new CA too: only a client that trusts it can get an answer.
        new_ca = issue("rotated CA")
        new = issue("berth gateway", new_ca, server=True)
        # A half-done rotation (the key of another certificate) is refused
        # and the certificate in use kept.
        pki.write("server.pem", new.cert_pem)
        assert served_serial(gateway.address) == pki.server.cert.serial_number
        assert "still serving the previous certificate" in gateway.logs()
        pki.write("server.key", new.key_pem)
        deadline = time.monotonic() + 10
        while served_serial(gateway.address) != new.cert.serial_number:
            assert time.monotonic() < deadline, gateway.logs()
            time.sleep(0.1)
        embed(gateway.address, grpc.ssl_channel_credentials(new_ca.cert_pem))
        assert "TLS: reloaded the certificate" in gateway.logs()
    finally:
        pki.write("server.pem", pki.server.cert_pem)
        pki.write("server.key", pki.server.key_pem)
        gateway.stop()


def test_tls_flags_go_together(pki: Pki) -> None:
    """A certificate without its key (or the other way round) stops the
    gateway with exit status 2 naming both flags. (In a process of its own:
    the gateway's KServe stubs and tritonclient's, which other tests here
    load, cannot share one.)"""
    cert = str(pki.folder / "server.pem")
    for flags in (["--tls-cert", cert], ["--tls-key", cert]):
        done = subprocess.run(
            [sys.executable, "-m", "gateway", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert "--tls-cert" in done.stderr and "--tls-key" in done.stderr
    both = argparse.Namespace(
        tls_cert=cert, tls_key=str(pki.folder / "server.key"), tls_client_ca=""
    )
    assert tls_flags_problem(both) is None
    assert TlsFiles(cert, cert).paths == (cert, cert)
    assert "commonName=berth gateway" in describe_certificate(cert)


def test_the_client_commands_speak_tls(
    gateway: Service, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    ca = str(pki.folder / "ca.pem")
    address = ("--address", gateway.address)
    assert main(["embed", *address, "--tls-ca", ca, "hello"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["embedding"]) == 384
    main(["health", *address, "--tls-ca", ca, "--timeout", "10"])
    assert capsys.readouterr().out.strip() in ("SERVING", "NOT_SERVING")
    main(["health", *address, "--timeout", "10"])
    assert capsys.readouterr().out.startswith("UNREACHABLE")


def test_serve_wants_both_tls_flags(pki: Pki) -> None:
    from services.cli import main

    assert main(["serve", "--tls-key", str(pki.folder / "server.key")]) == 2


def test_the_ready_file_follows_health(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.server import mark_ready

    ready = tmp_path / "gateway"
    monkeypatch.setenv("BERTH_READY_FILE", str(ready))
    mark_ready(True)
    assert ready.exists()
    mark_ready(False)
    mark_ready(False)
    assert not ready.exists()


def test_berth_serve_with_mutual_tls_serves_a_client_with_its_certificate(
    repository: Path, pki: Pki
) -> None:
    """The whole stack with mutual TLS on its public port: `berth serve`
    sees its gateway ready (it cannot call it in plaintext), a client with
    the CA's certificate is answered by the engines (not the fallback), and a
    plaintext caller is not."""
    stack = Stack(
        repository,
        extra_args=[
            *("--tls-cert", str(pki.folder / "server.pem")),
            *("--tls-key", str(pki.folder / "server.key")),
            *("--tls-client-ca", str(pki.folder / "ca.pem")),
        ],
    )
    try:
        deadline = time.monotonic() + 180
        while "berth is serving on" not in stack.logs():
            assert stack.proc.poll() is None, stack.logs()
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.25)
        with grpc.secure_channel(stack.gateway, trusting(pki, pki.client)) as channel:
            reply = berth_pb2_grpc.BerthStub(channel).Embed(EMBED, timeout=60)
        assert len(reply.embeddings[0].values) == 384 and not reply.degraded
        assert health(stack.gateway) == "UNREACHABLE"  # plaintext
    finally:
        code = stack.stop()
    assert code == 0, stack.logs()
