"""A service binds its port alone: a second process on a port another
serves exits 1 saying so, instead of joining it (gRPC's SO_REUSEPORT) and
taking half the callers. `berth serve` turns sharing on for its own children
(BERTH_REUSE_PORT=1: its gateways share --port; tests/test_gateways.py and
tests/services/cli/test_serve_ports.py cover serve)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.server import ListenError, ServiceServer
from tests.stack import ROOT, free_ports


def test_a_second_server_on_a_port_is_refused_unless_both_share() -> None:
    async def scenario() -> None:
        port = free_ports(1)[0]
        first = ServiceServer("first", f"127.0.0.1:{port}", [], reuse_port=False)
        await first.start()
        try:
            with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}"):
                ServiceServer("second", f"127.0.0.1:{port}", [], reuse_port=True)
        finally:
            await first.server.stop(None)
        port = free_ports(1)[0]
        a = ServiceServer("a", f"127.0.0.1:{port}", [], reuse_port=True)
        b = ServiceServer("b", f"127.0.0.1:{port}", [], reuse_port=True)
        assert a.port == b.port == port
        await a.server.stop(None)
        await b.server.stop(None)

    asyncio.run(scenario())


def test_reuse_port_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def pair() -> None:
        port = free_ports(1)[0]
        a = ServiceServer("a", f"127.0.0.1:{port}", [])
        try:
            ServiceServer("b", f"127.0.0.1:{port}", [])
        finally:
            await a.server.stop(None)

    with pytest.raises(ListenError, match="BERTH_REUSE_PORT=1"):
        asyncio.run(pair())
    monkeypatch.setenv("BERTH_REUSE_PORT", "1")
    asyncio.run(pair())  # both bind


def test_a_second_batcher_on_a_served_port_exits_1_saying_why(
    repository: Path, tmp_path: Path
) -> None:
    port = free_ports(1)[0]
    argv = [
        sys.executable,
        "-m",
        "batcher",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--engines", "127.0.0.1:1", "--metrics-port", "0"),
        *("--model-repository", str(repository)),
    ]
    env = {k: v for k, v in os.environ.items() if k != "BERTH_REUSE_PORT"}
    log = tmp_path / "first.log"
    with log.open("wb") as out:
        first = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # until the first one listens
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert first.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the first batcher never listened"
            time.sleep(0.1)
        second = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 1, second.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr, second.stderr
        assert first.poll() is None  # the first one serves on
    finally:
        first.terminate()
        first.wait(30)


@pytest.mark.parametrize(
    ("address", "says"),
    [
        # gRPC takes the port modulo 65536: it listened on 4464.
        ("127.0.0.1:70000", "'70000' is not a port (0-65535)"),
        ("192.0.2.1:{port}", "192.0.2.1 is not an address of this machine"),
        ("no-such-host.invalid:{port}", "cannot resolve 'no-such-host.invalid'"),
    ],
    ids=["port", "not-here", "unresolvable"],
)
def test_a_listen_error_says_why_when_the_port_is_not_in_use(
    address: str, says: str
) -> None:
    """A bind fails for more than a port in use; the message said 'another
    process listens there' whatever the cause."""
    address = address.format(port=free_ports(1)[0])

    async def scenario() -> None:
        server = ServiceServer("x", address, [], reuse_port=False)
        await server.server.stop(None)  # (listening: the check failed)

    with pytest.raises(ListenError) as raised:
        asyncio.run(scenario())
    assert f"x: cannot listen on {address}: {says}" in str(raised.value)
    assert "another process" not in str(raised.value)


def test_a_gateway_own_port_that_is_its_port_is_refused() -> None:
    """Left to the bind, the second listen on the port failed blaming
    'another process listens there'. (In a subprocess: the pytest process
    must not import gateway.__main__, whose KServe stubs clash with
    tritonclient's.)"""
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--port", "6000", "--own-port", "6000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--own-port 6000 is --port too" in done.stderr, done.stderr


def test_a_metrics_port_in_use_exits_1_saying_why(repository: Path) -> None:
    """It ended the service with a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "batcher",
                *("--host", "127.0.0.1", "--port", str(free_ports(1)[0])),
                *("--engines", "127.0.0.1:1", "--metrics-port", str(metrics)),
                *("--model-repository", str(repository)),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stderr
    assert f"cannot serve /metrics on 127.0.0.1:{metrics}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
