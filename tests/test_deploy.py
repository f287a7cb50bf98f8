"""The compose stack and Prometheus config agree with the services' flags."""

from __future__ import annotations

import json
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
