"""Channel factory: every berth hop dials through here."""

from __future__ import annotations

import grpc

from services import internal_tls
from services.config import (
    DEFAULT_KEEPALIVE_TIME_MS,
    DEFAULT_KEEPALIVE_TIMEOUT_MS,
    ConfigError,
    env,
)

# A server's connection limits (server_options), each from its BERTH_*
# variable. 1024 streams: a gateway's default --max-in-flight. 5 minutes
# idle: a client between bursts keeps its connection, one that left without
# closing it does not keep it forever. 30 minutes of age on the front door:
# long enough that reconnecting costs nothing, short enough that a gateway
# added to the fleet gets its share of long-lived clients within the hour.
DEFAULT_MAX_CONCURRENT_STREAMS = 1024
DEFAULT_MAX_CONNECTION_IDLE_MS = 5 * 60_000
DEFAULT_MAX_CONNECTION_AGE_MS = 30 * 60_000
CONNECTION_AGE_GRACE_MS = 5 * 60_000
SERVER_KEEPALIVE_TIME_MS = 60_000

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


def connection_limits() -> tuple[int, int, int]:
    """(concurrent streams per connection, idle ms, age ms) of a server:
    BERTH_MAX_CONCURRENT_STREAMS, BERTH_MAX_CONNECTION_IDLE_MS and
    BERTH_MAX_CONNECTION_AGE_MS, else the defaults below (age 0: none). Read
    at each server made, so a test can shorten them."""
    values = []
    for name, default in (
        ("max_concurrent_streams", DEFAULT_MAX_CONCURRENT_STREAMS),
        ("max_connection_idle_ms", DEFAULT_MAX_CONNECTION_IDLE_MS),
        ("max_connection_age_ms", DEFAULT_MAX_CONNECTION_AGE_MS),
    ):
        value = env(name, default)
        if value < (0 if name == "max_connection_age_ms" else 1):
            raise ConfigError(f"BERTH_{name.upper()}={value} is out of range")
        values.append(value)
    return values[0], values[1], values[2]


def server_options(
    keepalive: tuple[int, int] | None = None, public: bool = False
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
    that floods it (tests/test_stream_keepalive.py).

    ``public``: the front door (the gateway), whose connections are also
    aged out; an internal hop's streams are meant to live for hours."""
    time_ms, timeout_ms = keepalive or keepalive_ms()
    streams, idle_ms, age_ms = connection_limits()
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # (This is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS.)
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            min(time_ms, DEFAULT_KEEPALIVE_TIME_MS) // 2,
        ),
        # Pings on a connection with no call open are not abuse either.
        ("grpc.keepalive_permit_without_calls", 1),
        # The server pings too: a client that vanished (no FIN, no RST)
        # otherwise holds its streams, and what they hold, until TCP gives
        # up hours later. Once a minute is enough for that; berth's own
        # clients ping more often and find a dead server themselves.
        # ping_timeout_ms is what bounds the wait for the answer (see
        # channel_options).
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Streams one connection may have open at once (gRPC's default: no
        # limit). Past it a client's further calls wait in the client for a
        # stream to end. berth's own hops use a few streams per connection;
        # a gateway admits 1024 requests at a time (--max-in-flight), so one
        # connection can still use all of them, but not hold more.
        ("grpc.max_concurrent_streams", streams),
        # A connection with no call open for this long is closed (GOAWAY; a
        # client reconnects at its next call). Keepalive pings do not count
        # as use. berth's internal connections always hold their stream.
        ("grpc.max_connection_idle_ms", idle_ms),
    ]
    if public and age_ms:
        options += [
            # A client connection lives at most this long (plus up to 10 %
            # jitter gRPC adds): new calls then go on a new connection, which
            # spreads clients over gateway replicas that came up since, and
            # bounds how long one connection can hold anything.
            ("grpc.max_connection_age_ms", age_ms),
            # ...and its calls have this long after that to finish before
            # they are cancelled: a unary call takes well under a second; a
            # Stream call that outlives it ends UNAVAILABLE and is opened
            # again by its client.
            ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_MS),
        ]
    return options


def aio_channel(target: str) -> grpc.aio.Channel:
    """An asyncio channel to another berth service: mutual TLS with this
    process's internal certificate when it has one (services/internal_tls.py),
    else plaintext."""
    if internal_tls.current() is None:
        return grpc.aio.insecure_channel(target, options=channel_options())
    credentials, options = internal_tls.channel_credentials()
    return grpc.aio.secure_channel(
        target, credentials, options=[*channel_options(), *options]
    )


def sync_channel(
    target: str, credentials: grpc.ChannelCredentials | None = None
) -> grpc.Channel:
    """A blocking channel, for the CLI and tests (TLS with ``credentials``)."""
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=channel_options())
    return grpc.insecure_channel(target, options=channel_options())
