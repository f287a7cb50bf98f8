"""What gRPC itself costs in Python: the floor under every berth hop.

    python benchmarks/grpc_floor.py [--calls 10000] [--concurrency 64]

A grpc.aio server in its own process answers berth's EmbedRequest with a
fixed 384-float EmbedResponse and does nothing else; a grpc.aio client
drives it with --concurrency calls in flight. Measured in the same run:

- unary: one Embed call per request (what a plain client does);
- stream: the same requests on one bidi Stream (berth's high-rate API).

It prints calls/s and the server's and client's CPU microseconds per call,
with the stream's ratios against unary. A berth gateway pays at least the
server column per request; the batcher pays the stream column per message.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc  # noqa: E402

ANSWER = berth_pb2.EmbedResponse(
    model="m", embeddings=[berth_pb2.Embedding(values=[0.5] * 384, tokens=3)]
)


class Echo(berth_pb2_grpc.BerthServicer):
    async def Embed(self, request: Any, context: Any) -> Any:
        return ANSWER

    async def Stream(self, requests: Any, context: Any) -> Any:
        async for _ in requests:
            yield berth_pb2.StreamResponse(embed=ANSWER)


async def _serve(port: Any) -> None:
    import grpc

    server = grpc.aio.server()
    berth_pb2_grpc.add_BerthServicer_to_server(Echo(), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await server.wait_for_termination()


def serve(port: Any) -> None:
    asyncio.run(_serve(port))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def unary(stub: Any, calls: int, concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    request = berth_pb2.EmbedRequest(model="m", texts=["hello world"])

    async def one() -> None:
        async with limit:
            await stub.Embed(request)

    await asyncio.gather(*(one() for _ in range(calls)))


async def stream(stub: Any, calls: int, concurrency: int) -> None:
    call = stub.Stream()
    window = asyncio.Semaphore(concurrency)  # requests written, not answered
    request = berth_pb2.StreamRequest(
        embed=berth_pb2.EmbedRequest(model="m", texts=["hello world"])
    )

    async def read() -> None:
        async for _ in call:
            window.release()

    reader = asyncio.create_task(read())
    for _ in range(calls):
        await window.acquire()
        await call.write(request)
    await call.done_writing()
    await reader


async def measure(address: str, server_pid: int, args: argparse.Namespace) -> dict:
    import grpc

    results = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        for name, run in (("unary", unary), ("stream", stream)):
            await run(stub, 500, args.concurrency)  # warm up
            server0, client0 = cpu_seconds(server_pid), time.process_time()
            start = time.perf_counter()
            await run(stub, args.calls, args.concurrency)
            seconds = time.perf_counter() - start
            results[name] = {
                "calls_s": args.calls / seconds,
                "server_us": (cpu_seconds(server_pid) - server0) / args.calls * 1e6,
                "client_us": (time.process_time() - client0) / args.calls * 1e6,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    port = ctx.Value("i", 0)
    server = ctx.Process(target=serve, args=(port,), daemon=True)
    server.start()
    while not port.value:
        time.sleep(0.05)
    time.sleep(0.3)
    try:
        results = asyncio.run(measure(f"127.0.0.1:{port.value}", server.pid or 0, args))
    finally:
        server.terminate()
    base = results["unary"]
    print(f"{args.calls} calls, {args.concurrency} in flight, one client process")
    print(f"{'api':<8}{'calls/s':>10}{'server us':>11}{'client us':>11}   vs unary")
    for name, r in results.items():
        print(
            f"{name:<8}{r['calls_s']:>10.0f}{r['server_us']:>11.0f}{r['client_us']:>11.0f}"
            f"   {r['calls_s'] / base['calls_s']:.2f}x calls/s, "
            f"{r['server_us'] / base['server_us']:.2f}x server CPU"
        )


if __name__ == "__main__":
    main()
