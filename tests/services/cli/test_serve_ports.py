"""`berth serve` refuses a port another process listens on, before it starts
any child: the gateways (and batchers, engines) listen with SO_REUSEPORT, so
without the check a second stack on the same --port would join the first's
port and the kernel would split the callers between the two."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc

from services.cli.parser import build_parser
from services.cli.plan import dial_address, plan_stack
from services.cli.ports import Listener, PortUnavailable, reserve_ports
from tests.stack import ROOT, Stack, _free_run, free_ports, health, pid_listening


def serve(
    repository: Path,
    *flags: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """`berth serve` on free ports but for ``flags`` (argparse: the last of a
    flag wins), ``env`` added to its environment: its exit code (-1: still
    running after ``timeout``, then stopped) and its output."""
    (gateway,) = free_ports(1)
    # One taken set, as Stack's: the runs must not overlap (serve refuses a
    # batcher port that is also a /metrics port, say).
    taken = {gateway}
    argv = [
        *("--port", str(gateway)),
        *("--engine-port", str(_free_run(1, taken))),
        *("--batcher-port", str(_free_run(1, taken))),
        *("--metrics-port", str(_free_run(3, taken))),
        *("--engines", "1", "--gateways", "1", "--batchers", "1"),
        *("--model-repository", str(repository), "--no-build-models"),
        *flags,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", *argv],
        cwd=ROOT,
        env={**os.environ, "BERTH_LOG_LEVEL": "INFO", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # its children stop with it
        out, _ = proc.communicate(timeout=90)
        return -1, out
    return proc.returncode, out


@contextmanager
def listening(port: int, reuseport: bool) -> Iterator[socket.socket]:
    """Another process's listener on 127.0.0.1:port (SO_REUSEPORT: as a
    berth gateway's, which a second one could join)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        yield s


def assert_refused(code: int, out: str, port: int, flag: str) -> None:
    assert code == 1, f"exit code {code}:\n{out}"
    said = [line for line in out.splitlines() if "in use" in line]
    assert any(f"port {port} (" in line and flag in line for line in said), out
    assert "started " not in out, f"a child was started:\n{out}"


@pytest.mark.parametrize("reuseport", [True, False], ids=["reuseport", "plain"])
@pytest.mark.parametrize(
    "flag", ["--port", "--engine-port", "--batcher-port", "--metrics-port"]
)
def test_a_port_another_process_listens_on_is_refused(
    tmp_path: Path, flag: str, reuseport: bool
) -> None:
    base = _free_run(3)
    # --metrics-port: engine-0's /metrics, base + 2, is the one taken.
    port = base + 2 if flag == "--metrics-port" else base
    with listening(port, reuseport):
        code, out = serve(tmp_path, flag, str(base))
    assert_refused(code, out, port, flag)


def test_a_second_serve_on_a_served_port_is_refused(repository: Path) -> None:
    first = Stack(repository)
    try:
        first.wait_serving(timeout=120)
        port = int(first.gateway.rsplit(":", 1)[1])
        code, out = serve(repository, "--port", str(port))
        assert_refused(code, out, port, "--port")
        assert health(first.gateway) == "SERVING"
    finally:
        assert first.stop() == 0, first.logs()


