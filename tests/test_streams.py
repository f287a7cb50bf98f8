"""The long-lived internal streams (services/streams.py) at both ends.

Real gRPC servers on loopback: small servicers that end or garble the stream,
and the batcher's own Submit service in front of a real scheduler whose
engines are loopback servicers (tests/batcher/loopback.py).

- a stream the peer ends leaves nothing of it running on the client (its
  request writer waited on the dead stream's queue forever, one task per
  reconnect);
- an answer the client cannot read fails what is in flight with UNAVAILABLE
  and the client reconnects (the stream's task died: requests hung forever
  and the client never reconnected);
- a closed client refuses new requests (they were queued, never answered);
- the batcher's Submit: a gateway that hangs up mid-flight leaves no waiter
  behind in the scheduler, and one that closes its side still gets the
  answers of what it sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from batcher import LocalBatcher, SchedulerConfig
from batcher.service import BatcherService
from gateway.batcher_client import BatcherClient
from services.errors import Unavailable
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc
from tests.batcher.loopback import (
    ENTRY,
    SleepyEngine,
    sequence,
    started,
    stopped,
)
from tests.waits import until

BATCHER = internal_pb2.DESCRIPTOR.services_by_name["Batcher"].full_name


async def models(
    request: internal_pb2.BatcherModelsRequest, context: object
) -> internal_pb2.BatcherModels:
    return internal_pb2.BatcherModels(
        models=[internal_pb2.BatcherModel(name="m", state="closed")]
    )


class Peer:
    """A batcher on loopback whose Submit streams are ``submit``'s."""

    def __init__(self, submit: object, raw: bool = False) -> None:
        self.opened = 0
        self.server = grpc.aio.server()
        handlers = {
            "Models": grpc.unary_unary_rpc_method_handler(
                models,
                request_deserializer=internal_pb2.BatcherModelsRequest.FromString,
                response_serializer=internal_pb2.BatcherModels.SerializeToString,
            ),
            "Submit": grpc.stream_stream_rpc_method_handler(
                self._counted(submit),
                request_deserializer=internal_pb2.GatewayMessage.FromString,
                # raw: the servicer writes bytes of its own
                response_serializer=(
                    None if raw else internal_pb2.BatcherMessage.SerializeToString
                ),
            ),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(BATCHER, handlers),)
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def _counted(self, submit: object) -> object:
        async def handler(
            requests: AsyncIterator[object], context: object
        ) -> AsyncIterator[object]:
            self.opened += 1
            async for answer in submit(requests, context):  # type: ignore[operator]
                yield answer

        return handler


def request(n: int = 1) -> list[np.ndarray]:
    return [np.arange(1, 5, dtype=np.int32) for _ in range(n)]


def writers() -> int:
    """Request writers of stream calls (grpc.aio's request-iterator tasks)."""
    return sum(
        1
        for task in asyncio.all_tasks()
        if "_consume_request_iterator" in repr(task.get_coro())
    )


def test_a_stream_the_peer_ends_leaves_no_request_writer_behind() -> None:
    async def ends_at_once(
        requests: AsyncIterator[internal_pb2.GatewayMessage], context: object
    ) -> AsyncIterator[internal_pb2.BatcherMessage]:
        return
        yield

    async def scenario() -> tuple[int, int]:
        peer = Peer(ends_at_once)
        await peer.server.start()
        client = BatcherClient(peer.address)
        client.start()
        try:
            for _ in range(200):  # a reconnect every 0.2 s
                if peer.opened >= 8:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
            return peer.opened, writers()
        finally:
            await client.close()
            await peer.server.stop(None)

    opened, left = asyncio.run(scenario())
    # At most the stream being opened now; one per ended stream before.
    assert left <= 1, f"{left} request writers left running after {opened} streams"


