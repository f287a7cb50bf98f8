"""berth across hosts: gateway, batcher and engines each in a network
namespace of its own, on a bridge (tests/chaos/netns.py), under a steady
load from the root namespace that accounts for every request.

The batcher finds its engines through DNS (``--engines dns:///engines:50070``,
batcher/discovery.py): its namespace's hosts file maps ``engines`` to the
engine hosts, and is rewritten to add one (as a headless Service's name
gains the address of a pod that turned ready) and to take it away again.

- a link cut for a few seconds loses no request, and every answer comes
  from an engine (none degraded); the engine is used again once its link
  is back;
- an engine added to the name takes batches under load, and one removed
  from it takes no more, losing nothing;
- a batcher notices an engine host that went silent within the keepalive
  bound services/config.py documents (ping after 10 s without a word, gone
  5 s later), under load and idle, measured from the cut to its log line
  (printed: run with -s to see it).

Real processes (``ip netns exec <ns> python -m ...``), the CPU backend, the
real minilm model. Needs root and iproute2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.config import DEFAULT_KEEPALIVE_TIME_MS, DEFAULT_KEEPALIVE_TIMEOUT_MS
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.chaos import netns
from tests.chaos.load import TEXTS, LoadResult
from tests.metrics import scrape, value
from tests.stack import ROOT, health
from tests.waits import wait_until

pytestmark = pytest.mark.skipif(
    netns.missing() is not None, reason=str(netns.missing())
)

ENGINE_PORT, BATCHER_PORT, GATEWAY_PORT = 50070, 50060, 50051
ENGINE_METRICS = 9466
ENGINE_OK = r'berth_engine_batches_total\{model="minilm",outcome="ok"\}'
# The documented bound: a ping after KEEPALIVE_TIME without a word from the
# peer, and the peer given up KEEPALIVE_TIMEOUT later.
KEEPALIVE_BOUND_S = (DEFAULT_KEEPALIVE_TIME_MS + DEFAULT_KEEPALIVE_TIMEOUT_MS) / 1000


@dataclass
class Hosts:
    """The running stack: a host per process, and where each logs."""

    net: netns.Network
    gateway: netns.Host
    batcher: netns.Host
    engines: list[netns.Host]  # the third is not in DNS at first
    logs: Path

    def engine_batches(self, engine: netns.Host) -> float:
        url = f"http://{engine.address}:{ENGINE_METRICS}/metrics"
        return value(scrape(url), ENGINE_OK)

    def tails(self) -> str:
        """The end of every process's log."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.logs.iterdir())
        )

    def batcher_log(self) -> str:
        return (self.logs / "batcher.log").read_text(errors="replace")

    def name_engines(self, engines: list[netns.Host]) -> None:
        """What ``engines`` resolves to in the batcher's namespace."""
        lines = "".join(f"{e.address} engines\n" for e in engines)
        self.batcher.write_hosts(f"127.0.0.1 localhost\n{lines}")


def python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_stack(net: netns.Network, repository: Path, logs: Path) -> Hosts:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BERTH_", "OTEL_")) or k == "BERTH_TEST_LOGS"
    }
    env.update(BERTH_LOG_LEVEL="INFO", BERTH_TORCH_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT)
    common = ("--model-repository", str(repository))
    engines = [net.add(f"engine{i}") for i in range(3)]
    batcher, gateway = net.add("batcher"), net.add("gateway")
    hosts = Hosts(net, gateway, batcher, engines, logs)
    hosts.name_engines(engines[:2])
    for i, engine in enumerate(engines):
        listen = ("--host", engine.address, "--port", str(ENGINE_PORT))
        metrics = ("--metrics-host", engine.address)
        argv = python("engine", *listen, *metrics, "--device", "cpu", *common)
        engine.start(argv, logs / f"engine{i}.log", env)
    argv = python(
        "batcher",
        *("--host", batcher.address, "--port", str(BATCHER_PORT)),
        *("--metrics-host", batcher.address),
        *("--engines", f"dns:///engines:{ENGINE_PORT}", "--dns-interval-s", "0.5"),
        *common,
    )
    # glibc gives every address a hosts file has for a name only with
    # `multi on` (/etc/host.conf, which Debian ships; else the first).
    batcher.start(argv, logs / "batcher.log", {**env, "RESOLV_MULTI": "on"})
    argv = python(
        "gateway",
        *("--host", gateway.address, "--port", str(GATEWAY_PORT)),
        *("--batcher", f"{batcher.address}:{BATCHER_PORT}", "--metrics-port", "0"),
        *common,
    )
    gateway.start(argv, logs / "gateway.log", env)
    return hosts


