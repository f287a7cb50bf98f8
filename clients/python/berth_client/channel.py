"""What both clients dial with: the target, TLS, the API key's metadata,
keepalive, and the service config (load balancing and retries).

Retries are gRPC's own (gRFC A6), set in the channel's service config: a
call that ends UNAVAILABLE (no gateway reachable, a gateway draining) is
tried again with exponential backoff, up to ``Retry.max_attempts`` attempts
in all and within the call's deadline; gRPC waits instead the time a
server's ``grpc-retry-pushback-ms`` trailer asks for, when one is sent, and
does not retry when that trailer is negative. Retry throttling stops retries
on a channel while most of its calls fail (so that a fleet of clients does
not multiply the load on a struggling gateway).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
SERVICE = "berth.v1.Berth"
# The gateway's own limit (services/channels.py MAX_MESSAGE_BYTES); gRPC's
# default receive limit, 4 MiB, is smaller than a large embedding answer.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The gateway takes a ping every 5 s at most from a connection it has sent
# nothing on, and answers pings more often with GOAWAY ("too_many_pings"):
# 10 s leaves room for timers that are not exact.
KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
MIN_KEEPALIVE_S = 10.0
# A gateway back after a restart is dialled again within about this long
# (gRPC's default backoff grows to 120 s).
RECONNECT_BACKOFF_MS = (200, 2_000)
STATUS_NAMES = frozenset(grpc.StatusCode.__members__)

PathOrPem = str | os.PathLike[str] | bytes


@dataclass(frozen=True)
class Retry:
    """gRPC's retry policy for every berth.v1 method. ``max_attempts``
    counts the first (2 to 5: gRPC caps it at 5); the n-th retry waits a
    random time up to min(initial_backoff_s * backoff_multiplier**(n-1),
    max_backoff_s). ``codes``: the status codes retried; RESOURCE_EXHAUSTED
    is not among them by default (see docs/clients.md). ``throttle``: gRPC's
    retry throttling (10 tokens, 0.1 regained per success)."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0
    codes: tuple[str, ...] = ("UNAVAILABLE",)
    throttle: bool = True

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts={self.max_attempts}: from 2 to 5")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        if self.backoff_multiplier < 1:
            raise ValueError("backoff_multiplier must be at least 1")
        unknown = set(self.codes) - STATUS_NAMES
        if not self.codes or unknown:
            raise ValueError(f"codes: grpc.StatusCode names, got {self.codes!r}")

    def policy(self) -> dict[str, Any]:
        return {
            "maxAttempts": self.max_attempts,
            "initialBackoff": _duration(self.initial_backoff_s),
            "maxBackoff": _duration(self.max_backoff_s),
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(self.codes),
        }


def _duration(seconds: float) -> str:
    """A protobuf JSON Duration: '0.1s'."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


@dataclass(frozen=True)
class Tls:
    """TLS to the gateway. ``ca``: the CA certificates to trust (None: the
    system's); ``cert`` and ``key``: this client's certificate chain and key,
    for a gateway that requires them (--tls-client-ca); ``server_name``: the
    name to verify the gateway's certificate against, when not the host
    dialled. Each is a file's path (str or Path) or the PEM itself (bytes)."""

    ca: PathOrPem | None = None
    cert: PathOrPem | None = None
    key: PathOrPem | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("Tls: give both cert and key, or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca),
            private_key=_pem(self.key),
            certificate_chain=_pem(self.cert),
        )


def _pem(value: PathOrPem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def target(address: str | Sequence[str]) -> str:
    """The gRPC target of one address or several. One: as given ('host:port',
    or any gRPC target such as 'dns:///name:port'). Several: IP addresses
    with ports, all IPv4 or all IPv6, as one static 'ipv4:'/'ipv6:' target
    (for host names, give one 'dns:///name:port' target instead: each of the
    name's addresses is then a backend)."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses or not all(addresses):
        raise ValueError("no address")
    if len(addresses) == 1:
        return addresses[0]
    families = set()
    for each in addresses:
        host, _, port = each.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        except ValueError:
            raise ValueError(
                f"{each!r}: several addresses must be IP:port; for a host name "
                "give one target, e.g. 'dns:///berth.example:50051'"
            ) from None
        if not port.isdigit():
            raise ValueError(f"{each!r} has no port")
        families.add(ip.version)
    if len(families) > 1:
        raise ValueError("several addresses: all IPv4 or all IPv6, not both")
    return f"ipv{families.pop()}:" + ",".join(addresses)


def service_config(load_balancing: str, retry: Retry | None) -> str:
    config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
    if retry is not None:
        config["methodConfig"] = [
            {"name": [{"service": SERVICE}], "retryPolicy": retry.policy()}
        ]
        if retry.throttle:
            config["retryThrottling"] = {"maxTokens": 10, "tokenRatio": 0.1}
    return json.dumps(config)


class Settings:
    """The channel and call settings of a client (the arguments of
    :class:`berth_client.Client`, which documents them)."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        timeout: float | None = 30.0,
        api_key: str | None = None,
        tls: Tls | bool = False,
        retry: Retry | None = Retry(),  # noqa: B008 (frozen: shared safely)
        load_balancing: str = "round_robin",
        keepalive_s: float | None = KEEPALIVE_S,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
        wait_for_ready: bool = False,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if keepalive_s is not None and keepalive_s < MIN_KEEPALIVE_S:
            raise ValueError(
                f"keepalive_s={keepalive_s}: at least {MIN_KEEPALIVE_S} (the "
                "gateway closes connections that ping more often)"
            )
        if load_balancing not in ("round_robin", "pick_first"):
            raise ValueError(
                f"load_balancing={load_balancing!r}: round_robin or pick_first"
            )
        if api_key is not None and (not api_key or not api_key.isprintable()):
            raise ValueError("api_key: printable characters")
        self.target = target(address)
        self.timeout = timeout
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )
        tls_settings = Tls() if tls is True else tls or None
        self.credentials = tls_settings.credentials() if tls_settings else None
        self.wait_for_ready = wait_for_ready
        self.options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", service_config(load_balancing, retry)),
            # This client's config, not one a DNS TXT record may carry.
            ("grpc.service_config_disable_resolution", 1),
            *_keepalive(keepalive_s, keepalive_timeout_s),
        ]
        if tls_settings and tls_settings.server_name:
            name = tls_settings.server_name
            self.options.append(("grpc.ssl_target_name_override", name))
        self.options += list(options)

    def call_metadata(
        self, metadata: Sequence[tuple[str, str | bytes]]
    ) -> tuple[tuple[str, str | bytes], ...]:
        return (*self.metadata, *metadata)

    def call_timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def call_ready(self, wait_for_ready: bool | None) -> bool:
        return self.wait_for_ready if wait_for_ready is None else wait_for_ready


def _keepalive(time_s: float | None, timeout_s: float) -> list[tuple[str, int]]:
    """Ping after ``time_s`` without a word from the gateway, and give the
    connection up when a ping is not answered within ``timeout_s``; idle
    connections too, so that the next call does not go onto a dead one."""
    if time_s is None:
        return []
    timeout_ms = round(timeout_s * 1000)
    return [
        ("grpc.keepalive_time_ms", round(time_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # What bounds the wait for the ping's answer in grpcio 1.85 (berth's
        # services/channels.py measured it).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
