"""The stack the end-to-end benchmark measures, and what it reads from it.

Which stacks there are (Profile, PROFILES), starting one (or taking the
address of one already running) and stopping it, and the readings each step
takes before and after: CPU seconds of `berth serve`'s children by role, and
the services' own /metrics (batches, device time, queue wait). Also what
machine the run is on.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import platform
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.machine import cpu_model

if TYPE_CHECKING:  # imported where used: `e2e.py --help` needs no grpc
    import grpc

    from tests.stack import Stack


@dataclass
class Profile:
    """One way to start the stack: engines, length buckets, BERTH_* settings."""

    name: str
    about: str
    engines: int = 0  # 0: `berth serve`'s default (1 per GPU, else 1)
    gateways: int = 0  # 0: `berth serve`'s default
    batchers: int = 0  # 0: `berth serve`'s default
    buckets: list[int] | None = None  # None: the repository's own
    env: dict[str, str] = field(default_factory=dict)
    # Gateways also on ports of their own, the load's connections spread
    # over those (connection_targets) instead of sent to the shared port.
    spread: bool = False
    # More `berth serve` flags, e.g. ["--batcher-mode", "inline"].
    serve_args: list[str] = field(default_factory=list)


PROFILES = {
    "stock": Profile(
        "stock",
        "`berth serve` as shipped (CPU: 1 engine per core, 1 gateway; "
        "GPU: 1 engine per GPU, 5 gateways per 8 cores, 1 batcher per 4 gateways, "
        "hybrid batching)",
    ),
    "spread": Profile(
        "spread",
        "as stock, with each gateway also on a port of its own "
        "(--gateway-own-port) and the load's connections spread evenly over "
        "those, as a caller that balances its connections does",
        spread=True,
    ),
    "hybrid": Profile(
        "hybrid",
        "as spread, with `--batcher-mode hybrid` (the GPU default): through the "
        "batchers, but a request that finds its gateway idle goes straight to "
        "the engines",
        spread=True,
        serve_args=["--batcher-mode", "hybrid"],
    ),
    "service": Profile(
        "service",
        "as spread, with `--batcher-mode service` (the CPU default): every "
        "request through the batchers",
        spread=True,
        serve_args=["--batcher-mode", "service"],
    ),
}


@dataclass
class Target:
    """Where the load goes: the gateways' shared address, their own ones
    (to spread connections over), their /metrics pages and the pid of
    `berth serve` (none of these two for a stack not started here)."""

    address: str
    spread: list[str]
    metrics: list[str] = field(default_factory=list)
    pid: int | None = None


@contextlib.contextmanager
def running(
    stack: Stack,
    timeout: float = 180.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[Stack]:
    """``stack`` once its gateway serves (asked with ``credentials`` where
    its public port takes TLS only); stopped after, however the block
    ends."""
    try:
        stack.wait_serving(timeout, credentials)
        yield stack
    finally:
        stack.stop()


@contextlib.contextmanager
def target(
    profile: Profile,
    repository: Path,
    address: str | None,
    spread_over: str,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[Target]:
    """The gateway at ``address`` (its own ones listed in ``spread_over``,
    comma-separated), or else a stack started as ``profile`` says, serving
    ``repository``, stopped after. ``credentials``: what a client dials a
    stack with TLS on its public port with (``profile.serve_args`` has the
    --tls-* flags)."""
    if address is not None:
        yield Target(address, [a for a in spread_over.split(",") if a])
        return
    with running(start(profile, repository), credentials=credentials) as stack:
        yield Target(stack.gateway, stack.own_gateways, stack.metrics, stack.proc.pid)


def start(profile: Profile, repository: Path) -> Stack:
    """`berth serve` as ``profile`` says; what it leaves at 0, `berth
    serve`'s defaults for this machine."""
    import torch

    from services.cli.topology import (
        default_batchers,
        default_engines,
        default_gateways,
    )
    from tests.stack import Stack

    served = repository
    if profile.buckets:
        into = Path(tempfile.mkdtemp(prefix="berth-bench-"))
        served = rebucketed(repository, profile.buckets, into)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gateways = profile.gateways or default_gateways(gpus)
    return Stack(
        served,
        engines=profile.engines or default_engines(gpus),
        env=profile.env,
        gateways=gateways,
        batchers=profile.batchers or default_batchers(gateways),
        own_ports=profile.spread,
        extra_args=profile.serve_args,
    )


def rebucketed(repository: Path, buckets: list[int], into: Path) -> Path:
    """A copy of the repository with other length buckets, on CPUs and GPUs
    alike (files linked)."""
    from services.repository import load_repository

    for name, entry in load_repository(repository).items():
        source, target = Path(entry.root), into / name
        target.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.name != "berth.json":
                (target / path.name).symlink_to(path.resolve())
        entry.checkpoint = str(entry.checkpoint_dir)
        entry.buckets = entry.gpu_buckets = buckets
        (target / "berth.json").write_text(entry.to_json())
    return into


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


# ---- CPU --------------------------------------------------------------------


