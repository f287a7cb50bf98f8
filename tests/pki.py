"""Certificates made in the tests: a CA, servers and clients it signs, and
another CA whose certificates berth must refuse (cryptography, ECDSA P-256,
valid for a day)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def issue(
    name: str, ca: Issued | None = None, *, server: bool = False, client: bool = False
) -> Issued:
    """A certificate for ``name``: a CA's own (``ca`` None), else signed by
    ``ca``: a server's for 127.0.0.1, localhost and ``name`` when ``server``,
    a client's when ``client`` or not ``server``, or both (berth's internal
    hops)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), True)
    )
    usages = []
    if server:
        names: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        if " " not in name:
            names.append(x509.DNSName(name))
        builder = builder.add_extension(
            x509.SubjectAlternativeName(names), critical=False
        )
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if ca is not None and (client or not server):
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return Issued(builder.sign(ca.key if ca else key, hashes.SHA256()), key)


@dataclass
class Pki:
    folder: Path
    ca: Issued
    server: Issued
    client: Issued
    other_ca: Issued
    other_client: Issued

    def write(self, name: str, data: bytes) -> str:
        path = self.folder / name
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # as a rotation tool replaces a file
        return str(path)
