"""`berth serve --batcher-mode inline`: each gateway batches its own calls
and streams to the engines itself (no batcher process); `--cpu-affinity
spread` pins each gateway to a CPU of its own; `--grpc-io` picks gRPC's I/O
for every child; `--idle-cpus spin` runs a SCHED_IDLE spinner on each CPU;
`--gateway-own-port` gives each gateway a port of its own."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.cli.supervisor import Child, plan_cpus
from services.cli.topology import GRPC_IO, set_grpc_io
from services.idle import cpu_quota
from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.metrics import scrape, value
from tests.stack import Stack, children, pid_listening, serving
from tests.test_gateways import CANCELLED, cancel_behind_a_stalled_engine

# serve refuses spinners under a CPU quota smaller than its CPUs.
_QUOTA = cpu_quota()
SPIN_ALLOWED = _QUOTA is None or len(os.sched_getaffinity(0)) <= _QUOTA

OK = r'berth_batcher_sequences_total\{.*model="minilm".*outcome="ok".*\}'


@pytest.fixture(scope="module")
def inline(repository: Path) -> Iterator[Stack]:
    stack = Stack(
        repository,
        gateways=2,
        own_ports=True,
        extra_args=[
            *("--batcher-mode", "inline"),
            *("--cpu-affinity", "spread"),
            *("--idle-cpus", "spin" if SPIN_ALLOWED else "sleep"),
        ],
    )
    spinning: list[int] = []
    with serving(stack):
        # Health on the shared port answers from one gateway; wait for both
        # (one still connecting to the engines would answer from the fallback).
        deadline = time.monotonic() + 120
        while stack.logs().count("gateway SERVING on") < 2:
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.2)
        spinning += spinner_pids(stack)
        yield stack
    # serve stops its spinners last, with everything else.
    assert not [pid for pid in spinning if Path(f"/proc/{pid}").exists()]


def spinner_pids(stack: Stack) -> list[int]:
    return [
        pid
        for pid, (argv, _) in children(stack.proc.pid).items()
        if "services.idle" in argv
    ]


@pytest.mark.skipif(not SPIN_ALLOWED, reason="this machine runs under a CPU quota")
def test_idle_cpus_spin_runs_an_idle_class_spinner_per_cpu(inline: Stack) -> None:
    pids = spinner_pids(inline)
    cpus = sorted(os.sched_getaffinity(0))
    assert sorted(min(os.sched_getaffinity(p)) for p in pids) == cpus
    assert all(len(os.sched_getaffinity(p)) == 1 for p in pids)
    assert all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids)
    assert "--idle-cpus spin: a SCHED_IDLE spinner on each of" in inline.logs(None)


def test_inline_answers_as_the_batcher_does(
    inline: Stack, client: berth_pb2_grpc.BerthStub
) -> None:
    texts = ["inline batching", "one hop fewer", "a third, longer text " * 8]
    with grpc.insecure_channel(inline.gateway) as channel:
        stub = berth_pb2_grpc.BerthStub(channel)
        request = berth_pb2.EmbedRequest(model="minilm", texts=texts)
        got = stub.Embed(request, timeout=60)
        label = stub.Classify(
            berth_pb2.ClassifyRequest(model="intent", texts=["play some jazz"]),
            timeout=60,
        )
    # The same texts through the default stack (gateway -> batcher -> engine).
    want = client.Embed(berth_pb2.EmbedRequest(model="minilm", texts=texts), timeout=60)
    assert not got.degraded
    for a, b in zip(got.embeddings, want.embeddings, strict=True):
        np.testing.assert_allclose(a.values, b.values, atol=1e-5)
    want_label = client.Classify(
        berth_pb2.ClassifyRequest(model="intent", texts=["play some jazz"]),
        timeout=60,
    )
    assert label.results[0].labels[0].label == want_label.results[0].labels[0].label
    # Batched by a gateway's own scheduler: its /metrics counts the texts.
    gateway_urls = (inline.metrics[0], inline.metrics[3])
    assert sum(value(scrape(u), OK) for u in gateway_urls) >= len(texts) + 1


def test_inline_runs_no_batcher_and_pins_each_gateway(inline: Stack) -> None:
    found = children(inline.proc.pid)
    procs = {pid: " ".join(argv) for pid, (argv, _) in found.items()}
    assert not [c for c in procs.values() if "-m batcher" in c], procs
    gateways = [pid for pid, c in procs.items() if "-m gateway" in c]
    assert len(gateways) == 2
    cpus = sorted(os.sched_getaffinity(0))
    pinned = [os.sched_getaffinity(pid) for pid in gateways]
    # One CPU each (CPU engines stay unpinned: their torch threads need the
    # cores): on two or more CPUs, two different ones.
    assert all(len(p) == 1 and p <= set(cpus) for p in pinned), pinned
    if len(cpus) >= 2:
        assert pinned[0] != pinned[1]
    engines = [pid for pid, c in procs.items() if "-m engine" in c]
    assert all(os.sched_getaffinity(pid) == set(cpus) for pid in engines)


def environ(pid: int) -> dict[str, str]:
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().decode()
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


@pytest.mark.skipif(
    "GRPC_EXPERIMENTS" in os.environ, reason="the caller's GRPC_EXPERIMENTS wins"
)
def test_every_process_runs_grpc_pollers_on_uvloop(inline: Stack) -> None:
    """--grpc-io poller (the default) reaches every child, and each service
    says which event loop and gRPC experiments it runs with."""
    for pid, (argv, _) in children(inline.proc.pid).items():
        if "services.idle" not in argv:  # the spinners run no gRPC
            assert environ(pid).get("GRPC_EXPERIMENTS") == GRPC_IO["poller"]
    logs = inline.logs(None)
    for name in ("gateway", "engine"):
        assert re.search(
            rf"{name} listening on \S+(, \S+)* \(event loop: uvloop, gRPC experiments: "
            rf"{re.escape(GRPC_IO['poller'])}\)",
            logs,
        ), logs[-3000:]


def test_a_callers_grpc_experiments_win() -> None:
    kids = [Child("gateway", ["true"]), Child("engine-0", ["true"], {"A": "1"})]
    set_grpc_io(kids, "poller", {})
    assert [k.env["GRPC_EXPERIMENTS"] for k in kids] == [GRPC_IO["poller"]] * 2
    assert kids[1].env["A"] == "1"
    set_grpc_io(kids, "event-engine", {})
    assert [k.env["GRPC_EXPERIMENTS"] for k in kids] == ["", ""]
    theirs = [Child("gateway", ["true"])]
    set_grpc_io(theirs, "poller", {"GRPC_EXPERIMENTS": "-some_experiment"})
    assert "GRPC_EXPERIMENTS" not in theirs[0].env  # inherited from the caller


def test_a_cancelled_call_leaves_the_inline_queue(inline: Stack) -> None:
    """A caller that gives up has its texts dropped from its gateway's queue."""
    engine = pid_listening("engine", int(inline.engines[0].rsplit(":", 1)[1]))
    # One connection: every call of this test reaches the same gateway.
    with grpc.insecure_channel(inline.gateway) as channel:
        gateway_urls = (inline.metrics[0], inline.metrics[3])
        cancel_behind_a_stalled_engine(
            berth_pb2_grpc.BerthStub(channel),
            engine,
            lambda: sum(value(scrape(u), CANCELLED) for u in gateway_urls),
        )


