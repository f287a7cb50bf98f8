"""How the internal streams find out that their peer is gone, and how they
come back (services/channels.py, services/streams.py StreamClient).

Real gRPC servers and clients on loopback, with the keepalive shortened
through BERTH_KEEPALIVE_TIME_MS / BERTH_KEEPALIVE_TIMEOUT_MS:

- a peer that goes silent without closing anything (a powered-off host, a
  network partition: no FIN, no RST) fails the stream and what is in flight
  on it with UNAVAILABLE within about the keepalive time and timeout
  (before: 20 s of keepalive time, then 60 s more, gRPC's default ping
  timeout, which with grpcio 1.85 is what bounds an unanswered keepalive
  ping whatever grpc.keepalive_timeout_ms says; requests waited that long
  or until their deadlines);
- a berth server takes pings at the configured rate without calling them
  abuse (GOAWAY "too_many_pings" would end the stream of an idle client),
  yet still stops a client that floods it with pings;
- reconnecting backs off: 0.05 s doubling to 2 s, spread at random, and
  starting afresh after a stream that stayed up (a fixed 0.2 s tried a peer
  that refuses five times a second forever), and says so once, not at each
  try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
import pytest

from gateway.batcher_client import BatcherClient
from services import streams
from services.channels import channel_options, keepalive_ms, server_options
from services.config import ConfigError
from services.errors import Unavailable
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from services.server import ServiceServer
from services.streams import StreamClient, reconnect_delay

BATCHER = internal_pb2.DESCRIPTOR.services_by_name["Batcher"].full_name


def fast_keepalive(
    monkeypatch: pytest.MonkeyPatch, time_ms: int = 300, timeout_ms: int = 300
) -> None:
    monkeypatch.setenv("BERTH_KEEPALIVE_TIME_MS", str(time_ms))
    monkeypatch.setenv("BERTH_KEEPALIVE_TIMEOUT_MS", str(timeout_ms))


class Batcher(internal_pb2_grpc.BatcherServicer):
    """A batcher that takes every sequence and answers none; a stream ends
    after ``hold_s`` (None: never)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.hold_s: float | None = None

    async def Models(
        self, request: internal_pb2.BatcherModelsRequest, context: Any
    ) -> internal_pb2.BatcherModels:
        return internal_pb2.BatcherModels(
            models=[internal_pb2.BatcherModel(name="m", state="closed")]
        )

    async def Submit(
        self, request_iterator: AsyncIterator[internal_pb2.GatewayMessage], context: Any
    ) -> AsyncIterator[internal_pb2.BatcherMessage]:
        async def read() -> None:
            async for message in request_iterator:
                for group in message.sequences:
                    self.received.extend(group.ids)

        reader = asyncio.create_task(read())
        try:
            if self.hold_s is None:
                await asyncio.Event().wait()
            else:
                await asyncio.sleep(self.hold_s)
        finally:
            reader.cancel()
        return
        yield


async def batcher_server(servicer: Batcher) -> ServiceServer:
    """``servicer`` behind berth's own server (its options, as the batcher's)."""
    server = ServiceServer("batcher", "127.0.0.1:0", [BATCHER])
    internal_pb2_grpc.add_BatcherServicer_to_server(servicer, server.server)
    await server.start()
    return server


class Blackhole:
    """A TCP relay on loopback to ``port`` that, once told to go silent,
    passes no more bytes either way and keeps every socket open: to both
    ends the other is still connected (TCP acknowledges what was sent), and
    never answers. Connections made after that are accepted and never
    answered either."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silent = False
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._writers.append(writer)
        if self.silent:
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers.append(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pump = asyncio.create_task(self._pump(source, sink))
            self._pumps.add(pump)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter
    ) -> None:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
        sink.close()  # (an end passed on as it came)

    def go_silent(self) -> None:
        self.silent = True
        for pump in self._pumps:
            pump.cancel()

    async def close(self) -> None:
        self.go_silent()
        for writer in self._writers:
            writer.close()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


def tokens() -> list[np.ndarray]:
    return [np.arange(1, 5, dtype=np.int32)]


def test_a_peer_gone_silent_fails_what_is_in_flight_within_the_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway's stream to a batcher whose host vanished: what it has in
    flight fails UNAVAILABLE within about keepalive time + timeout (here
    0.3 s + 0.3 s, and gRPC pings at most once a second: ~1.3 s), and the
    client reports the batcher lost, instead of both waiting for TCP."""
    fast_keepalive(monkeypatch)

    async def scenario() -> tuple[BaseException | None, float, bool, bool]:
        servicer = Batcher()
        server = await batcher_server(servicer)
        relay = Blackhole(server.port)
        client = BatcherClient(await relay.start())
        client.start()
        try:
            async with asyncio.timeout(10):
                await client.ready.wait()
                call = asyncio.create_task(client.run("m", tokens(), 0))
                while not servicer.received:  # it reached the batcher
                    await asyncio.sleep(0.01)
            relay.go_silent()
            silent_at = time.monotonic()
            error: BaseException | None = None
            try:
                # (gRPC's defaults would wait 20 s of keepalive, 60 s of timeout.)
                await asyncio.wait_for(call, 8)
            except Exception as exc:
                error = exc
            return (
                error,
                time.monotonic() - silent_at,
                client.connected,
                client.ready.is_set(),
            )
        finally:
            await client.close()
            await relay.close()
            await server.server.stop(None)

    error, took, connected, ready = asyncio.run(scenario())
    assert isinstance(error, Unavailable), repr(error)
    assert "UNAVAILABLE" in str(error), str(error)
    assert took < 3.0, f"noticed after {took:.1f} s"
    assert not connected and not ready


