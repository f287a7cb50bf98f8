"""A real Prometheus scrapes a running stack with the shipped configuration,
and every query that berth's dashboard and autoscaling rules run returns data.

The scrape configuration is the shipped one, with only its target addresses
rewritten to the stack's loopback metrics ports:

- deploy/prometheus.yml (docker-compose.yml's Prometheus): each target names
  a compose service and the port of that service's ``--metrics-port``;
- deploy/k8s/monitoring/prometheus-scrape.yaml (Kubernetes): its pod
  discovery is replaced by a file of the labels Kubernetes' pod discovery
  gives each pod of deploy/k8s/base (its labels, annotations, namespace,
  name; the pod IP and the annotation's port being the stack's), so that the
  shipped relabelling picks the pods, their address and their labels.

Prometheus is Debian's ``prometheus`` package, run as a plain process on a
free loopback port (`make test` installs the package where it is missing).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
import yaml

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.chaos.load import run_load_while
from tests.stack import Stack, free_ports, pid_listening, serving
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
SCRAPE = ROOT / "deploy" / "prometheus.yml"
K8S = ROOT / "deploy" / "k8s"
K8S_SCRAPE = K8S / "monitoring" / "prometheus-scrape.yaml"
ADAPTER = K8S / "monitoring" / "prometheus-adapter-values.yaml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
SERVICES = ("gateway", "batcher", "engine")
NAMESPACE = "berth"

# Dashboard queries that only have data on a machine with an NVIDIA GPU: they
# must still run (Prometheus answers "success"). Every other query must
# return a value.
GPU_ONLY = {
    "berth_engine_gpu_utilization_ratio": "NVML's SM utilization; "
    "a CPU engine never sets it (it reads 0, no measurement)",
    "berth_engine_gpu_memory_used_bytes": "NVML's memory in use; "
    "a CPU engine never sets it (it reads 0, no measurement)",
}
# Grafana's variables, as Grafana substitutes them at a 5 s scrape interval.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "5s",
    "$__range": "5m",
    "$model": "minilm",
    "${model}": "minilm",
}


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    assert found, (
        "prometheus is not installed: `make test` installs Debian's package "
        "(apt-get install prometheus)"
    )
    return found


# --- The scrape configuration: the shipped one, on the stack's ports --------


def compose_metrics_ports() -> dict[str, int]:
    """Each berth service of docker-compose.yml and its --metrics-port."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ports = {}
    for name in SERVICES:
        command = services[name]["command"]
        ports[name] = int(command[command.index("--metrics-port") + 1])
    return ports


def compose_scrape(metrics: dict[str, str]) -> dict[str, Any]:
    """deploy/prometheus.yml, each target ``service:port`` replaced by the
    stack's address of that service's metrics (``metrics``); a target that is
    not a compose service's metrics port fails the test."""
    config = yaml.safe_load(SCRAPE.read_text())
    ports = compose_metrics_ports()
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            rewritten = []
            for target in group["targets"]:
                host, _, port = target.rpartition(":")
                assert ports.get(host) == int(port), (
                    f"{SCRAPE.name}: job {job['job_name']} scrapes {target}, "
                    f"which is no metrics port of docker-compose.yml ({ports})"
                )
                rewritten.append(metrics[host])
            group["targets"] = rewritten
    return config