def test_plan_cpus_gives_consecutive_shares_and_wraps() -> None:
    assert plan_cpus([2, 1, 1], [0, 1, 2, 3, 4]) == [[0, 1], [2], [3]]
    # Fewer CPUs than shares: round the list again (some processes share).
    assert plan_cpus([2, 1, 1, 1], [4, 5, 6]) == [[4, 5], [6], [4], [5]]


def test_each_gateway_also_answers_alone_on_its_own_port(inline: Stack) -> None:
    """--gateway-own-port: gateway i listens alone on port + i too, so a
    caller can spread its connections over the gateways itself."""
    assert len(inline.own_gateways) == 2
    calls = {inline.own_gateways[0]: 3, inline.own_gateways[1]: 5}
    gateway_urls = (inline.metrics[0], inline.metrics[3])  # gateway-0, gateway-1
    requests = r'berth_gateway_requests_total\{.*model="minilm".*outcome="ok".*\}'
    before = [value(scrape(u), requests) for u in gateway_urls]
    for address, n in calls.items():
        with grpc.insecure_channel(address) as channel:
            stub = berth_pb2_grpc.BerthStub(channel)
            for i in range(n):
                stub.Embed(
                    berth_pb2.EmbedRequest(
                        model="minilm", texts=[f"own port {address} {i}"]
                    ),
                    timeout=60,
                )
    after = [value(scrape(u), requests) for u in gateway_urls]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 5]
    logs = inline.logs(None)
    assert f"each also alone on {inline.own_gateways[0]}-" in logs, logs[-3000:]