# HTTP/2 frames (RFC 9113 §4.1): 24-bit length, type, flags, 31-bit stream id.
SETTINGS, PING, GOAWAY = 0x4, 0x6, 0x7
ACK = 0x1
ENHANCE_YOUR_CALM = 0xB


def frame(kind: int, flags: int = 0, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + bytes(4) + payload
    )


async def ping_server(address: str, gaps_s: Iterable[float]) -> tuple[int, bytes]:
    """Open a bare HTTP/2 connection to ``address`` (no call on it) and ping
    it once per gap, after waiting the gap; (pings answered, the GOAWAY's
    error code and debug data, or b"" if none came)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS))
    answered = 0
    goaway = b""

    async def read() -> None:
        nonlocal answered, goaway
        while True:
            try:
                header = await reader.readexactly(9)
                length = int.from_bytes(header[:3], "big")
                kind, flags = header[3], header[4]
                payload = await reader.readexactly(length)
            except asyncio.IncompleteReadError:  # closed without a GOAWAY
                return
            if kind == SETTINGS and not flags & ACK:
                writer.write(frame(SETTINGS, ACK))
            elif kind == PING and flags & ACK:
                answered += 1
            elif kind == GOAWAY:
                goaway = payload[4:]  # error code, then debug data
                return

    reading = asyncio.create_task(read())
    try:
        for i, gap in enumerate(gaps_s):
            await asyncio.sleep(gap)
            if reading.done():
                break
            writer.write(frame(PING, payload=i.to_bytes(8, "big")))
        await asyncio.wait({reading}, timeout=0.5)  # the last answers
    finally:
        reading.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return answered, goaway


def test_a_server_takes_pings_at_the_configured_rate_but_not_a_flood(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A berth server (the batcher's, the engine's, the gateway's: all are
    ServiceServer) answers a client that pings every keepalive time (here
    0.2 s, set alike on both ends) with no call open, however long. One that
    asks for longer gaps than its clients keep (a fixed 10 s, or gRPC's
    default 5 min) sends GOAWAY "too_many_pings" at the fourth ping,
    and the stream of an idle client goes with it. A client that floods it
    still gets that GOAWAY."""
    fast_keepalive(monkeypatch, time_ms=200)

    async def scenario() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        server = await batcher_server(Batcher())
        try:
            steady = await ping_server(server.address, [0.2] * 8)
            flood = await ping_server(server.address, [0.0] * 8)
            return steady, flood
        finally:
            await server.server.stop(None)

    (steady, steady_goaway), (_, flood_goaway) = asyncio.run(scenario())
    assert (steady, steady_goaway) == (8, b""), (steady, steady_goaway)
    code, debug = int.from_bytes(flood_goaway[:4], "big"), flood_goaway[4:]
    assert code == ENHANCE_YOUR_CALM and debug == b"too_many_pings", flood_goaway


