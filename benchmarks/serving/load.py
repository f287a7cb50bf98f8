"""The load generator: client processes sending open-loop single-text
requests over berth's API, unary (an Embed call each) or on berth's bidi
Stream, and what a step's answers come to.

Each client process gets a Plan (its texts and when to send each), connects
(plaintext, or TLS with the Plan's ClientTls), waits for the common start,
then sends every text at its time whatever the answers do. A request's
latency is counted from its scheduled send time, so a late client cannot
hide queueing (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ClientTls:
    """PEM bytes a client dials with TLS: the CA it trusts, and for mutual
    TLS its own certificate chain and key."""

    root: bytes
    chain: bytes | None = None
    key: bytes | None = None

    def credentials(self) -> Any:
        """gRPC channel credentials (sync and asyncio channels alike)."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.root,
            private_key=self.key,
            certificate_chain=self.chain,
        )


def dial(target: str, tls: ClientTls | None, options: list[Any]) -> Any:
    """An asyncio channel to ``target``: plaintext, or TLS with ``tls``."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)


@dataclass
class Plan:
    """One client process's share of a step: what to send and when."""

    address: str
    model: str
    texts: list[str]
    offsets: list[float]  # seconds after the common start
    deadline_s: float
    # Send every text once before the start, unmeasured: each gateway process
    # has its own cache, and this client's one channel reaches one of them.
    warm: bool = False
    connections: int = 1
    api: str = "unary"  # "unary": an Embed call each; "stream": berth's Stream
    # The gateways' own addresses (`berth serve --gateway-own-port`), when
    # the connections are spread over them instead of going to ``address``.
    spread: list[str] = field(default_factory=list)
    client: int = 0  # this client's index among the step's clients
    tls: ClientTls | None = None  # None: plaintext


def connection_targets(plan: Plan) -> list[str]:
    """Where each of a client's connections goes: all to ``address`` (the
    gateways' shared port, where the kernel hashes each connection to one
    of them), or spread over the gateways' own addresses in turn, client
    after client, as a caller that balances its own connections does (30
    connections over 8 gateways: 3 or 4 each, where the hash gave one
    gateway up to ~1.9x its share)."""
    if not plan.spread:
        return [plan.address] * plan.connections
    first = plan.client * plan.connections
    return [
        plan.spread[(first + j) % len(plan.spread)] for j in range(plan.connections)
    ]


Row = tuple[float, float, float, str]  # offset, latency, send lag, status
# The first message the server gave with each error code.
Examples = dict[str, str]
# What a client process sends back: its rows, its CPU seconds, its examples.
Answer = tuple[list[Row], float, Examples]


@dataclass
class Tally:
    """What one client saw: a Row per request, times from the common start
    ``t0``, and the first message of each error code."""

    t0: float
    rows: list[Row] = field(default_factory=list)
    examples: Examples = field(default_factory=dict)

    def answered(
        self, due: float, sent: float, code: str, details: str | None = None
    ) -> None:
        """A request due at ``due``, sent at ``sent``, ended now with ``code``
        (and the server's ``details``, kept as the example of its code)."""
        if details is not None:
            self.examples.setdefault(code, details)
        self.rows.append((due - self.t0, time.monotonic() - due, sent - due, code))


def client_main(plan: Plan, ready: Any, go: Any, start_at: Any, results: Any) -> None:
    """A client process: one event loop, its channels, open-loop sends.

    It moves messages as berth's services do (`berth serve`'s defaults):
    on uvloop, with gRPC's pollers doing the I/O (a GRPC_EXPERIMENTS or
    BERTH_EVENT_LOOP=asyncio set where e2e.py runs wins). On one machine
    the load generator's CPU is taken from the stack it measures."""
    from services.cli.topology import GRPC_IO
    from services.loop import run

    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_IO["poller"])
    results.put(run(_client(plan, ready, go, start_at)))


async def _client(plan: Plan, ready: Any, go: Any, start_at: Any) -> Answer:
    from services.channels import channel_options
    from services.proto.berth.v1 import berth_pb2_grpc

    # Several connections, used in turn: `berth serve --gateways N` runs N
    # processes on one port and the kernel spreads connections, not calls.
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [dial(target, plan.tls, options) for target in connection_targets(plan)]
    stubs = [berth_pb2_grpc.BerthStub(ch) for ch in channels]
    async with contextlib.AsyncExitStack() as stack:
        for ch in channels:
            await stack.enter_async_context(ch)
            await ch.channel_ready()
        if plan.warm:
            await _warm(plan, stubs[0])
        ready.put(os.getpid())
        go.wait()  # every client connected: the parent set start_at
        tally = Tally(start_at.value)
        cpu0 = time.process_time()
        load = _stream_load if plan.api == "stream" else _unary_load
        await load(plan, stubs, tally)
        cpu = time.process_time() - cpu0
    return tally.rows, cpu, tally.examples


async def _warm(plan: Plan, stub: Any) -> None:
    """Every text sent once, 64 at a time, unmeasured."""
    from services.proto.berth.v1 import berth_pb2

    limit = asyncio.Semaphore(64)

    async def warm(text: str) -> None:
        async with limit:
            await stub.Embed(
                berth_pb2.EmbedRequest(model=plan.model, texts=[text]),
                timeout=plan.deadline_s,
            )

    await asyncio.gather(*(warm(text) for text in plan.texts))


async def _paced(
    plan: Plan, t0: float, send: Callable[[int, str, float], None]
) -> None:
    """Open loop: each text handed to ``send`` (its request id, from 1, the
    text, its due time) at its due time, never early, whatever the answers
    do."""
    for request_id, (text, offset) in enumerate(
        zip(plan.texts, plan.offsets, strict=True), start=1
    ):
        due = t0 + offset
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        send(request_id, text, due)


