"""/metrics (services/metrics.py MetricsServer): idle connections cost no
thread each and are dropped after a few seconds, a scrape still answers, and
it listens on loopback unless told otherwise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.process import service_parser
from tests.stack import ROOT, free_ports, health


@pytest.fixture(scope="module")
def batcher(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A batcher whose gRPC port listens on every interface (--host 0.0.0.0)
    and whose engine never comes: it starts in a second."""
    port, metrics = free_ports(2)
    log_path = tmp_path_factory.mktemp("metrics") / "batcher.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                *("-m", "batcher", "--host", "0.0.0.0", "--port", str(port)),
                *("--engines", "127.0.0.1:1", "--metrics-port", str(metrics)),
                *("--model-repository", str(repository)),
            ],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "BERTH_METRICS_HOST"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while health(f"127.0.0.1:{port}") == "UNREACHABLE":
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield proc, metrics
    finally:
        proc.terminate()
        proc.wait(30)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def test_idle_connections_take_no_threads_and_a_scrape_answers(
    batcher: tuple[subprocess.Popen[bytes], int],
) -> None:
    proc, port = batcher
    assert "berth_batcher" in scrape(port)
    time.sleep(0.5)
    before = threads(proc.pid)
    idle = []
    try:
        for _ in range(100):  # connected, and never a byte of request
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.0)
        assert threads(proc.pid) <= before + 2
        # Once the idle ones are dropped, a scrape answers (they stay open on
        # this side: only the server's timeout frees them).
        deadline = time.monotonic() + 15  # (the server's read timeout: 3 s)
        while True:
            try:
                assert "berth_batcher" in scrape(port)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert threads(proc.pid) <= before + 2
    finally:
        for s in idle:
            s.close()


def test_metrics_listen_on_loopback_unless_told(
    batcher: tuple[subprocess.Popen[bytes], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, port = batcher
    # gRPC listens on every interface, /metrics on 127.0.0.1 alone: another
    # address of this machine (127.0.0.2, as any other) is refused.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    monkeypatch.delenv("BERTH_METRICS_HOST", raising=False)
    parser = service_parser("batcher", None, port=1, metrics_port=2)
    assert parser.parse_args([]).metrics_host == "127.0.0.1"
