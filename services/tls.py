"""TLS on the public port: the flags, server credentials whose certificate
is re-read from disk when its files change, and a client's credentials.

gRPC calls the certificate fetcher on every handshake; it answers from the
files' modification times, re-reading them only when one changed, so a
rotated certificate is served to new connections without a restart. A
reload that fails (a half-written file, a key that does not match) keeps
the certificate in use and logs why, once per change of the files.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

import grpc

from services.config import add_flag

log = logging.getLogger("berth.tls")


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-cert, --tls-key and --tls-client-ca: TLS on the public port."""
    add_flag(
        parser,
        "tls-cert",
        "",
        "PEM certificate chain of the public port(s) (with --tls-key: TLS on; "
        "re-read when the file changes)",
    )
    add_flag(parser, "tls-key", "", "PEM private key of --tls-cert")
    add_flag(
        parser,
        "tls-client-ca",
        "",
        "PEM CA certificate(s): with --tls-cert, mutual TLS, every client "
        "must present a certificate signed by one of them",
    )


def tls_flags_problem(args: argparse.Namespace) -> str | None:
    """Why --tls-cert/--tls-key/--tls-client-ca cannot be used together as
    given, or None."""
    if bool(args.tls_cert) != bool(args.tls_key):
        return (
            "--tls-cert and --tls-key go together: give both (TLS on the public "
            "port) or neither"
        )
    if args.tls_client_ca and not args.tls_cert:
        return "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too"
    for flag, path in (
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--tls-client-ca", args.tls_client_ca),
    ):
        if path and not os.access(path, os.R_OK):
            return f"{flag} {path}: no such file, or it cannot be read"
    return None


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    client_ca: str = ""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsFiles | None:
        if not args.tls_cert:
            return None
        return cls(args.tls_cert, args.tls_key, args.tls_client_ca)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert, self.key, self.client_ca) if p)


def describe_certificate(path: str) -> str:
    """'subject ..., serial ..., expires ...' of the first certificate in
    ``path`` (never anything of the key)."""
    # The ssl module's decoder: the standard library has no public one.
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    try:
        info: dict[str, Any] = decode(path) if decode else {}
    except (OSError, ssl.SSLError) as exc:
        return f"(unreadable: {exc})"
    subject = ", ".join(
        f"{key}={value}" for rdn in info.get("subject", ()) for key, value in rdn
    )
    return (
        f"subject {subject or '?'}, serial {info.get('serialNumber', '?')}, "
        f"expires {info.get('notAfter', '?')}"
    )


class CertificateFetcher:
    """gRPC's certificate-configuration fetcher over ``files``: a new
    configuration when the files changed and load, else None (keep the one
    in use)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = self._stamps()
        self.initial = self._load()  # raises: a bad start is fatal

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        return tuple(
            (os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in self.files.paths
        )

    def _load(self) -> grpc.ServerCertificateConfiguration:
        """The files' configuration, checked as a TLS server would load them
        (the key matches the certificate, the CA file parses)."""
        files = self.files
        check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        check.load_cert_chain(files.cert, files.key)
        if files.client_ca:
            check.load_verify_locations(files.client_ca)

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_server_certificate_configuration(
            [(read(files.key), read(files.cert))],
            root_certificates=read(files.client_ca) if files.client_ca else None,
        )

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            config = self._load()
            if self._stamps() != stamp:
                return None  # still being written: the next handshake retries
        except (OSError, ssl.SSLError, ValueError) as exc:
            try:
                self._stamp = self._stamps()  # say it once per change
            except OSError:
                self._stamp = ()
            log.warning(
                "TLS: could not reload %s, still serving the previous certificate: %s",
                " / ".join(self.files.paths),
                exc,
            )
            return None
        self._stamp = stamp
        log.info(
            "TLS: reloaded the certificate: %s", describe_certificate(self.files.cert)
        )
        return config


def server_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """The public port's credentials from --tls-* (None: plaintext), and a
    log line that says which."""
    files = TlsFiles.from_args(args)
    if files is None:
        log.info("TLS off: the public port(s) take plaintext")
        return None
    try:
        fetcher = CertificateFetcher(files)
    except (OSError, ssl.SSLError, ValueError) as exc:
        log.error(
            "TLS: cannot load --tls-cert %s / --tls-key %s%s: %s",
            files.cert,
            files.key,
            f" / --tls-client-ca {files.client_ca}" if files.client_ca else "",
            exc,
        )
        raise SystemExit(1) from None
    mutual = (
        f"mutual TLS (client certificates verified against {files.client_ca})"
        if files.client_ca
        else "no client certificates asked"
    )
    log.info(
        "TLS on the public port(s), %s; certificate %s: %s",
        mutual,
        files.cert,
        describe_certificate(files.cert),
    )
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial,
        fetcher,
        require_client_authentication=bool(files.client_ca),
    )


def add_client_tls_flags(parser: argparse.ArgumentParser) -> None:
    """A client command's --tls-ca, --tls-cert and --tls-key."""
    parser.add_argument(
        "--tls-ca",
        default="",
        help="connect with TLS, trusting this PEM CA certificate (TLS with the "
        "system's roots when only --tls-cert is given)",
    )
    parser.add_argument(
        "--tls-cert",
        default="",
        help="PEM client certificate, for a gateway with mutual TLS",
    )
    parser.add_argument("--tls-key", default="", help="PEM key of --tls-cert")


def client_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """A client command's channel credentials (None: plaintext)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("berth: --tls-cert and --tls-key go together")
    if not (args.tls_ca or args.tls_cert):
        return None

    def read(path: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise SystemExit(f"berth: cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca),
        private_key=read(args.tls_key),
        certificate_chain=read(args.tls_cert),
    )