def wait_ready(hosts: Hosts) -> None:
    """Every engine SERVING, the batcher streaming to the two named ones,
    the gateway SERVING; fails early, with the logs, if a process exits."""

    def ready() -> bool:
        for host in [hosts.gateway, hosts.batcher, *hosts.engines]:
            for proc in host.processes:
                if proc.poll() is not None:
                    raise AssertionError(f"{host.namespace} exited:\n{hosts.tails()}")
        engines = [f"{e.address}:{ENGINE_PORT}" for e in hosts.engines]
        if not all(health(e) == "SERVING" for e in engines):
            return False
        log = hosts.batcher_log()
        named = hosts.engines[:2]
        streaming = all(
            f"engine {e.address}:{ENGINE_PORT} connected" in log for e in named
        )
        serving = health(f"{hosts.gateway.address}:{GATEWAY_PORT}") == "SERVING"
        return streaming and serving

    try:
        wait_until(ready, "engines, batcher and gateway serving", timeout_s=180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{hosts.tails()}") from None


@pytest.fixture(scope="module")
def hosts(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hosts]:
    """The stack across five hosts; everything removed afterwards."""
    only = tmp_path_factory.mktemp("repository")
    (only / "minilm").symlink_to(repository / "minilm")
    logs = tmp_path_factory.mktemp("logs")
    net = netns.Network()
    try:
        stack = start_stack(net, only, logs)
        wait_ready(stack)
        yield stack
    finally:
        net.close()


class Load:
    """Single-text Embed calls, ``concurrency`` at a time, from the root
    namespace, until stopped; every call has a deadline and is counted."""

    def __init__(self, address: str, concurrency: int = 6) -> None:
        self.result = LoadResult()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._run(address, concurrency),), daemon=True
        )

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the load did not stop"

    def ok_since(self, count: int) -> int:
        return self.result.outcomes["OK"] - count

    async def _run(self, address: str, concurrency: int) -> None:
        run = uuid.uuid4().hex[:8]
        result, numbers = self.result, iter(range(10**9))
        async with grpc.aio.insecure_channel(address) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)

            async def worker() -> None:
                for i in numbers:
                    if self._stop.is_set():
                        return
                    text = f"{TEXTS[i % len(TEXTS)]} (request {run}-{i})"
                    request = berth_pb2.EmbedRequest(model="minilm", texts=[text])
                    result.sent += 1
                    try:
                        reply = await stub.Embed(request, timeout=30)
                    except grpc.aio.AioRpcError as exc:
                        result.outcomes[exc.code().name] += 1
                        continue
                    result.outcomes["OK"] += 1
                    result.degraded += reply.degraded

            await asyncio.gather(*(worker() for _ in range(concurrency)))


def assert_all_answered_by_engines(load: Load) -> None:
    result = load.result
    assert result.sent > 0 and result.outcomes["OK"] == result.sent, result.summary(
        "load"
    )
    assert result.degraded == 0, result.summary("load")


