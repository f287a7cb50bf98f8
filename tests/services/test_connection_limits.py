"""A berth server's connection limits (services/channels.py server_options):
concurrent streams per connection, idle connections, connection age."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.channels import aio_channel, server_options
from services.server import ServiceServer

HOLD = "/test.Hold/Hold"


async def holding_server(release: asyncio.Event, running: list[int]) -> ServiceServer:
    """A berth server whose one method holds each call until ``release``;
    ``running[0]``: calls in its handler now, ``running[1]``: the most ever."""

    async def hold(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        running[0] += 1
        running[1] = max(running[1], running[0])
        try:
            await release.wait()
        finally:
            running[0] -= 1
        return request

    server = ServiceServer("test", "127.0.0.1:0", ["test.Hold"])
    handler = grpc.unary_unary_rpc_method_handler(hold)
    server.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Hold", {"Hold": handler}),)
    )
    await server.start()
    return server


def test_one_connection_has_at_most_the_stream_limit_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BERTH_MAX_CONCURRENT_STREAMS", "4")
    asyncio.run(at_most_the_stream_limit())


async def at_most_the_stream_limit() -> None:
    release, running = asyncio.Event(), [0, 0]
    server = await holding_server(release, running)
    try:
        async with aio_channel(server.address) as channel:
            call = channel.unary_unary(HOLD)
            calls = [asyncio.ensure_future(call(b"x", timeout=30)) for _ in range(12)]
            await asyncio.sleep(1.0)
            assert running == [4, 4]
            release.set()
            done = await asyncio.gather(*calls, return_exceptions=True)
            # Past the limit gRPC refuses a stream (RST_STREAM REFUSED_STREAM:
            # UNAVAILABLE, which a client with a retry policy retries) or
            # holds it in the client until one ends.
            refused = [r for r in done if isinstance(r, grpc.aio.AioRpcError)]
            assert {r.code() for r in refused} <= {grpc.StatusCode.UNAVAILABLE}
            assert done.count(b"x") + len(refused) == 12
            assert done.count(b"x") >= 4
            print(f"{done.count(b'x')} answered, {len(refused)} refused")
            assert running[1] == 4
    finally:
        await server.server.stop(0)


def test_an_idle_connection_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_MAX_CONNECTION_IDLE_MS", "300")
    asyncio.run(idle_is_closed())


async def idle_is_closed() -> None:
    release, running = asyncio.Event(), [0, 0]
    release.set()
    server = await holding_server(release, running)
    try:
        async with aio_channel(server.address) as channel:
            assert await channel.unary_unary(HOLD)(b"x", timeout=10) == b"x"
            assert channel.get_state() == grpc.ChannelConnectivity.READY
            # Keepalive pings (berth's channels send them) are not use.
            await asyncio.sleep(2.0)
            assert channel.get_state() == grpc.ChannelConnectivity.IDLE
            # ...and the next call connects again.
            assert await channel.unary_unary(HOLD)(b"y", timeout=10) == b"y"
    finally:
        await server.server.stop(0)


def test_only_the_front_door_ages_connections_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    internal = dict(server_options())
    public = dict(server_options(public=True))
    assert "grpc.max_connection_age_ms" not in internal
    assert public["grpc.max_connection_age_ms"] == 30 * 60_000
    assert int(public["grpc.max_connection_age_grace_ms"]) > 0
    for options in (internal, public):
        assert options["grpc.max_concurrent_streams"] == 1024
        assert options["grpc.max_connection_idle_ms"] == 5 * 60_000
        assert int(options["grpc.keepalive_time_ms"]) > 0
    monkeypatch.setenv("BERTH_MAX_CONNECTION_AGE_MS", "0")
    assert "grpc.max_connection_age_ms" not in dict(server_options(public=True))
