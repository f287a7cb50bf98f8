"""benchmarks/e2e.py's load generator (benchmarks/serving/): where its
connections go, what it reads from the services' metrics, how its offline
baseline is labelled (measured in the run, or given on the command line),
and a short Stream load run for real."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from benchmarks.e2e import parse_args
from benchmarks.serving.load import Plan, Step, connection_targets
from benchmarks.serving.offline import baseline
from benchmarks.serving.report import document, profile_result, report
from benchmarks.serving.stack import Profile, pipeline, read_metrics
from benchmarks.serving.workload import make_texts
from services.repository import load_repository
from tests.stack import ROOT, Stack


def plan(client: int, spread: list[str], connections: int = 6) -> Plan:
    return Plan(
        "127.0.0.1:1",
        "m",
        [],
        [],
        1.0,
        connections=connections,
        spread=spread,
        client=client,
    )


def test_connections_go_to_the_shared_port_unless_spread() -> None:
    assert connection_targets(plan(3, [])) == ["127.0.0.1:1"] * 6


def test_spread_connections_share_the_gateways_evenly() -> None:
    gateways = [f"127.0.0.1:{2000 + i}" for i in range(8)]
    counts = Counter(
        target for c in range(5) for target in connection_targets(plan(c, gateways))
    )
    assert sorted(counts.values()) == [3, 3, 4, 4, 4, 4, 4, 4]  # 30 over 8
    assert connection_targets(plan(0, gateways, connections=1)) == gateways[:1]


def test_pipeline_reads_the_services_metrics_pages(tmp_path: Path) -> None:
    """read_metrics and pipeline on real /metrics text (prometheus_client's
    own exposition, the services' metric names), read through urllib."""
    engine, batcher, gateway = (CollectorRegistry() for _ in range(3))
    stage = Histogram(
        "berth_engine_stage_seconds", "", ["model", "stage"], registry=engine
    )
    size = Histogram(
        "berth_batcher_batch_size", "", ["model", "bucket"], registry=batcher
    )
    wait = Histogram(
        "berth_batcher_queue_wait_seconds", "", ["model", "bucket"], registry=batcher
    )
    latency = Histogram(
        "berth_batcher_batch_latency_seconds", "", ["model", "bucket"], registry=batcher
    )
    gw = Histogram(
        "berth_gateway_stage_seconds", "", ["model", "stage"], registry=gateway
    )
    pages = {"engine": engine, "batcher": batcher, "gateway": gateway}

    def read() -> dict[str, dict[str, float]]:
        for name, registry in pages.items():
            (tmp_path / name).write_bytes(generate_latest(registry))
        urls = [(tmp_path / name).as_uri() for name in pages]
        return read_metrics([*urls, (tmp_path / "gone").as_uri()])

    def batch(bucket: str, rows: int, compute_s: float) -> None:
        size.labels("m", bucket).observe(rows)
        for _ in range(rows):
            wait.labels("m", bucket).observe(0.004)
        latency.labels("m", bucket).observe(0.002)
        stage.labels("m", "compute").observe(compute_s)
        stage.labels("m", "copy_in").observe(1.0)  # not compute: left out
        gw.labels("m", "inference").observe(0.003)
        gw.labels("m", "total").observe(0.005)
        gw.labels("m", "tokenize").observe(1.0)

    batch("32", 100, 5.0)  # before the step: not counted
    before = read()
    assert set(before) == {(tmp_path / name).as_uri() for name in pages}
    batch("32", 4, 0.25)
    batch("32", 2, 0.25)
    batch("128", 3, 0.5)
    step = pipeline(before, read(), wall_s=2.0)
    assert step["batches"] == 3
    assert step["rows_per_batch"] == 3.0  # (4 + 2 + 3) / 3
    assert step["by_bucket"] == {
        32: {"batches": 2, "rows_per_batch": 3.0},
        128: {"batches": 1, "rows_per_batch": 3.0},
    }
    assert step["gpu_busy"] == 0.5  # 1.0 s of compute over 2 s
    assert step["gpu_ms_per_batch"] == 333.333
    assert step["queue_wait_ms"] == 4.0
    assert step["batch_latency_ms"] == 2.0
    assert step["gateway_inference_ms"] == 3.0
    assert step["gateway_total_ms"] == 5.0
    assert json.loads(json.dumps(step))["by_bucket"]["128"]["batches"] == 1

    # Nothing batched (cache hits): no readout.
    assert pipeline(read(), read(), wall_s=1.0) == {}

    # The engine restarted during the step: its counters start again from
    # zero, and its new reading is all the step's (not a negative one).
    before = read()
    engine.unregister(stage)
    stage = Histogram(
        "berth_engine_stage_seconds", "", ["model", "stage"], registry=engine
    )
    batch("32", 1, 0.5)
    step = pipeline(before, read(), wall_s=1.0)
    assert step["batches"] == 1
    assert step["gpu_busy"] == 0.5

    # A page read only after the step (its reading before failed) is left
    # out, not counted from its process's start.
    before = read()
    del before[(tmp_path / "engine").as_uri()]
    batch("32", 1, 0.5)
    assert pipeline(before, read(), wall_s=1.0)["gpu_busy"] == 0.0


def test_gpu_busy_is_each_engine_s_share(tmp_path: Path) -> None:
    """Two engines computing 0.5 s each in a 1-s step: each was busy half the
    step (not 1.0, the sum)."""
    registries = [CollectorRegistry() for _ in range(3)]
    engines = [
        Histogram("berth_engine_stage_seconds", "", ["model", "stage"], registry=r)
        for r in registries[:2]
    ]
    size = Histogram(
        "berth_batcher_batch_size", "", ["model", "bucket"], registry=registries[2]
    )

    def read() -> dict[str, dict[str, float]]:
        urls = []
        for i, registry in enumerate(registries):
            (tmp_path / str(i)).write_bytes(generate_latest(registry))
            urls.append((tmp_path / str(i)).as_uri())
        return read_metrics(urls)

    before = read()
    for engine in engines:
        engine.labels("m", "compute").observe(0.5)
        size.labels("m", "32").observe(4)
    assert pipeline(before, read(), wall_s=1.0)["gpu_busy"] == 0.5


def served_steps() -> list[Step]:
    """A profile's steps as a run records them: two rate steps, the cache."""
    return [
        Step("served 1", 1000.0, sent=1000, ok=1000, throughput=982.0),
        Step("served 2", 15000.0, sent=60000, ok=60000, throughput=14867.0),
        Step("cache hits", 1000.0, sent=1000, ok=1000, throughput=1012.0),
    ]


def ratio_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "served/" in line]