def test_keepalive_settings_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default a channel pings after 10 s of silence and gives up after
    5 s more, and a server takes a ping every 5 s: half the client's
    interval, as timers are not exact. Shortened, the server follows (it
    would call the pings of its own kind abuse otherwise); lengthened, it
    still takes pings from a peer on the default."""
    for name in ("BERTH_KEEPALIVE_TIME_MS", "BERTH_KEEPALIVE_TIMEOUT_MS"):
        monkeypatch.delenv(name, raising=False)
    min_interval = "grpc.http2.min_ping_interval_without_data_ms"
    client, server = dict(channel_options()), dict(server_options())
    assert client["grpc.keepalive_time_ms"] == 10_000
    assert client["grpc.keepalive_timeout_ms"] == 5_000
    assert client["grpc.http2.ping_timeout_ms"] == 5_000
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.http2.max_pings_without_data"] == 0
    assert server[min_interval] == 5_000
    assert server["grpc.keepalive_permit_without_calls"] == 1

    fast_keepalive(monkeypatch, time_ms=1_000, timeout_ms=500)
    assert keepalive_ms() == (1_000, 500)
    assert dict(channel_options())["grpc.http2.ping_timeout_ms"] == 500
    assert dict(server_options())[min_interval] == 500
    fast_keepalive(monkeypatch, time_ms=60_000)
    assert dict(server_options())[min_interval] == 5_000

    for wrong in ("soon", "0", "-5"):
        monkeypatch.setenv("BERTH_KEEPALIVE_TIMEOUT_MS", wrong)
        with pytest.raises(ConfigError, match="BERTH_KEEPALIVE_TIMEOUT_MS"):
            keepalive_ms()


def test_the_reconnect_back_off_doubles_from_fast_to_a_cap_with_jitter() -> None:
    def middle() -> float:
        return 0.5

    waits = [reconnect_delay(n, middle) for n in range(1, 10)]
    assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    # A restarted peer is tried twice more within 0.2 s, whatever the jitter.
    assert sum(reconnect_delay(n, lambda: 0.999) for n in (1, 2)) < 0.2
    # Spread +-20% at random, and no overflow however long it goes on.
    assert reconnect_delay(1, lambda: 0.0) == pytest.approx(0.04)
    assert reconnect_delay(10**6, lambda: 0.0) == pytest.approx(1.6)
    assert reconnect_delay(10**6, lambda: 1.0) == pytest.approx(2.4)
    assert reconnect_delay(0, middle) == pytest.approx(0.05)


class Refused(StreamClient[bytes, bytes, bytes]):
    """A client whose every try is refused at once: nothing listens."""

    def __init__(self, address: str) -> None:
        super().__init__(address, lambda channel: None)
        self.tries: list[float] = []

    async def _handshake(self) -> None:
        self.tries.append(time.monotonic())
        hello = self.channel.unary_unary("/berth.test.Nobody/Hello")
        await hello(b"", timeout=5)

    def _open(self, requests: AsyncIterator[bytes]) -> Any:
        raise AssertionError("the handshake cannot have passed")

    def _items(self, message: bytes) -> Iterable[tuple[int, bytes]]:
        return ()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_refusing_peer_is_tried_ever_less_often_and_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over 2 s against a closed port: the first retries come at once, then
    further and further apart; at most 7 tries (0.2 s apart: 10), and one
    warning (each further try only at DEBUG)."""

    async def scenario() -> list[float]:
        client = Refused(f"127.0.0.1:{closed_port()}")
        client.start()
        await asyncio.sleep(2.0)
        await client.close()
        return client.tries

    with caplog.at_level(logging.DEBUG, logger="berth.streams"):
        tries = asyncio.run(scenario())
    start = tries[0]
    assert 5 <= len(tries) <= 7, [round(t - start, 2) for t in tries]
    gaps = [round(b - a, 3) for a, b in zip(tries, tries[1:], strict=False)]
    # A restarted peer is found at once: the first two retries come sooner
    # than the last one alone waited (the schedule: 0.05, 0.1, ... 0.8 s).
    assert tries[2] - start < gaps[-1], gaps
    assert gaps[-1] > 4 * gaps[0] and gaps[-1] > 0.4, gaps
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "no stream to" in warnings[0].getMessage()


def test_a_stream_that_stayed_up_starts_the_back_off_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batcher that ends each stream at once is backed off further each
    time; once a stream stays up (STABLE_STREAM_S, shortened to 0.3 s), its
    loss is retried after the first, shortest wait again."""
    monkeypatch.setattr(streams, "STABLE_STREAM_S", 0.3)
    failures: list[int] = []

    def recorded(n: int) -> float:
        failures.append(n)
        return reconnect_delay(n)

    monkeypatch.setattr(streams, "reconnect_delay", recorded)

    async def scenario() -> None:
        servicer = Batcher()
        servicer.hold_s = 0.0
        server = await batcher_server(servicer)
        client = BatcherClient(server.address)
        client.start()
        try:
            async with asyncio.timeout(10):
                while len(failures) < 4:
                    await asyncio.sleep(0.01)
                servicer.hold_s = 0.5
                tried = len(failures)
                while len(failures) < tried + 2:
                    await asyncio.sleep(0.01)
        finally:
            await client.close()
            await server.server.stop(None)

    asyncio.run(scenario())
    assert failures[:4] == [1, 2, 3, 4], failures
    # The stream open when hold_s changed may have ended at once; the next
    # one stayed up 0.5 s.
    assert failures[-1] == 1, failures
