"""Certificates for benchmarks/tls.py, made in the run: a CA, the gateway's
certificate (for 127.0.0.1 and localhost) and a client's, all signed by the
CA with SHA-256, keys ECDSA P-256 or RSA 2048, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving.load import ClientTls

KEYS = {"ecdsa": "ECDSA P-256", "rsa": "RSA 2048"}
MODES = {
    "plaintext": "no TLS",
    "tls": "TLS, server certificate only (--tls-cert, --tls-key)",
    "mtls": "mutual TLS, client certificates verified (--tls-client-ca too)",
}


def _key(kind: str) -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    if kind == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return ec.generate_private_key(ec.SECP256R1())


def _issue(
    name: str, kind: str, ca: tuple[Any, Any] | None, usage: str | None
) -> tuple[Any, Any]:
    """(certificate, key) for ``name``: a CA's own when ``ca`` is None, else
    signed by ``ca`` (certificate, key) for ``usage`` "server" or "client"."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _key(kind)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca[0].subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), True)
    )
    if usage == "server":
        names = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        builder = builder.add_extension(
            x509.SubjectAlternativeName(names), critical=False
        )
    if usage:
        oid = {
            "server": ExtendedKeyUsageOID.SERVER_AUTH,
            "client": ExtendedKeyUsageOID.CLIENT_AUTH,
        }[usage]
        builder = builder.add_extension(x509.ExtendedKeyUsage([oid]), critical=False)
    return builder.sign(ca[1] if ca else key, hashes.SHA256()), key


def _pem(cert: Any, key: Any) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM), key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass
class Pki:
    """The run's certificate files, and what each mode serves and dials
    with."""

    folder: Path
    kind: str  # a key of KEYS

    @property
    def about(self) -> str:
        return (
            f"{KEYS[self.kind]} keys, SHA-256 signatures, one CA; made in the run "
            f"in {self.folder}"
        )

    def serve_args(self, mode: str) -> list[str]:
        """`berth serve` flags of ``mode`` (a key of MODES)."""
        if mode == "plaintext":
            return []
        flags = {"--tls-cert": "server.pem", "--tls-key": "server.key"}
        if mode == "mtls":
            flags["--tls-client-ca"] = "ca.pem"
        return [x for flag, f in flags.items() for x in (flag, str(self.folder / f))]

    def client(self, mode: str) -> ClientTls | None:
        """What a client dials a stack of ``mode`` with (None: plaintext)."""
        if mode == "plaintext":
            return None
        root = (self.folder / "ca.pem").read_bytes()
        if mode == "tls":
            return ClientTls(root)
        return ClientTls(
            root,
            (self.folder / "client.pem").read_bytes(),
            (self.folder / "client.key").read_bytes(),
        )


def make_pki(folder: Path, kind: str) -> Pki:
    """A CA, a server and a client certificate with ``kind`` keys, written
    into ``folder`` (ca.pem, server.pem/.key, client.pem/.key)."""
    ca = _issue("berth benchmark CA", kind, None, None)
    server = _issue("berth gateway", kind, ca, "server")
    client = _issue("berth benchmark client", kind, ca, "client")
    (folder / "ca.pem").write_bytes(_pem(*ca)[0])
    for name, (cert, key) in (("server", server), ("client", client)):
        cert_pem, key_pem = _pem(cert, key)
        (folder / f"{name}.pem").write_bytes(cert_pem)
        (folder / f"{name}.key").write_bytes(key_pem)
        (folder / f"{name}.key").chmod(0o600)
    return Pki(folder, kind)
