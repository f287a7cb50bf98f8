"""`berth health` against a real grpc.health.v1 server."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.stack import ROOT, free_ports


def berth_health(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "health", "--timeout", "5", *args],
        cwd=ROOT,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout.strip()


def test_statuses() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("berth.v1.Berth", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert berth_health("--address", address) == (0, "SERVING")
        code, out = berth_health("--address", address, "--service", "berth.v1.Berth")
        assert (code, out) == (1, "NOT_SERVING")
        # The server answered: the service name is wrong, not the network.
        code, out = berth_health("--address", address, "--service", "berth.v1.Bert")
        assert code == 1 and "UNREACHABLE" not in out, out
        assert "SERVICE_UNKNOWN" in out and "'berth.v1.Bert'" in out, out
    finally:
        server.stop(0)
    (nowhere,) = free_ports(1)
    code, out = berth_health("--address", f"127.0.0.1:{nowhere}")
    assert code == 1 and out.startswith("UNREACHABLE"), out