def test_a_restarted_gateway_rebinds_and_its_port_stays_taken(
    repository: Path,
) -> None:
    """While serve's only gateway is down (the supervisor, stopped here,
    has not restarted it yet) nothing listens on --port, yet a second serve
    is refused: serve holds the port for its children. The restarted
    gateway listens on it again."""
    first = Stack(repository)
    try:
        first.wait_serving(timeout=120)
        port = int(first.gateway.rsplit(":", 1)[1])
        os.kill(first.proc.pid, signal.SIGSTOP)
        try:
            os.kill(pid_listening("gateway", port), signal.SIGKILL)
            time.sleep(0.5)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            code, out = serve(repository, "--port", str(port))
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
        assert_refused(code, out, port, "--port")
        first.wait_serving(timeout=60)
        assert "gateway exited with code -9" in first.logs(), first.logs()
    finally:
        assert first.stop() == 0, first.logs()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        # The engine would share the gateways' port (SO_REUSEPORT).
        (["--engine-port", "{port}"], "engine-0's port {port} (--engine-port)"),
        (["--metrics-port", "65534"], "65536"),
        (["--port", "0"], "--port"),
    ],
)
def test_ports_serve_cannot_use_are_refused(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    (port,) = free_ports(1)
    flags = [f.format(port=port) for f in flags]
    code, out = serve(tmp_path, "--port", str(port), *flags)
    assert code == 2, f"exit code {code}:\n{out}"
    assert says.format(port=port) in out, out
    assert "started " not in out, out


def time_wait(port: int) -> None:
    """Leave a connection in TIME_WAIT on 127.0.0.1:port, as a stopped
    server leaves its closed connections, and nothing listening."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its TIME_WAIT
        time.sleep(0.1)
        client.close()
    time.sleep(0.1)
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()]
    local_states = [(row[1], row[3]) for row in rows[1:]]
    assert (f"0100007F:{port:04X}", "06") in local_states, "no TIME_WAIT"


def gateway_port(port: int) -> list[Listener]:
    return [Listener("gateway", "--port", port)]


def test_in_use_means_listened_on_not_a_time_wait() -> None:
    """A port a stopped server left connections in TIME_WAIT on is free (the
    services bind with SO_REUSEADDR); a listener, with SO_REUSEPORT or not,
    makes it in use."""
    (port,) = free_ports(1)
    time_wait(port)
    reserve_ports("127.0.0.1", gateway_port(port)).close()
    for reuseport in (True, False):
        with listening(port, reuseport), pytest.raises(PortUnavailable):
            reserve_ports("127.0.0.1", gateway_port(port))


def test_a_held_port_is_in_use_yet_grpc_listens_on_it() -> None:
    """serve's hold on a gRPC port: another serve's check fails though
    nothing listens; a gRPC server (a child, restarted or not) listens on it
    next to the hold and gets the connections."""
    (port,) = free_ports(1)
    with reserve_ports("127.0.0.1", gateway_port(port)):
        with pytest.raises(PortUnavailable, match=f"port {port} "):
            reserve_ports("127.0.0.1", gateway_port(port))
        for _ in range(2):  # and again, as a restarted child
            server = grpc.server(futures.ThreadPoolExecutor(1))
            health_pb2_grpc.add_HealthServicer_to_server(
                grpc_health.HealthServicer(), server
            )
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            server.start()
            try:
                assert health(f"127.0.0.1:{port}") == "SERVING"
            finally:
                server.stop(0).wait()
    reserve_ports("127.0.0.1", gateway_port(port)).close()  # let go


def test_a_wildcard_host_counts_listeners_of_both_families() -> None:
    """gRPC listens on --host 0.0.0.0 as [::], both families: a listener on
    [::1] is in its way too."""
    (port,) = free_ports(1)
    with socket.socket(socket.AF_INET6) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("::1", port))
        other.listen()
        with pytest.raises(PortUnavailable, match=f"port {port} .* on ::"):
            reserve_ports("0.0.0.0", gateway_port(port))
    reserve_ports("0.0.0.0", gateway_port(port)).close()


def test_a_gateway_own_port_in_the_environment_does_not_reach_serves_gateways(
    tmp_path: Path,
) -> None:
    """BERTH_OWN_PORT (python -m gateway's --own-port), set where serve runs,
    put every one of serve's gateways on that port, which serve had neither
    checked nor held: serve passes --own-port itself."""
    (own,) = free_ports(1)
    code, out = serve(
        tmp_path,
        "--gateways",
        "2",
        "--no-build-models",
        timeout=3,
        env={"BERTH_OWN_PORT": str(own)},
    )
    started = [line for line in out.splitlines() if "started gateway-" in line]
    assert len(started) >= 2, out  # (then restarted: the repository is empty)
    assert all("--own-port 0 " in line for line in started), out


@pytest.mark.parametrize(
    ("host", "dialled"),
    [
        ("127.0.0.1", "127.0.0.1:50060"),
        ("0.0.0.0", "127.0.0.1:50060"),  # a wildcard: dialled on loopback
        ("::", "[::1]:50060"),
        ("[::1]", "[::1]:50060"),
        ("10.1.2.3", "10.1.2.3:50060"),
        ("berth.internal", "berth.internal:50060"),
    ],
)
def test_siblings_dial_an_internal_listener_where_they_can_reach_it(
    host: str, dialled: str
) -> None:
    assert dial_address(host, 50060) == dialled


def test_batchers_and_engines_listen_on_the_internal_host() -> None:
    """--host opens the gateways' port; the batchers and engines listen on
    --internal-host (loopback by default), are checked there, and the
    gateways and batchers dial them there."""
    args = build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--engines", "2", "--device", "cpu"]
    )
    plan = plan_stack(args, devices=[])
    hosts = {
        child.name: child.argv[child.argv.index("--host") + 1]
        for child in plan.children
    }
    assert hosts == {
        "engine-0": "127.0.0.1",
        "engine-1": "127.0.0.1",
        "batcher": "127.0.0.1",
        "gateway": "0.0.0.0",
    }
    internal = [listener for listener in plan.listeners if listener.flag != "--port"]
    assert internal and all(
        (listener.host, listener.host_flag)
        in (("127.0.0.1", "--internal-host"), ("127.0.0.1", "--metrics-host"))
        for listener in internal
    )
    assert plan.batcher_addresses == [f"127.0.0.1:{args.batcher_port}"]
    assert plan.engine_addresses == [
        f"127.0.0.1:{args.engine_port + i}" for i in range(2)
    ]
