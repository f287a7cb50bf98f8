"""Mutual TLS on berth's internal hops (services/internal_tls.py), and
`berth serve` keeping its batchers and engines on --internal-host.

An engine given --internal-tls-* completes a handshake only with a client
whose certificate the internal CA signed; a stream client that was refused
connects once its certificate files are replaced, without a restart; a
whole stack runs with every hop on mutual TLS, its public port on 0.0.0.0
and its internal ports on loopback only."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from batcher.engines import EngineClient
from services import internal_tls
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from services.tls import TlsFiles
from tests.pki import Issued, issue
from tests.stack import Stack, health
from tests.test_gateways import Service
from tests.waits import until, wait_until

SERVER_NAME = "berth-internal"


@dataclass
class Internal:
    folder: Path
    ca: Issued
    member: Issued  # server and client certificate of the internal CA
    rotated: Issued  # another one of the same CA
    stranger: Issued  # server and client certificate of another CA

    def flags(self, prefix: str = "") -> list[str]:
        """The --internal-tls-* flags, with this set's files."""
        return [
            *("--internal-tls-cert", str(self.folder / f"{prefix}member.pem")),
            *("--internal-tls-key", str(self.folder / f"{prefix}member.key")),
            *("--internal-tls-ca", str(self.folder / "ca.pem")),
        ]

    def credentials(self, client: Issued | None) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.cert_pem,
            private_key=client.key_pem if client else None,
            certificate_chain=client.cert_pem if client else None,
        )

    def install(self, prefix: str, issued: Issued) -> None:
        """``issued`` as the files of ``prefix``, each replaced by a rename."""
        for suffix, data in (("pem", issued.cert_pem), ("key", issued.key_pem)):
            path = self.folder / f"{prefix}member.{suffix}"
            path.with_suffix(".tmp").write_bytes(data)
            path.with_suffix(".tmp").replace(path)


@pytest.fixture(scope="module")
def internal(tmp_path_factory: pytest.TempPathFactory) -> Internal:
    ca, other = issue("berth internal CA"), issue("another CA")
    pki = Internal(
        tmp_path_factory.mktemp("internal-pki"),
        ca,
        issue(SERVER_NAME, ca, server=True, client=True),
        issue(SERVER_NAME, ca, server=True, client=True),
        issue(SERVER_NAME, other, server=True, client=True),
    )
    (pki.folder / "ca.pem").write_bytes(ca.cert_pem)
    pki.install("", pki.member)
    return pki


@pytest.fixture(scope="module")
def engine(repository: Path, internal: Internal) -> Iterator[Service]:
    service = Service("engine", repository, "--models", "minilm", *internal.flags())
    good = internal.credentials(internal.member)

    def serving() -> bool:
        assert service.proc.poll() is None, service.logs()
        return health(service.address, credentials=good) == "SERVING"

    try:
        wait_until(serving, "the engine SERVING over mutual TLS", timeout_s=120)
        yield service
    finally:
        service.stop()


def test_an_engine_takes_only_clients_of_the_internal_ca(
    engine: Service, internal: Internal
) -> None:
    assert health(
        engine.address, credentials=internal.credentials(internal.member)
    ) == ("SERVING")
    assert health(engine.address) == "UNREACHABLE"  # plaintext
    assert health(engine.address, credentials=internal.credentials(None)) == (
        "UNREACHABLE"  # TLS, but no client certificate
    )
    stranger = internal.credentials(internal.stranger)  # another CA's
    assert health(engine.address, credentials=stranger) == "UNREACHABLE"
    logs = engine.logs()
    assert "internal hops: mutual TLS, peers verified against" in logs
    assert f"commonName={SERVER_NAME}" in logs and "PRIVATE KEY" not in logs


def test_a_refused_stream_client_connects_once_its_files_are_replaced(
    engine: Service, internal: Internal
) -> None:
    """A batcher's stream to an engine, its certificate of another CA: the
    engine refuses it. Its files replaced by a certificate of the internal
    CA, its next try connects, in the same process."""
    internal.install("client-", internal.stranger)
    files = TlsFiles(
        str(internal.folder / "client-member.pem"),
        str(internal.folder / "client-member.key"),
        str(internal.folder / "ca.pem"),
    )

    async def run() -> set[str]:
        client = EngineClient(engine.address, lambda: None)
        client.start()
        try:
            await asyncio.sleep(1.5)  # several tries, each refused
            assert not client.connected
            internal.install("client-", internal.rotated)
            await until(lambda: client.connected, "connected after the files changed")
            return client.models
        finally:
            await client.close()

    internal_tls.use(internal_tls.InternalTls(files))
    try:
        assert asyncio.run(run()) == {"minilm"}
    finally:
        internal_tls.use(None)


def test_internal_tls_flags_go_together(internal: Internal) -> None:
    from services.cli import main

    cert, key, _ = (internal.flags()[i] for i in (1, 3, 5))
    assert main(["serve", "--internal-tls-cert", cert, "--internal-tls-key", key]) == 2
    assert main(["serve", "--internal-tls-server-name", SERVER_NAME]) == 2


def listening(port: int) -> set[str]:
    """The local addresses a socket listens on at ``port`` (/proc/net), an
    IPv4-mapped IPv6 address as its IPv4 address."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(socket.inet_ntop(family, words))
            mapped = getattr(ip, "ipv4_mapped", None)  # gRPC's [::ffff:a.b.c.d]
            found.add(str(mapped or ip))
    return found


def test_a_stack_on_every_interface_keeps_its_hops_on_loopback_under_mutual_tls(
    repository: Path, internal: Internal
) -> None:
    """`berth serve --host 0.0.0.0` with --internal-tls-*: the public port
    listens on every interface, the batcher and engine on 127.0.0.1 only;
    every hop is mutual TLS (the engines answer, nothing degraded) and the
    internal ports refuse plaintext."""
    stack = Stack(
        repository,
        extra_args=[
            *("--host", "0.0.0.0"),
            *internal.flags(),
            *("--internal-tls-server-name", SERVER_NAME),
        ],
    )
    good = internal.credentials(internal.member)
    try:
        stack.wait_serving()
        with grpc.insecure_channel(stack.gateway) as channel:
            reply = berth_pb2_grpc.BerthStub(channel).Embed(
                berth_pb2.EmbedRequest(model="minilm", texts=["hops over mTLS"]),
                timeout=60,
            )
        assert len(reply.embeddings[0].values) == 384 and not reply.degraded
        port = int(stack.gateway.rsplit(":", 1)[1])
        assert listening(port) & {"0.0.0.0", "::"}, listening(port)
        for address in (stack.batcher, *stack.engines):
            internal_port = int(address.rsplit(":", 1)[1])
            assert listening(internal_port) == {"127.0.0.1"}, address
            assert health(address) == "UNREACHABLE"  # plaintext
            # The gateway's answer shows a way to the engines, not that each
            # internal service has turned SERVING yet: a bounded wait.
            wait_until(
                lambda: health(address, credentials=good) == "SERVING",  # noqa: B023
                f"{address} SERVING over mutual TLS",
                60,
            )
    finally:
        code = stack.stop()
    assert code == 0, stack.logs()
