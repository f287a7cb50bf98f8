"""The compose stack and Prometheus config agree with the services' flags."""

from __future__ import annotations

from pathlib import Path

import yaml

from batcher.__main__ import parse_args as batcher_args
from engine.__main__ import parse_args as engine_args
from gateway.__main__ import parse_args as gateway_args

ROOT = Path(__file__).resolve().parent.parent
PARSERS = {"gateway": gateway_args, "batcher": batcher_args, "engine": engine_args}


def test_compose_commands_parse_and_prometheus_scrapes_them() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for group in job["static_configs"]
        for t in group["targets"]
    }
    for name, parse in PARSERS.items():
        command = compose[name]["command"]
        assert command[:3] == ["python", "-m", name]
        args = parse(command[3:])  # every flag in the file is a real flag
        assert f"{name}:{args.metrics_port}" in targets
        assert compose[name]["environment"]["OTEL_SERVICE_NAME"] == name
        assert compose[name]["healthcheck"]["test"][-1].endswith(str(args.port))
    assert {"jaeger", "prometheus"} <= set(compose)
