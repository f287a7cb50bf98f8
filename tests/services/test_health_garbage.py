"""Bytes that are no HealthCheckRequest, sent to grpc.health.v1 (anyone who
can reach a port can send them): answered INVALID_ARGUMENT, logged at most
once a minute, and the process keeps serving (services/server.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc

from tests.stack import ROOT, free_ports, health

# A berth server as every process starts one, SERVING, with berth's logging.
SERVER = """
import asyncio, sys
from services.logs import setup_logging
from services.server import ServiceServer

async def main():
    setup_logging("probe")
    server = ServiceServer("probe", sys.argv[1], ["test.Probe"])
    await server.start()
    await server.set_serving(True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

GARBAGE = b"\xff\xff\xff\xff"  # a field with tag 0x1fffffff..., never ends


def test_garbage_to_health_check_is_invalid_argument_and_logged_once(
    tmp_path: Path,
) -> None:
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    log_path = tmp_path / "probe.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, address],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while health(address) != "SERVING":
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        before = len(log_path.read_text().splitlines())
        with grpc.insecure_channel(address) as channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=None,
                response_deserializer=None,
            )
            codes = set()
            for _ in range(100):
                try:
                    check(GARBAGE, timeout=5)
                except grpc.RpcError as exc:
                    codes.add((exc.code(), "HealthCheckRequest" in exc.details()))
            watch = channel.unary_stream(
                "/grpc.health.v1.Health/Watch",
                request_serializer=None,
                response_deserializer=None,
            )
            try:
                next(iter(watch(GARBAGE, timeout=5)))
            except grpc.RpcError as exc:
                codes.add((exc.code(), "HealthCheckRequest" in exc.details()))
        assert codes == {(grpc.StatusCode.INVALID_ARGUMENT, True)}
        assert health(address) == "SERVING"
        assert health(address, "test.Probe") == "SERVING"
        time.sleep(0.2)  # (the last calls' lines, if any, reach the file)
        lines = log_path.read_text().splitlines()[before:]
        assert len(lines) <= 2, "\n".join(lines[:40])
        assert "could not be parsed as grpc.health.v1.HealthCheckRequest" in lines[0]
    finally:
        proc.terminate()
        proc.wait(30)