def pod_templates() -> dict[str, dict[str, Any]]:
    """The pod template of each tier in deploy/k8s/base."""
    templates = {}
    for service in SERVICES:
        for doc in yaml.safe_load_all((K8S / "base" / f"{service}.yaml").read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                templates[service] = doc["spec"]["template"]
    assert set(templates) == set(SERVICES), templates.keys()
    return templates


def metrics_port(pod: dict[str, Any]) -> int:
    """The --metrics-port of a pod template's one container."""
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    return int(command[command.index("--metrics-port") + 1])


def meta(prefix: str, values: dict[str, str]) -> dict[str, str]:
    """Kubernetes' discovery labels for a pod's labels or annotations."""
    return {prefix + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in values.items()}


def k8s_scrape(metrics: dict[str, str], directory: Path) -> list[dict[str, Any]]:
    """The jobs of prometheus-scrape.yaml, each pod discovery replaced by a
    file of what Kubernetes' pod discovery finds: a pod of each tier (two
    gateways, as the HPA's minimum) at the stack's address. The annotation's
    port is the stack's port; everything else is the manifest's."""
    groups = []
    for service, pod in pod_templates().items():
        template = pod["metadata"]
        annotations = dict(template.get("annotations", {}))
        host, _, port = metrics[service].rpartition(":")
        declared = annotations.get("prometheus.io/port")
        assert declared == str(metrics_port(pod)), (
            f"{service}: prometheus.io/port {declared} is not the container's "
            f"--metrics-port {metrics_port(pod)}"
        )
        annotations["prometheus.io/port"] = port
        name = template["labels"]["app.kubernetes.io/name"]
        for replica in range(2 if service == "gateway" else 1):
            labels = {
                "__meta_kubernetes_namespace": NAMESPACE,
                "__meta_kubernetes_pod_name": f"{name}-{replica}",
                "__meta_kubernetes_pod_ip": host,
                **meta("__meta_kubernetes_pod_label_", template["labels"]),
                **meta("__meta_kubernetes_pod_annotation_", annotations),
            }
            # Pod discovery's own address: the pod IP and a container port.
            groups.append({"targets": [f"{host}:1"], "labels": labels})
    (directory / "pods.json").write_text(json.dumps(groups))
    jobs = yaml.safe_load(K8S_SCRAPE.read_text())["scrape_configs"]
    for job in jobs:
        sd = job.pop("kubernetes_sd_configs")
        assert sd == [{"role": "pod"}], sd
        job["file_sd_configs"] = [{"files": [str(directory / "pods.json")]}]
    return jobs


# --- Prometheus --------------------------------------------------------------


class Prometheus:
    """A Prometheus process and its HTTP API."""

    def __init__(self, config: dict[str, Any], directory: Path) -> None:
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        path = directory / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = directory / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={path}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.logs()
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar) ``expr`` gives now; fails the test
        unless Prometheus answers success."""
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        result = answer["data"]["result"]
        if answer["data"]["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def targets(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/targets")["data"]["activeTargets"])

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def finite(result: list[dict[str, Any]]) -> bool:
    """Whether some sample of a query's result is a number (not NaN)."""
    return any(math.isfinite(float(s["value"][1])) for s in result)


# --- The queries -------------------------------------------------------------


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every shipped dashboard, Grafana's variables
    substituted."""
    queries = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
                    expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
                assert "$" not in expr, f"unsubstituted variable in {expr!r}"
                queries.append((f"{path.name}: {panel['title']}", expr))
    assert queries
    return queries


class AdapterQuery(NamedTuple):
    metric: str
    series: str  # the rule's seriesQuery
    query: str  # its metricsQuery, filled
    group_by: str
    groups: set[str]  # the values of group_by the answer must have


def adapter_queries() -> list[AdapterQuery]:
    """Every prometheus-adapter rule, its template filled as
    prometheus-adapter fills it for the HPAs of deploy/k8s: a Pods metric for
    the namespace's gateway pods, grouped by pod; an External metric for the
    namespace, grouped by namespace."""
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]
    pods = {"berth-gateway-0", "berth-gateway-1"}
    kinds = {
        "custom": (f'namespace="{NAMESPACE}",pod=~"{"|".join(sorted(pods))}"', "pod"),
        "external": (f'namespace="{NAMESPACE}"', "namespace"),
    }
    queries = []
    for kind, (matchers, group_by) in kinds.items():
        for rule in rules.get(kind, []):
            (series,) = re.findall(r"^[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])
            assert re.search(rule["name"]["matches"], series), rule["name"]
            query = (
                rule["metricsQuery"]
                .replace("<<.Series>>", series)
                .replace("<<.LabelMatchers>>", matchers)
                .replace("<<.GroupBy>>", group_by)
            )
            assert "<<" not in query, query
            groups = pods if group_by == "pod" else {NAMESPACE}
            queries.append(
                AdapterQuery(
                    rule["name"]["as"], rule["seriesQuery"], query, group_by, groups
                )
            )
    assert queries
    return queries


# --- The stack and its traffic ----------------------------------------------


@pytest.fixture(scope="module")
def stack(repository: Path) -> Iterator[Stack]:
    """Hybrid mode (the GPU compose file's and overlays' routing), so that
    both the batcher and the direct route carry requests; --chaos, so that
    the engine's batches can be made to fail."""
    with serving(
        Stack(
            repository,
            extra_args=["--batcher-mode", "hybrid", "--chaos"],
            env={"BERTH_BREAKER_COOLDOWN_S": "1"},
        )
    ) as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    directory = tmp_path_factory.mktemp("prometheus")
    addresses = [url.split("/")[2] for url in stack.metrics]
    metrics = dict(zip(SERVICES, addresses, strict=False))
    config = compose_scrape(metrics)
    config["scrape_configs"] += k8s_scrape(metrics, directory)
    server = Prometheus(config, directory)
    try:
        wait_until(server.ready, f"Prometheus ready:\n{server.logs()}", 60)
        yield server
    finally:
        server.stop()