def server_cpu(supervisor_pid: int | None) -> dict[tuple[str, int], float]:
    """CPU seconds used so far by each child of `berth serve`: (role, pid)."""
    if supervisor_pid is None:
        return {}
    from tests.stack import children

    return {
        (argv[2] if len(argv) > 2 else "?", pid): cpu  # python -m ROLE
        for pid, (argv, cpu) in children(supervisor_pid).items()
    }


def cpu_by_role(
    before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]
) -> dict[str, float]:
    """CPU seconds each role used between two server_cpu readings, and the
    busiest gateway process's own ("gateway_busiest"): gateways share the
    port by the kernel's hash of each connection, so with few connections
    one can be saturated while others idle."""
    out: dict[str, float] = {}
    for (role, pid), seconds in after.items():
        used = seconds - before.get((role, pid), 0.0)
        out[role] = round(out.get(role, 0.0) + used, 2)
        if role == "gateway":
            busiest = max(out.get("gateway_busiest", 0.0), used)
            out["gateway_busiest"] = round(busiest, 2)
    return out


# ---- /metrics ---------------------------------------------------------------

# (metric, label filter) summed over every process; each step reports the
# difference between a reading before it and one after.
READINGS = {
    "gpu_s": ("berth_engine_stage_seconds_sum", {"stage": "compute"}),
    "engine_batches": ("berth_engine_stage_seconds_count", {"stage": "compute"}),
    "rows": ("berth_batcher_batch_size_sum", {}),
    "batches": ("berth_batcher_batch_size_count", {}),
    "queue_wait_s": ("berth_batcher_queue_wait_seconds_sum", {}),
    "queued": ("berth_batcher_queue_wait_seconds_count", {}),
    "batch_latency_s": ("berth_batcher_batch_latency_seconds_sum", {}),
    "answered": ("berth_batcher_batch_latency_seconds_count", {}),
    "gateway_inference_s": ("berth_gateway_stage_seconds_sum", {"stage": "inference"}),
    "gateway_total_s": ("berth_gateway_stage_seconds_sum", {"stage": "total"}),
    "gateway_requests": ("berth_gateway_stage_seconds_count", {"stage": "total"}),
}


def metrics_page(url: str) -> str | None:
    """The text of a service's /metrics page; None where it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=5) as page:
            return page.read().decode()
    except (OSError, ValueError, http.client.HTTPException):
        return None


# Each page's READINGS, by URL.
Pages = dict[str, dict[str, float]]


def read_metrics(urls: list[str]) -> Pages:
    """READINGS summed over each service's /metrics page, by URL (and per
    bucket for the batchers' rows and batches: "rows@32", "batches@32"); a
    page that could not be read or parsed is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    pages: Pages = {}
    for url in urls:
        if (text := metrics_page(url)) is None:
            continue
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        out: dict[str, float] = {}
        for family in families:
            for sample in family.samples:
                for key, (name, labels) in READINGS.items():
                    if sample.name != name or any(
                        sample.labels.get(k) != v for k, v in labels.items()
                    ):
                        continue
                    out[key] = out.get(key, 0.0) + sample.value
                    bucket = sample.labels.get("bucket")
                    if bucket and key in ("rows", "batches"):
                        out[f"{key}@{bucket}"] = (
                            out.get(f"{key}@{bucket}", 0.0) + sample.value
                        )
        pages[url] = out
    return pages


def pipeline(before: Pages, after: Pages, wall_s: float) -> dict[str, Any]:
    """What the stack did in one step: batches and their rows (per length
    bucket), the share of the step an engine's device spent computing (the
    engines' event-timed compute stage, averaged over the engines that
    computed), mean queue wait and batch latency.

    Only pages read both times count; a page whose counters went down is a
    process restarted during the step, whose whole reading is the step's."""
    d: dict[str, float] = {}
    engines = 0
    for url, now in after.items():
        if url not in before:
            continue
        engines += "engine_batches" in now
        then = before[url]
        if any(now.get(k, 0.0) < v for k, v in then.items()):
            then = {}
        for k, v in now.items():
            d[k] = d.get(k, 0.0) + v - then.get(k, 0.0)
    if not d.get("batches"):
        return {}

    def mean_ms(total: str, count: str) -> float:
        return round(1000 * d.get(total, 0.0) / d[count], 3) if d.get(count) else 0.0

    buckets = sorted(int(k.split("@")[1]) for k in d if k.startswith("batches@"))
    return {
        "batches": int(d["batches"]),
        "rows_per_batch": round(d["rows"] / d["batches"], 2),
        "gpu_busy": (
            round(d.get("gpu_s", 0.0) / wall_s / max(1, engines), 3)
            if wall_s > 0
            else 0.0
        ),
        "gpu_ms_per_batch": mean_ms("gpu_s", "engine_batches"),
        "queue_wait_ms": mean_ms("queue_wait_s", "queued"),
        "batch_latency_ms": mean_ms("batch_latency_s", "answered"),
        "gateway_inference_ms": mean_ms("gateway_inference_s", "gateway_requests"),
        "gateway_total_ms": mean_ms("gateway_total_s", "gateway_requests"),
        "by_bucket": {
            b: {
                "batches": int(d[f"batches@{b}"]),
                "rows_per_batch": round(d[f"rows@{b}"] / d[f"batches@{b}"], 2),
            }
            for b in buckets
            if d.get(f"batches@{b}")
        },
    }