async def _unary_load(plan: Plan, stubs: list[Any], tally: Tally) -> None:
    """The arrivals as single-text Embed calls, over the connections in turn."""
    import grpc

    from services.proto.berth.v1 import berth_pb2

    turn = itertools.cycle(stubs)
    tasks: list[asyncio.Task[None]] = []

    async def one(text: str, due: float) -> None:
        sent = time.monotonic()
        try:
            await next(turn).Embed(
                berth_pb2.EmbedRequest(model=plan.model, texts=[text]),
                timeout=plan.deadline_s,
            )
        except grpc.aio.AioRpcError as exc:
            tally.answered(due, sent, exc.code().name, exc.details() or "")
        else:
            tally.answered(due, sent, "OK")

    def send(_: int, text: str, due: float) -> None:
        tasks.append(asyncio.create_task(one(text, due)))

    await _paced(plan, tally.t0, send)
    await asyncio.gather(*tasks)


async def _stream_load(plan: Plan, stubs: list[Any], tally: Tally) -> None:
    """The same arrivals as single-text requests on berth's bidi Stream: one
    stream per connection, each request written at its time, answers matched
    by request_id as they come (out of order).

    Each stream has a writer task of its own: a gRPC stream takes one write
    at a time, and a write waits for its completion, so one sender awaiting
    each write in turn held every connection's requests behind the slowest
    write, and its lag counted as the server's latency."""
    from services.proto.berth.v1 import berth_pb2

    timeout = plan.offsets[-1] + plan.deadline_s + 30 if plan.offsets else None
    calls = [stub.Stream(timeout=timeout) for stub in stubs]
    sent_at: dict[int, tuple[float, float]] = {}  # request_id -> (due, sent)
    Outgoing = tuple[int, float, Any] | None  # (request_id, due, request)

    async def read(call: Any) -> None:
        async for response in call:
            if response.WhichOneof("response") == "embed":
                request_id, code, details = response.embed.request_id, "OK", None
            else:
                error = response.error
                request_id, code, details = error.request_id, error.code, error.message
            due, sent = sent_at.pop(request_id)
            tally.answered(due, sent, code, details)

    async def write(call: Any, outbox: asyncio.Queue[Outgoing]) -> None:
        while (item := await outbox.get()) is not None:
            request_id, due, request = item
            sent_at[request_id] = (due, time.monotonic())
            await call.write(request)
        await call.done_writing()

    outboxes: list[asyncio.Queue[Outgoing]] = [asyncio.Queue() for _ in calls]
    readers = [asyncio.create_task(read(call)) for call in calls]
    writers = [
        asyncio.create_task(write(call, outbox))
        for call, outbox in zip(calls, outboxes, strict=True)
    ]
    turn = itertools.cycle(outboxes)

    def send(request_id: int, text: str, due: float) -> None:
        request = berth_pb2.StreamRequest(
            embed=berth_pb2.EmbedRequest(
                model=plan.model, texts=[text], request_id=request_id
            )
        )
        # (Sent when its writer takes it; until then, from its due time: a
        # request the stream ends before is still counted, LOST.)
        sent_at[request_id] = (due, due)
        next(turn).put_nowait((request_id, due, request))

    await _paced(plan, tally.t0, send)
    for outbox in outboxes:
        outbox.put_nowait(None)
    await asyncio.gather(*writers)
    await asyncio.gather(*readers)
    for due, sent in sent_at.values():  # the stream ended without an answer
        tally.answered(due, sent, "LOST")


@dataclass
class Step:
    """What one rate step measured."""

    name: str
    rate: float
    sent: int = 0
    ok: int = 0
    shed: int = 0
    errors: int = 0
    throughput: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    send_lag_p99_ms: float = 0.0
    # Latency from the actual send, without the client's lateness.
    p50_from_send_ms: float = 0.0
    p99_from_send_ms: float = 0.0
    error_codes: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    # CPU seconds each role used during the step (engine, batcher, ...).
    cpu_s: dict[str, float] = field(default_factory=dict)
    # What the services' /metrics say about the step (`pipeline()`).
    pipeline: dict[str, Any] = field(default_factory=dict)


def summarize(name: str, rate: float, rows: list[Row]) -> Step:
    step = Step(name=name, rate=round(rate, 1), sent=len(rows))
    ok = np.array([lat for _, lat, _, code in rows if code == "OK"])
    for _, _, _, code in rows:
        if code == "RESOURCE_EXHAUSTED":
            step.shed += 1
        elif code != "OK":
            step.errors += 1
            step.error_codes[code] = step.error_codes.get(code, 0) + 1
    step.ok = len(ok)
    if step.ok:
        # From the first scheduled send to the last answer.
        span = max(off + lat for off, lat, _, _ in rows) - min(r[0] for r in rows)
        step.throughput = round(step.ok / span, 1)
        p50, p90, p99 = np.percentile(ok, [50, 90, 99]) * 1000
        step.p50_ms, step.p90_ms, step.p99_ms = (
            round(float(p50), 2),
            round(float(p90), 2),
            round(float(p99), 2),
        )
    step.send_lag_p99_ms = round(
        float(np.percentile([lag for _, _, lag, _ in rows], 99)) * 1000, 2
    )
    if step.ok:
        sent = [lat - lag for _, lat, lag, code in rows if code == "OK"]
        p50, p99 = np.percentile(sent, [50, 99]) * 1000
        step.p50_from_send_ms, step.p99_from_send_ms = round(p50, 2), round(p99, 2)
    return step
