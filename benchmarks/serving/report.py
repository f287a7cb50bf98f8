"""What the end-to-end benchmark prints and writes: the steps' table, each
profile's result against the offline baseline (saying which baseline: one
given on the command line is labelled as given on every line that quotes
it), and the JSON document written with --out."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from benchmarks.serving.load import Step
from benchmarks.serving.offline import (
    GIVEN_NOTE,
    MEASURED_NOTE,
    baseline_label,
    ratio_name,
)
from benchmarks.serving.stack import Profile


def table(steps: list[Step]) -> str:
    head = (
        f"{'step':<12}{'rate/s':>8}{'sent':>6}{'ok':>6}{'shed':>6}{'err':>5}"
        f"{'tput/s':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'lag99':>8}"
        "  cpu s: engine/batcher/gateway(busiest)/clients"
    )
    lines = [head, "-" * len(head)]
    for s in steps:
        c = s.cpu_s
        cpu = (
            f"{c.get('engine', 0.0):.1f}/{c.get('batcher', 0.0):.1f}/"
            f"{c.get('gateway', 0.0):.1f}({c.get('gateway_busiest', 0.0):.1f})/"
            f"{c.get('clients', 0.0):.1f}"
        )
        lines.append(
            f"{s.name:<12}{s.rate:>8.1f}{s.sent:>6}{s.ok:>6}{s.shed:>6}{s.errors:>5}"
            f"{s.throughput:>8.1f}{s.p50_ms:>9.2f}{s.p90_ms:>9.2f}{s.p99_ms:>9.2f}"
            f"{s.send_lag_p99_ms:>8.2f}  {cpu}"
        )
    return "\n".join(lines)


def table_row(step: Step) -> str:
    """The step's line of the table, printed as each step ends."""
    return table([step]).splitlines()[-1]


def rates_about(rps: str | None, rates: str, base: dict[str, Any]) -> str:
    """What the rate steps are: --rps's, or --rates's fractions of ``base``."""
    if rps:
        return f"rate steps in requests/s (--rps {rps})"
    return f"rate steps {rates} x the offline throughput: {baseline_label(base)}"


def profile_result(
    profile: Profile, steps: list[Step], base: dict[str, Any]
) -> dict[str, Any]:
    """One profile's steps, its best clean throughput and that over the
    baseline, saying which baseline."""
    clean = [s for s in steps[:-1] if s.ok and (s.shed + s.errors) <= 0.01 * s.sent]
    best = max((s.throughput for s in clean), default=0.0)
    return {
        "profile": asdict(profile),
        "steps": [asdict(s) for s in steps],
        "served_best_throughput": best,
        "served_over_offline": round(best / base["throughput"], 3),
        "served_over_offline_against": baseline_label(base),
    }


def report(base: dict[str, Any], results: dict[str, Any], api: str, rates: str) -> str:
    """The summary printed at the end: the baseline, then each profile's
    table and its ratio, each saying which baseline it is against."""
    lines = [f"\noffline baseline: {baseline_label(base)}", rates]
    for name, result in results.items():
        steps = [Step(**s) for s in result["steps"]]
        hit, first = steps[-1], steps[0]
        profile = result["profile"]
        about = profile["about"] + "".join(
            f" {key}={value}"
            for key in ("engines", "gateways", "batchers", "buckets")
            if (value := profile[key])
        )
        settings = " ".join(f"{k}={v}" for k, v in profile["env"].items())
        lines.append(f"\n== {name}: {about}{' ' + settings if settings else ''}")
        lines.append(table(steps))
        lines.append(
            f"served single-text requests ({api}): "
            f"{result['served_best_throughput']:.1f} "
            f"texts/s (best step with <= 1% shed+errors); {ratio_name(base)} = "
            f"{result['served_over_offline']:.2f}, against {baseline_label(base)}"
        )
        lines.append(
            f"cache hit path at {hit.rate:.0f} req/s: p50 {hit.p50_ms:.2f} ms, "
            f"p99 {hit.p99_ms:.2f} ms (from the actual send: p50 "
            f"{hit.p50_from_send_ms:.2f}, p99 {hit.p99_from_send_ms:.2f}); misses "
            f"at that rate: p50 {first.p50_ms:.2f} ms, p99 {first.p99_ms:.2f} ms"
        )
    return "\n".join(lines)


def document(
    base: dict[str, Any], results: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """The JSON written with --out: ``fields`` (machine, command, ...), the
    baseline and whether it was given, and the profiles' results."""
    return {
        "benchmark": "benchmarks/e2e.py",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **fields,
        "baseline_given": bool(base.get("given")),
        "baseline_note": GIVEN_NOTE if base.get("given") else MEASURED_NOTE,
        "offline": base,
        "profiles": results,
    }
