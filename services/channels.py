"""Channel factory: every berth hop dials through here."""

from __future__ import annotations

import grpc

# Embedding batches are large: 256 rows x 1024 dims x 4 bytes is 1 MiB, and a
# batch of 1024-token rows is as big again. 64 MiB leaves ample room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Internal streams live for hours: ping every 20 s so a dead peer (killed
    # process, cut network) is noticed within ~30 s even when idle.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly after a restart of the peer (default backoff is 1 s
    # growing to 120 s; a restarted engine should be picked up in ~1 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Loopback and cluster-internal traffic only; no proxy.
    ("grpc.enable_http_proxy", 0),
]

SERVER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Accept the clients' 20 s keepalive pings without calling them abusive.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def aio_channel(target: str) -> grpc.aio.Channel:
    """An insecure asyncio channel to another berth service."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def sync_channel(target: str) -> grpc.Channel:
    """A blocking channel, for the CLI and tests."""
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
