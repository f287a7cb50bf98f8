"""Start a real `berth serve` stack on free loopback ports, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    """n distinct ports that were free a moment ago."""
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def health(
    address: str,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> str:
    """The health status ``address`` reports, dialled in plaintext or with
    ``credentials`` (TLS); UNREACHABLE when the call fails."""
    with (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    ) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class Stack:
    """A `berth serve` process tree and its addresses."""

    def __init__(
        self,
        repository: Path,
        engines: int = 1,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        gateways: int = 1,
        batchers: int = 1,
        own_ports: bool = False,
        http: bool = False,
    ) -> None:
        """``own_ports``: each gateway also on a port of its own
        (--gateway-own-port), listed in ``own_gateways``; ``http``: the
        gateways' HTTP/JSON surface on a free port, at ``http`` (else off)."""
        (gateway,) = free_ports(1)
        # Engine and batcher ports are consecutive from --engine-port and
        # --batcher-port: find free runs.
        taken = {gateway}
        base = _free_run(engines, taken)
        batcher = _free_run(batchers, taken)
        metrics_base = _free_run(engines + gateways + batchers, taken)
        self.gateway = f"127.0.0.1:{gateway}"
        # /metrics: gateway, batcher, each engine, then the other gateways,
        # then the other batchers.
        self.metrics = [
            f"http://127.0.0.1:{metrics_base + i}/metrics"
            for i in range(engines + gateways + batchers)
        ]
        self.batcher = f"127.0.0.1:{batcher}"
        self.engines = [f"127.0.0.1:{base + i}" for i in range(engines)]
        own = _free_run(gateways, taken) if own_ports else 0
        self.own_gateways = [
            f"127.0.0.1:{own + i}" for i in range(gateways if own else 0)
        ]
        http_port = _free_run(1, taken) if http else 0
        self.http = f"http://127.0.0.1:{http_port}" if http else ""
        self.log_path = Path(os.environ.get("BERTH_TEST_LOGS", "/tmp")) / (
            f"berth-stack-{gateway}.log"
        )
        self._log = self.log_path.open("wb")
        argv = [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--engines",
            str(engines),
            "--port",
            str(gateway),
            "--batcher-port",
            str(batcher),
            "--engine-port",
            str(base),
            "--model-repository",
            str(repository),
            "--metrics-port",
            str(metrics_base),
            "--gateways",
            str(gateways),
            "--batchers",
            str(batchers),
            *(("--gateway-own-port", str(own)) if own else ()),
            *("--http-port", str(http_port)),
            *(extra_args or []),
        ]
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "BERTH_LOG_LEVEL": "INFO", **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_serving(
        self,
        timeout: float = 180.0,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """Until the gateway reports SERVING (asked with ``credentials``
        where its public port takes TLS only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"berth serve exited early:\n{self.logs()}")
            if health(self.gateway, credentials=credentials) == "SERVING":
                return
            time.sleep(0.25)
        raise TimeoutError(f"gateway not SERVING after {timeout} s:\n{self.logs()}")

    def logs(self, tail: int | None = 20000) -> str:
        """The stack's log, its last ``tail`` characters (None: all of it)."""
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _free_run(n: int, taken: set[int] | None = None) -> int:
    """A port p such that p .. p+n-1 are all free, none of them in ``taken``
    (to which they are added: the runs of one stack must not overlap, and
    nothing holds a free port until its service binds it)."""
    for _ in range(100):
        (p,) = free_ports(1)
        ok = taken is None or taken.isdisjoint(range(p, p + n))
        for q in range(p, p + n) if ok else ():
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            if taken is not None:
                taken.update(range(p, p + n))
            return p
    raise RuntimeError("no run of free ports")


def children(parent: int) -> dict[int, tuple[list[str], float]]:
    """pid -> (argv, CPU seconds used so far) of each child of ``parent``
    (from /proc; `berth serve`'s children are `python -m ROLE ...`)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError):
            continue
        if int(stat[1]) == parent:
            cpu = (int(stat[11]) + int(stat[12])) / tick
            out[int(proc.name)] = (argv.split("\0"), cpu)
    return out


def pid_listening(module: str, port: int) -> int:
    """The pid of `python -m <module> ... --port <port>` (from /proc)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        wanted = "-m" in args and module in args and "--port" in args
        if wanted and args[args.index("--port") + 1] == str(port):
            return int(proc.name)
    raise LookupError(f"no {module} process on port {port}")


def stream_raw(
    address: str,
    method: str,
    messages: list[bytes],
    deserializer: Callable[[bytes], Any],
    timeout: float = 20,
) -> tuple[list[Any], grpc.RpcError | None, float]:
    """Raw serialized messages over a bidi stream (one may be malformed on
    purpose): the answers, the error the stream ended with (None: OK), and
    the seconds it took."""
    answers = []
    error = None
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stream = channel.stream_stream(
            method,
            request_serializer=lambda raw: raw,
            response_deserializer=deserializer,
        )
        try:
            for response in stream(iter(messages), timeout=timeout):
                answers.append(response)
        except grpc.RpcError as exc:
            error = exc
    return answers, error, time.monotonic() - t0


@contextlib.contextmanager
def serving(stack: Stack, timeout: float = 180.0) -> Iterator[Stack]:
    """``stack`` once its gateway serves; stopped after, and the block fails
    if `berth serve` did not exit cleanly (its log in the message)."""
    try:
        stack.wait_serving(timeout)
        yield stack
    finally:
        code = stack.stop()
        assert code == 0, f"berth serve exited with {code}:\n{stack.logs()}"
