"""Channel factory: every berth hop dials through here."""

from __future__ import annotations

import grpc

from services.config import (
    DEFAULT_KEEPALIVE_TIME_MS,
    DEFAULT_KEEPALIVE_TIMEOUT_MS,
    ConfigError,
    env,
)

# Embedding batches are large: 256 rows x 1024 dims x 4 bytes is 1 MiB, and a
# batch of 1024-token rows is as big again. 64 MiB leaves ample room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def keepalive_ms() -> tuple[int, int]:
    """(ping after this long without a word from the peer, give it up when a
    ping is not answered within this), in ms: BERTH_KEEPALIVE_TIME_MS and
    BERTH_KEEPALIVE_TIMEOUT_MS, else 10 s and 5 s (services/config.py says
    why). Read at each channel and server made, so a test can shorten them."""
    values = []
    for name, default in (
        ("keepalive_time_ms", DEFAULT_KEEPALIVE_TIME_MS),
        ("keepalive_timeout_ms", DEFAULT_KEEPALIVE_TIMEOUT_MS),
    ):
        value = env(name, default)
        if value < 1:
            raise ConfigError(f"BERTH_{name.upper()}={value} is not a positive integer")
        values.append(value)
    return values[0], values[1]


def channel_options(
    keepalive: tuple[int, int] | None = None,
) -> list[tuple[str, int | str]]:
    """The options of every berth channel; ``keepalive`` is
    :func:`keepalive_ms` unless given."""
    time_ms, timeout_ms = keepalive or keepalive_ms()
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Internal streams live for hours, and most of the time a dead peer
        # is noticed by its process's exit (RST) in milliseconds; the pings
        # catch the peer that vanished without one (services/config.py).
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # What actually bounds the wait for a ping's answer: with grpcio 1.85,
        # keepalive_timeout_ms alone left a silent peer's stream up until
        # gRPC's default ping timeout, 60 s past the ping (measured; the
        # silent-peer test in tests/test_stream_keepalive.py fails without
        # this). It bounds the transport's other pings (flow-control probes)
        # too, as it should: a peer that answers none in that time is gone.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Ping an idle connection too (a stream with nothing in flight is
        # still the one the next request goes on), without limit (default:
        # at most 2 pings until data is sent).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after a restart of the peer (default backoff is 1 s
        # growing to 120 s; a restarted engine should be picked up in ~1 s).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # Loopback and cluster-internal traffic only; no proxy.
        ("grpc.enable_http_proxy", 0),
    ]


def server_options(
    keepalive: tuple[int, int] | None = None,
) -> list[tuple[str, int | str]]:
    """The options of every berth server, the public gateway's included.

    gRPC holds a strike against a client each time it pings sooner than the
    server's minimum interval (gRPC's default: 5 min) after its last ping,
    the server having sent it no data since; at the third it sends GOAWAY
    "too_many_pings" and closes the connection, streams and all. berth's
    clients ping a quiet connection every keepalive time, so a server takes
    pings as often as every half keepalive time (timers are not exact), and
    never asks for more than half the default: a peer still on the default
    is welcome at a process given a longer interval. A ping every 5 s is no
    burden for the public door either, and its strikes still stop a client
    that floods it (tests/test_stream_keepalive.py)."""
    time_ms, _ = keepalive or keepalive_ms()
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # (This is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS.)
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            min(time_ms, DEFAULT_KEEPALIVE_TIME_MS) // 2,
        ),
        # Pings on a connection with no call open are not abuse either.
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def aio_channel(target: str) -> grpc.aio.Channel:
    """An insecure asyncio channel to another berth service."""
    return grpc.aio.insecure_channel(target, options=channel_options())


def sync_channel(target: str) -> grpc.Channel:
    """A blocking channel, for the CLI and tests."""
    return grpc.insecure_channel(target, options=channel_options())