def test_an_answer_that_cannot_be_read_fails_what_is_in_flight() -> None:
    async def garbles(
        requests: AsyncIterator[internal_pb2.GatewayMessage], context: object
    ) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield b"\xff\xff\xff"  # not a BatcherMessage

    async def scenario() -> tuple[BaseException | None, int]:
        peer = Peer(garbles, raw=True)
        await peer.server.start()
        client = BatcherClient(peer.address)
        client.start()
        try:
            await asyncio.wait_for(client.ready.wait(), 10)
            error: BaseException | None = None
            try:
                await asyncio.wait_for(client.run("m", request(), 0), 10)
            except Exception as exc:
                error = exc
            # The client opens a fresh stream rather than staying dead.
            for _ in range(100):
                if peer.opened >= 2 and client.connected:
                    break
                await asyncio.sleep(0.05)
            return error, peer.opened
        finally:
            await client.close()
            await peer.server.stop(None)

    error, opened = asyncio.run(scenario())
    assert isinstance(error, Unavailable), repr(error)
    assert opened >= 2


def test_a_closed_client_refuses_new_requests() -> None:
    async def echoes(
        requests: AsyncIterator[internal_pb2.GatewayMessage], context: object
    ) -> AsyncIterator[internal_pb2.BatcherMessage]:
        async for message in requests:
            yield internal_pb2.BatcherMessage(
                results=[
                    internal_pb2.SequenceResult(id=i)
                    for group in message.sequences
                    for i in group.ids
                ]
            )

    async def scenario() -> BaseException | None:
        peer = Peer(echoes)
        await peer.server.start()
        client = BatcherClient(peer.address)
        client.start()
        try:
            await asyncio.wait_for(client.ready.wait(), 10)
            await asyncio.wait_for(client.run("m", request(), 0), 10)
            await client.close()
            try:
                await asyncio.wait_for(client.run("m", request(), 0), 5)
            except Exception as exc:
                return exc
            return None
        finally:
            await peer.server.stop(None)

    error = asyncio.run(scenario())
    assert isinstance(error, Unavailable), repr(error)


async def batcher(
    delay_s: float,
) -> tuple[BatcherService, grpc.aio.Server, str, list[object]]:
    """The batcher's Submit service over a scheduler whose one engine
    answers each batch after ``delay_s``."""
    engine = SleepyEngine(delay_s)
    scheduler, pool, engines = await started([engine], 2, SchedulerConfig())
    service = BatcherService(LocalBatcher(pool, {ENTRY.name: scheduler}))
    server = grpc.aio.server()
    internal_pb2_grpc.add_BatcherServicer_to_server(service, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return service, server, address, [scheduler, pool, engines]


def test_a_gateway_that_hangs_up_mid_flight_leaves_no_waiter_behind() -> None:
    async def scenario() -> tuple[int, int]:
        service, server, address, rest = await batcher(delay_s=30)
        scheduler = service.batcher.schedulers[ENTRY.name]
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = internal_pb2_grpc.BatcherStub(channel).Submit()
                messages = [sequence(i, 4 + i % 9) for i in range(1, 21)]
                await call.write(internal_pb2.GatewayMessage(sequences=messages))
                await until(lambda: len(scheduler.waiters) >= 20, "20 queued")
                queued = len(scheduler.waiters)
                call.cancel()
            for _ in range(200):
                if not scheduler.waiters:
                    break
                await asyncio.sleep(0.01)
            return queued, len(scheduler.waiters)
        finally:
            await server.stop(None)
            await stopped(*rest)  # type: ignore[arg-type]

    queued, left = asyncio.run(scenario())
    assert queued == 20
    assert left == 0


@pytest.mark.parametrize("delay_s", [0.0, 0.3])
def test_a_gateway_that_closes_its_side_gets_every_answer(delay_s: float) -> None:
    async def scenario() -> list[internal_pb2.SequenceResult]:
        service, server, address, rest = await batcher(delay_s)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = internal_pb2_grpc.BatcherStub(channel).Submit()
                messages = [sequence(i, 4 + i % 9) for i in range(1, 11)]
                await call.write(internal_pb2.GatewayMessage(sequences=messages))
                await call.done_writing()
                results = [
                    r
                    async for message in call
                    for r in message.results  # type: ignore[attr-defined]
                ]
                return results
        finally:
            await server.stop(None)
            await stopped(*rest)  # type: ignore[arg-type]

    results = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert sorted(r.id for r in results) == list(range(1, 11))
    assert all(r.code == 0 for r in results), [r.message for r in results]
