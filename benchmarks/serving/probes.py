"""Two measurements of a gateway besides the open-loop steps, for
benchmarks/tls.py: what setting up a connection costs (fresh channels, each
to the answer of its first call), and the closed-loop capacity (texts/s
with a fixed number of calls in flight)."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.serving.load import ClientTls, dial
from benchmarks.serving.stack import Target, cpu_by_role, server_cpu


def connection_setup(to: Target, tls: ClientTls | None, n: int) -> dict[str, Any]:
    """``n`` fresh channels, each timed to the answer of its first health
    Check, against the same call on a connected channel: ms, and the CPU
    the gateway and this process spent per new connection."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.use_local_subchannel_pool", 1)]  # never a shared one
    credentials = tls.credentials() if tls else None
    request = health_pb2.HealthCheckRequest()

    def channel() -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(to.address, options=options)
        return grpc.secure_channel(to.address, credentials, options=options)

    def first_call() -> float:
        t0 = time.perf_counter()
        with channel() as ch:
            health_pb2_grpc.HealthStub(ch).Check(
                request, timeout=10, wait_for_ready=True
            )
            return time.perf_counter() - t0

    for _ in range(3):  # unmeasured: this process's first connections
        first_call()
    before, cpu0 = server_cpu(to.pid), time.process_time()
    fresh = [first_call() for _ in range(n)]
    client_cpu = time.process_time() - cpu0
    gateway_cpu = cpu_by_role(before, server_cpu(to.pid)).get("gateway", 0.0)
    with channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        stub.Check(request, timeout=10, wait_for_ready=True)
        warm = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Check(request, timeout=10)
            warm.append(time.perf_counter() - t0)
    f50, f90 = np.percentile(fresh, [50, 90]) * 1000
    w50 = float(np.percentile(warm, 50)) * 1000
    return {
        "channels": n,
        "first_call_p50_ms": round(float(f50), 3),
        "first_call_p90_ms": round(float(f90), 3),
        "connected_call_p50_ms": round(w50, 3),
        "setup_ms": round(float(f50) - w50, 3),
        "gateway_cpu_ms_per_connection": round(1000 * gateway_cpu / n, 3),
        "client_cpu_ms_per_connection": round(1000 * client_cpu / n, 3),
    }


@dataclass(frozen=True)
class ClosedLoop:
    """The capacity probe: ``concurrency`` single-text Embed calls of
    ``model`` in flight over ``connections``, ``warmup_s`` unmeasured (a new
    stack's first batches of each shape are slow), then ``seconds``
    measured."""

    model: str
    seconds: float
    warmup_s: float
    concurrency: int
    connections: int
    deadline_s: float
    tag: str = ""  # in every text: a later probe of the stack sends new texts


def capacity(
    address: str, tls: ClientTls | None, pool: list[str], loop: ClosedLoop
) -> dict[str, Any]:
    """The closed loop against ``address``, from a client process set up as
    the load generator's are; its texts are ``pool``'s, each with "#" and
    the tag and a number added: distinct from each other, from other tags'
    and from the open-loop steps' texts."""
    with mp.get_context("spawn").Pool(1) as workers:
        result: dict[str, Any] = workers.apply(probe_main, (address, tls, pool, loop))
    return result


def probe_main(
    address: str, tls: ClientTls | None, pool: list[str], loop: ClosedLoop
) -> dict[str, Any]:
    from services.cli.topology import GRPC_IO
    from services.loop import run

    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_IO["poller"])
    return run(_probe(address, tls, pool, loop))


async def _probe(
    address: str, tls: ClientTls | None, pool: list[str], loop: ClosedLoop
) -> dict[str, Any]:
    from services.channels import channel_options
    from services.proto.berth.v1 import berth_pb2_grpc

    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [dial(address, tls, options) for _ in range(loop.connections)]
    for ch in channels:
        await ch.channel_ready()
    stubs = itertools.cycle([berth_pb2_grpc.BerthStub(ch) for ch in channels])
    numbers = itertools.count()

    def text() -> str:
        k = next(numbers)
        return f"{pool[k % len(pool)]} #{loop.tag}{k}"

    if loop.warmup_s > 0:
        await _closed_loop(stubs, text, loop.warmup_s, loop)
    result = await _closed_loop(stubs, text, loop.seconds, loop)
    for ch in channels:
        await ch.close()
    return result


async def _closed_loop(
    stubs: Any, text: Callable[[], str], seconds: float, loop: ClosedLoop
) -> dict[str, Any]:
    """``loop.concurrency`` callers, each sending its next text as soon as
    its last is answered, for ``seconds``: texts/s and latency."""
    import grpc

    from services.proto.berth.v1 import berth_pb2

    latencies: list[float] = []
    errors: dict[str, int] = {}
    t0 = time.monotonic()
    end = t0 + seconds

    async def caller() -> None:
        while time.monotonic() < end:
            request = berth_pb2.EmbedRequest(model=loop.model, texts=[text()])
            sent = time.monotonic()
            try:
                await next(stubs).Embed(request, timeout=loop.deadline_s)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            else:
                latencies.append(time.monotonic() - sent)

    await asyncio.gather(*(caller() for _ in range(loop.concurrency)))
    wall = time.monotonic() - t0
    p50, p99 = np.percentile(latencies or [0.0], [50, 99]) * 1000
    return {
        "concurrency": loop.concurrency,
        "seconds": round(wall, 2),
        "ok": len(latencies),
        "errors": errors,
        "throughput": round(len(latencies) / wall, 1),
        "p50_ms": round(float(p50), 2),
        "p99_ms": round(float(p99), 2),
    }
