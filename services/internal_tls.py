"""Mutual TLS between berth's own processes: gateway -> batcher -> engines.

Each process is given one certificate with its key (--internal-tls-cert,
--internal-tls-key) and the CA that signed its peers' (--internal-tls-ca).
The certificate is the server certificate of its listener (batcher, engine)
and the client certificate of every channel it opens to another berth
process. With the three flags set, a batcher or engine completes a handshake
only with a client presenting a certificate of that CA, and each process
verifies the server it dials against the CA: plaintext, no certificate, or a
certificate of another CA fails the handshake. --internal-tls-server-name is
the name the servers' certificates are checked against when it is not the
host dialled (one certificate for every process, issued for, say,
"berth-internal", while the processes dial each other by IP).

The files are re-read when they change: a listener's at its next handshake
(services/tls.py, CertificateFetcher), a client's when a stream to a peer
next (re)connects (services/streams.py asks :func:`stamp`).

One configuration per process (:func:`configure`, from
services/process.py's start_service), read by every channel it makes
(services/channels.py aio_channel) and by its listener.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from dataclasses import dataclass

import grpc

from services.config import add_flag
from services.tls import CertificateFetcher, TlsFiles, describe_certificate

log = logging.getLogger("berth.tls")

FLAGS = ("--internal-tls-cert", "--internal-tls-key", "--internal-tls-ca")


def add_internal_tls_flags(parser: argparse.ArgumentParser) -> None:
    """--internal-tls-cert, --internal-tls-key, --internal-tls-ca and
    --internal-tls-server-name."""
    add_flag(
        parser,
        "internal-tls-cert",
        "",
        "PEM certificate chain for berth's internal hops: this process's server "
        "certificate and its client certificate to its peers (with "
        "--internal-tls-key and --internal-tls-ca: mutual TLS on every hop)",
    )
    add_flag(parser, "internal-tls-key", "", "PEM private key of --internal-tls-cert")
    add_flag(
        parser,
        "internal-tls-ca",
        "",
        "PEM CA certificate(s) that signed the other berth processes' "
        "certificates; peers are verified against it, both ways",
    )
    add_flag(
        parser,
        "internal-tls-server-name",
        "",
        "name the peers' server certificates are checked against ('': the "
        "host of the address dialled)",
    )


def internal_tls_problem(args: argparse.Namespace) -> str | None:
    """Why the --internal-tls-* flags cannot be used as given, or None."""
    given = [args.internal_tls_cert, args.internal_tls_key, args.internal_tls_ca]
    if any(given) and not all(given):
        missing = [flag for flag, path in zip(FLAGS, given, strict=True) if not path]
        return (
            f"{', '.join(FLAGS)} go together (mutual TLS on the internal hops): "
            f"{', '.join(missing)} missing"
        )
    if args.internal_tls_server_name and not all(given):
        return f"--internal-tls-server-name needs {', '.join(FLAGS)}"
    for flag, path in zip(FLAGS, given, strict=True):
        if path and not os.access(path, os.R_OK):
            return f"{flag} {path}: no such file, or it cannot be read"
    return None


@dataclass(frozen=True)
class InternalTls:
    files: TlsFiles  # cert, key, and the CA as the client CA
    server_name: str = ""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InternalTls | None:
        if not args.internal_tls_cert:
            return None
        return cls(
            TlsFiles(
                args.internal_tls_cert, args.internal_tls_key, args.internal_tls_ca
            ),
            args.internal_tls_server_name,
        )


_config: InternalTls | None = None


def configure(args: argparse.Namespace) -> InternalTls | None:
    """This process's internal TLS from its flags (None: plaintext hops),
    checked as a TLS endpoint would load it; exits naming the flag and the
    reason when the flags or the files are wrong."""
    global _config
    if problem := internal_tls_problem(args):
        log.error("%s", problem)
        raise SystemExit(2)
    _config = InternalTls.from_args(args)
    if _config is None:
        log.info("internal hops in plaintext (no --internal-tls-*)")
        return None
    files = _config.files
    try:
        check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        check.load_cert_chain(files.cert, files.key)
        check.load_verify_locations(files.client_ca)
    except (OSError, ssl.SSLError, ValueError) as exc:
        log.error(
            "internal TLS: cannot load --internal-tls-cert %s / --internal-tls-key "
            "%s / --internal-tls-ca %s: %s",
            files.cert,
            files.key,
            files.client_ca,
            exc,
        )
        raise SystemExit(1) from None
    log.info(
        "internal hops: mutual TLS, peers verified against %s%s; certificate %s: %s",
        files.client_ca,
        f" as {_config.server_name!r}" if _config.server_name else "",
        files.cert,
        describe_certificate(files.cert),
    )
    return _config


def use(config: InternalTls | None) -> None:
    """Set this process's internal TLS directly (tests, benchmarks)."""
    global _config
    _config = config


def current() -> InternalTls | None:
    return _config


def server_credentials() -> grpc.ServerCredentials | None:
    """A batcher's or engine's listener credentials: mutual TLS, the
    certificate re-read when its files change; None without internal TLS."""
    if _config is None:
        return None
    fetcher = CertificateFetcher(_config.files)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial, fetcher, require_client_authentication=True
    )


def stamp() -> tuple[tuple[int, int], ...]:
    """The internal TLS files' (mtime, size): a channel made under another
    stamp presents an older certificate or trusts an older CA. () without
    internal TLS, or while a file cannot be read."""
    if _config is None:
        return ()
    try:
        return tuple(
            (os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in _config.files.paths
        )
    except OSError:
        return ()


def channel_credentials() -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    """Credentials and options for a channel to another berth process: this
    process's certificate, the peers' CA, the server name to check. Raises
    OSError when a file cannot be read."""
    assert _config is not None
    files = _config.files

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(files.client_ca),
        private_key=read(files.key),
        certificate_chain=read(files.cert),
    )
    options = (
        [("grpc.ssl_target_name_override", _config.server_name)]
        if _config.server_name
        else []
    )
    return credentials, options