def test_a_given_baseline_is_labelled_given_in_the_json_and_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--offline-throughput: nothing is encoded, and the JSON, the line
    under each table and every ratio say the baseline was given, not
    measured, and its value."""
    base = baseline(4247.0, Path("/nonexistent"), [], 128)  # never encodes
    assert base["source"] == "given" and base["given"] is True
    results = {"hybrid": profile_result(Profile("hybrid", "h"), served_steps(), base)}
    doc = json.loads(json.dumps(document(base, results, model="bert-base")))
    assert doc["offline"] == base
    assert doc["baseline_given"] is True
    assert "not measured in this run" in doc["baseline_note"]
    hybrid = doc["profiles"]["hybrid"]
    assert hybrid["served_over_offline"] == 3.501  # 14,867 / 4,247
    assert "GIVEN baseline of 4247.0 texts/s" in hybrid["served_over_offline_against"]
    assert "not measured" in hybrid["served_over_offline_against"]

    text = report(base, results, "stream", "rate steps in requests/s (--rps 1000)")
    assert "offline baseline: a GIVEN baseline of 4247.0 texts/s" in text
    assert ratio_lines(text), text
    for line in ratio_lines(text):
        assert "served/given baseline = 3.50" in line, line
        assert "GIVEN baseline of 4247.0 texts/s" in line, line
        assert "not measured in this run" in line, line
    assert "measured in this run" not in text.replace("not measured in this run", "")

    # A baseline of nothing is refused, not taken as "measure one".
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--offline-throughput", "0"])
    with pytest.raises(SystemExit):
        parse_args()


def test_without_a_given_baseline_the_run_measures_one(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default phase 1 encodes the texts offline in the run (here a few,
    on the CPU), and the results say the baseline was measured."""
    monkeypatch.setattr(sys, "argv", ["e2e.py"])
    args = parse_args()
    assert args.offline_throughput is None
    entry = load_repository(repository)["minilm"]
    base = baseline(
        args.offline_throughput, entry.checkpoint_dir, make_texts(48, 1), 16
    )
    assert base["source"] == "measured" and base["given"] is False
    assert base["texts"] == 48 and base["throughput"] > 0 and base["seconds"] > 0

    results = {"stock": profile_result(Profile("stock", "s"), served_steps(), base)}
    doc = json.loads(json.dumps(document(base, results, model="minilm")))
    assert doc["baseline_given"] is False
    assert doc["baseline_note"].startswith("measured in this run")
    text = report(base, results, "unary", "rate steps 0.5 x the offline throughput")
    assert "GIVEN" not in text and "given baseline" not in text
    value = f"{base['throughput']:.1f} texts/s"
    assert f"offline baseline: the baseline measured in this run, {value}" in text
    for line in ratio_lines(text):
        assert "served/offline = " in line, line
        assert f"against the baseline measured in this run, {value}" in line, line


def test_stream_load_answers_every_request_over_several_streams(
    stack: Stack, repository: Path, tmp_path: Path
) -> None:
    """The Stream load, run for real: each connection's stream has its own
    writer, every request is answered once, and the step counts them all."""
    out = tmp_path / "e2e.json"
    done = subprocess.run(
        [
            *(sys.executable, "benchmarks/e2e.py", "--address", stack.gateway),
            *("--model-repository", str(repository), "--model", "minilm"),
            *("--api", "stream", "--rps", "150", "--duration", "1"),
            *("--max-requests", "150", "--clients", "1", "--connections", "3"),
            *("--offline-throughput", "100", "--out", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["baseline_given"] is True and doc["offline"]["source"] == "given"
    assert "served/given baseline = " in done.stdout, done.stdout[-3000:]
    steps = doc["profiles"]["external"]["steps"]
    assert [s["name"] for s in steps] == ["served 1", "cache hits"]
    for step in steps:
        assert step["sent"] == step["ok"] == 150, step
        assert step["errors"] == 0 and not step["error_codes"], step
