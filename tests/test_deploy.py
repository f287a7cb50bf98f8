"""The compose stack and Prometheus config agree with the services' flags."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

# Parsed in a child process: gateway/__main__.py imports berth's KServe
# stubs, which cannot share a process with tritonclient's (test_kserve.py).
PARSE = """
import json, sys
from importlib import import_module
args = import_module(sys.argv[1] + ".__main__").parse_args(sys.argv[2:])
print(json.dumps({"port": args.port, "metrics_port": args.metrics_port}))
"""


def parse(service: str, argv: list[str]) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", PARSE, service, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    parsed: dict[str, int] = json.loads(done.stdout)
    return parsed


def test_compose_commands_parse_and_prometheus_scrapes_them() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for group in job["static_configs"]
        for t in group["targets"]
    }
    for name in ("gateway", "batcher", "engine"):
        command = compose[name]["command"]
        assert command[:3] == ["python", "-m", name]
        args = parse(name, command[3:])  # every flag in the file is a real flag
        assert f"{name}:{args['metrics_port']}" in targets
        assert compose[name]["environment"]["OTEL_SERVICE_NAME"] == name
        assert compose[name]["healthcheck"]["test"][-1].endswith(str(args["port"]))
    assert {"jaeger", "prometheus"} <= set(compose)


def test_kubernetes_manifests_run_real_commands() -> None:
    seen = set()
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                command = container["command"]
                service = command[2]
                args = parse(service, command[3:])
                ports = {p["containerPort"] for p in container["ports"]}
                assert {args["port"], args["metrics_port"]} <= ports
                assert container["readinessProbe"]["grpc"]["port"] == args["port"]
                seen.add(service)
    assert seen == {"gateway", "batcher", "engine"}


# A GPU engine captures a CUDA graph per batch shape before it turns SERVING,
# and a first start may export its models too: that can take many minutes.
SLOW_START_S = 30 * 60


def test_a_slow_start_is_not_killed_by_a_liveness_probe() -> None:
    """Kubernetes holds a container's livenessProbe until its startupProbe
    succeeds: every container with a liveness probe needs a startup probe on
    the same check that allows SLOW_START_S."""
    live = set()
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                liveness = container.get("livenessProbe")
                if liveness is None:
                    continue
                live.add(container["name"])
                startup = container.get("startupProbe")
                assert startup is not None, f"{path.name}: no startupProbe"
                assert startup["grpc"] == liveness["grpc"], path.name
                # Kubernetes' defaults: every 10 s, 3 failures.
                allowed = startup.get("periodSeconds", 10) * startup.get(
                    "failureThreshold", 3
                )
                assert allowed >= SLOW_START_S, f"{path.name}: {allowed} s"
    assert "engine" in live


def test_compose_waits_out_a_slow_engine_start() -> None:
    """The batcher starts once the engine is healthy: the engine's
    healthcheck must not call it unhealthy (and fail `docker compose up`)
    while it warms up. Failures in start_period do not count."""
    engine = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][
        "engine"
    ]
    start_period = engine["healthcheck"].get("start_period", "0s")
    assert seconds(start_period) >= SLOW_START_S, start_period


def seconds(duration: str) -> int:
    """A compose duration ("30m", "1h30m", "90s") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts is not None and duration, f"not a duration: {duration!r}"
    hours, minutes, secs = (int(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + secs