def test_a_cut_link_loses_no_request_and_the_engine_comes_back(hosts: Hosts) -> None:
    engine = hosts.engines[0]
    target = f"{hosts.gateway.address}:{GATEWAY_PORT}"
    with Load(target) as load:
        wait_until(lambda: load.ok_since(0) >= 50, "the load under way", 60)
        engine.cut()
        try:
            time.sleep(4)
        finally:
            engine.restore()
        after_cut = load.result.outcomes["OK"]
        wait_until(lambda: load.ok_since(after_cut) >= 50, "answers after the cut", 60)
        restored = hosts.engine_batches(engine)
        wait_until(
            lambda: hosts.engine_batches(engine) >= restored + 10,
            "the restored engine computing batches again",
            timeout_s=60,
        )
    assert_all_answered_by_engines(load)


def test_an_engine_added_to_the_name_takes_batches(hosts: Hosts) -> None:
    added = hosts.engines[2]
    address = f"{added.address}:{ENGINE_PORT}"
    assert hosts.engine_batches(added) == 0
    target = f"{hosts.gateway.address}:{GATEWAY_PORT}"
    with Load(target) as load:
        wait_until(lambda: load.ok_since(0) >= 50, "the load under way", 60)
        hosts.name_engines(hosts.engines)
        wait_until(
            lambda: hosts.engine_batches(added) >= 10,
            "the added engine computing batches",
            timeout_s=60,
        )
        assert re.search(rf"new: {re.escape(address)}", hosts.batcher_log())
        # Out of the name again: retired, it takes no new batches.
        hosts.name_engines(hosts.engines[:2])
        wait_until(
            lambda: f"engine {address} closed (retired)" in hosts.batcher_log(),
            "the removed engine retired",
            timeout_s=30,
        )
        # (What it was computing when it was closed is counted by now.)
        ok = load.result.outcomes["OK"]
        wait_until(lambda: load.ok_since(ok) >= 20, "answers after retiring", 60)
        retired, ok = hosts.engine_batches(added), load.result.outcomes["OK"]
        wait_until(lambda: load.ok_since(ok) >= 100, "more answers", 60)
        assert hosts.engine_batches(added) == retired
    assert_all_answered_by_engines(load)


@pytest.mark.parametrize("concurrency", [2, 0], ids=["under-load", "idle"])
def test_a_silent_engine_host_is_noticed_within_the_keepalive_bound(
    hosts: Hosts, concurrency: int
) -> None:
    """The link to an engine is cut and stays cut: the batcher's stream to
    it must fail (its 'disconnected' line) within keepalive time + timeout
    of the cut, under load (the other engine answering everything) and
    idle (nothing in flight: the keepalive pings alone can tell)."""
    engine = hosts.engines[1]
    address = f"{engine.address}:{ENGINE_PORT}"
    line, reconnected = f"engine {address} disconnected", f"engine {address} connected"
    target = f"{hosts.gateway.address}:{GATEWAY_PORT}"
    before = hosts.batcher_log()
    lost, found = before.count(line), before.count(reconnected)
    with contextlib.ExitStack() as stack:
        if concurrency:
            load = stack.enter_context(Load(target, concurrency))
            wait_until(lambda: load.ok_since(0) >= 20, "the load under way", 60)
        else:
            # Quiet for a while: what flow-control pings followed the last
            # data are answered, and only keepalive pings go on the stream.
            time.sleep(3)
        engine.cut()
        cut_at = time.monotonic()
        try:
            wait_until(
                lambda: hosts.batcher_log().count(line) > lost,
                "the batcher noticing the silent engine",
                timeout_s=KEEPALIVE_BOUND_S + 30,
                poll_s=0.05,
            )
            noticed_s = time.monotonic() - cut_at
        finally:
            engine.restore()
        wait_until(
            lambda: hosts.batcher_log().count(reconnected) > found,
            "the batcher streaming to the engine again",
            timeout_s=30,
        )
    print(f"silent engine noticed after {noticed_s:.2f} s (bound {KEEPALIVE_BOUND_S})")
    # (0.5 s: polling the log, and a loaded 2-core machine.)
    assert noticed_s <= KEEPALIVE_BOUND_S + 0.5, noticed_s
    if concurrency:
        assert_all_answered_by_engines(load)
