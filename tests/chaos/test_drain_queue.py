"""A drain finishes the calls gRPC had already received, not only the ones
the service had picked up.

grpc.aio hands a server its calls one at a time, one event-loop turn each;
the rest wait in gRPC core's queue, and ``server.stop`` answers every call
still there CANCELLED (grpc/grpc#41785), whatever the grace period. A burst
of calls that reached a busy gateway just before its SIGTERM was lost that
way: 12 of 16 calls the chaos test had in flight (tests/chaos/test_chaos.py
::test_gateway_sigterm_mid_load_finishes_in_flight) came back CANCELLED.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from services.server import LAME_DUCK_S, ServiceServer

SERVICE = "berth.test.Slow"
CALLS = 16


def test_drain_finishes_calls_queued_in_grpc() -> None:
    outcomes: list[str] = []
    address: list[str] = []
    connected = threading.Event()
    busy = threading.Event()

    def client() -> None:
        with grpc.insecure_channel(address[0]) as channel:
            echo = channel.unary_unary(f"/{SERVICE}/Echo")
            echo(b"warm-up", timeout=10)  # connected before the burst
            connected.set()
            busy.wait(10)
            calls = [echo.future(b"x", timeout=10) for _ in range(CALLS)]
            for call in calls:
                try:
                    call.result()
                    outcomes.append("OK")
                except grpc.RpcError as exc:
                    outcomes.append(exc.code().name)

    async def main() -> None:
        server = ServiceServer("test", "127.0.0.1:0", [SERVICE])

        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await asyncio.sleep(0.05)
            return request

        server.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
                ),
            )
        )
        await server.start()
        address.append(server.address)
        thread = threading.Thread(target=client)
        thread.start()
        await asyncio.to_thread(connected.wait, 10)
        # The event loop is busy (as a gateway's is under load, or starved of
        # CPU) while the burst arrives: gRPC receives the calls and queues
        # them; then the signal comes before the loop picked them up.
        busy.set()
        time.sleep(0.5)
        server.request_stop()
        await server.run_until_signalled(grace_s=10, lame_duck_s=LAME_DUCK_S)
        await asyncio.to_thread(thread.join, 30)

    asyncio.run(main())
    assert outcomes == ["OK"] * CALLS, outcomes