def drive_traffic(stack: Stack) -> None:
    """Embeddings under concurrent load (some through the batcher, some
    straight to the engine), repeated texts (cache hits), classifications,
    invalid calls, and a spell of failing batches (answered by the CPU
    fallback) that ends with the engine answering again."""
    load = run_load_while(stack.gateway, 300, 8)
    assert load.ok_ratio == 1.0, load.summary("load")
    with grpc.insecure_channel(stack.gateway) as channel:
        berth = berth_pb2_grpc.BerthStub(channel)
        for _ in range(3):
            reply = berth.Embed(
                berth_pb2.EmbedRequest(model="minilm", texts=["hello world"]),
                timeout=20,
            )
            assert len(reply.embeddings) == 1
        labels = berth.Classify(
            berth_pb2.ClassifyRequest(model="intent", texts=["set an alarm for 7 am"]),
            timeout=20,
        )
        assert labels.results[0].labels
        for bad in (
            berth_pb2.EmbedRequest(model="minilm", texts=[]),
            berth_pb2.EmbedRequest(model="no-such-model", texts=["x"]),
        ):
            with pytest.raises(grpc.RpcError) as error:
                berth.Embed(bad, timeout=20)
            assert error.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
            )
        engine = pid_listening("engine", int(stack.engines[0].rsplit(":", 1)[1]))
        os.kill(engine, signal.SIGUSR1)  # every batch now fails
        try:
            failing = run_load_while(stack.gateway, 40, 4)
            assert failing.degraded > 0, failing.summary("failing engine")
        finally:
            os.kill(engine, signal.SIGUSR1)

        def answered_by_engine() -> bool:
            """20 calls in a row from the engine: one answer alone can be the
            circuit breaker's half-open probe, with the circuit (and the
            other gateway's view of it) still open for the rest."""
            for n in range(20):
                reply = berth.Embed(
                    berth_pb2.EmbedRequest(
                        model="minilm", texts=[f"back {time.time()} {n}"]
                    ),
                    timeout=20,
                )
                if reply.degraded:
                    return False
            return True

        wait_until(answered_by_engine, "the engine answering again", 90, 0.5)
        time.sleep(1.5)  # every gateway reads the circuits each second
    load = run_load_while(stack.gateway, 200, 8)
    assert load.ok_ratio == 1.0 and load.degraded == 0, load.summary("recovered")


def test_every_target_is_up_and_every_shipped_query_has_data(
    stack: Stack, prometheus: Prometheus
) -> None:
    def all_up() -> bool:
        targets = prometheus.targets()
        return len(targets) == 3 + 4 and all(t["health"] == "up" for t in targets)

    # 3 compose jobs, one target each; the pod job: 2 gateways, a batcher
    # and an engine.
    wait_until(all_up, "every target up", 60, 0.5)
    pods = {
        (t["labels"]["namespace"], t["labels"]["pod"], t["labels"]["app"])
        for t in prometheus.targets()
        if t["labels"]["job"] == "berth-pods"
    }
    assert {p[2] for p in pods} == {f"berth-{s}" for s in SERVICES}, pods
    assert {p[0] for p in pods} == {NAMESPACE}

    drive_traffic(stack)
    for series in (q.series for q in adapter_queries()):
        # prometheus-adapter lists its series with this call.
        found = wait_until(
            lambda series=series: prometheus.get(
                "/api/v1/series", **{"match[]": series}
            )["data"],
            f"series of {series}",
            30,
            0.5,
        )
        assert all(s["namespace"] == NAMESPACE for s in found), found

    def missing() -> dict[str, str]:
        """The queries without data now, each with its answer."""
        gaps = {}
        for title, expr in dashboard_queries():
            result = prometheus.query(expr)
            if not finite(result) and not any(m in expr for m in GPU_ONLY):
                gaps[f"{title}: {expr}"] = str(result)[:200]
        for q in adapter_queries():
            result = prometheus.query(q.query)
            groups = {s["metric"].get(q.group_by) for s in result if finite([s])}
            if groups != q.groups:
                gaps[f"adapter {q.metric}: {q.query}"] = str(result)[:200]
        return gaps

    # Rates need two scrapes after the traffic (the shipped interval, 5 s).
    deadline = time.monotonic() + 60
    while (gaps := missing()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not gaps, json.dumps(gaps, indent=1)
    for title, expr in dashboard_queries():
        values = [float(s["value"][1]) for s in prometheus.query(expr)]
        print(f"{title}: {', '.join(f'{v:.4g}' for v in values)}")


def test_gpu_only_queries_run_and_name_their_metric(prometheus: Prometheus) -> None:
    """The GPU panels are exempt from having data, not from running."""
    queries = [expr for _, expr in dashboard_queries()]
    for metric in GPU_ONLY:
        named = [q for q in queries if metric in q]
        assert named, f"{metric} is in GPU_ONLY but no dashboard query uses it"
        for expr in named:
            prometheus.query(expr)
