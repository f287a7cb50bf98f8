"""What TLS costs on berth's public port, against plaintext in the same run.

    python benchmarks/tls.py                      # start the stacks, run, print
    python benchmarks/tls.py --out benchmarks/results/tls_cpu.json

Certificates are made in the run into a temporary folder (--key: ECDSA P-256,
the default, or RSA 2048; a CA, the gateway's certificate for 127.0.0.1, a
client's). Then a `berth serve` per mode (--modes) is started as shipped
(the e2e benchmark's stock profile), one after another, and all are kept
running to the end:

- plaintext: no TLS;
- tls: --tls-cert/--tls-key, the clients trust the CA;
- mtls: --tls-client-ca too, the clients present their certificate.

The modes are measured in turn, one at a time, in --rounds rounds: the
first in --modes order, the next reversed, and so on (A B C, C B A), so
that a machine whose speed drifts during the run (other work on it, clock
changes) weighs on every mode alike. In each round, on each stack:

1. connection setup: --handshakes fresh channels, one after another, each
   timed from its creation to the answer of its first call (a health
   Check), against the same call on a channel already connected; their
   difference is what setting up a connection costs (TCP, plus the TLS
   handshake where there is one). The gateway's CPU per new connection is
   read from /proc.
2. capacity: a closed loop, --probe-concurrency single-text Embed calls in
   flight from one client process, for --probe-s seconds (the first round
   after --warmup-s unmeasured: a new stack's first batches of each shape
   are slow): texts/s.
3. then, step by step, each mode in turn: open-loop steps as
   benchmarks/e2e.py's served phase (its load generator,
   benchmarks/serving/): single-text calls arrive as a Poisson process at
   each rate, latency counted from the scheduled send. The rates are
   --rates fractions of the first round's plaintext capacity, or --rps. The
   lowest step is the low-load one.

Every mode is sent the same texts at the same times; every text is distinct
(each round sends new ones), so the response cache never answers. A mode's
figures are the mean over the rounds (each round's are in the JSON and the
tables show them side by side: their spread is the run's own noise); ratios
are each mode's mean over plaintext's. The clients run on the same machine
as the stacks, so their TLS work is taken from it too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file: import berth's packages, not benchmarks/'s
    sys.path[0] = str(ROOT)

from benchmarks.serving.certs import KEYS, MODES, Pki, make_pki  # noqa: E402
from benchmarks.serving.load import ClientTls, Plan, Step  # noqa: E402
from benchmarks.serving.probes import (  # noqa: E402
    ClosedLoop,
    capacity,
    connection_setup,
)
from benchmarks.serving.report import table_row  # noqa: E402
from benchmarks.serving.stack import Profile, Target, machine, target  # noqa: E402
from benchmarks.serving.steps import clients_for, run_step  # noqa: E402
from benchmarks.serving.workload import make_texts, text_mix  # noqa: E402

PERCENTILES = ("p50_ms", "p90_ms", "p99_ms")
# Each mode's stack and what a client dials it with (None: plaintext).
Running = dict[str, tuple[Target, ClientTls | None]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="minilm", help="embedding model to call")
    parser.add_argument(
        "--model-repository",
        default=os.environ.get(
            "BERTH_MODEL_REPOSITORY", str(ROOT / "model_repository")
        ),
    )
    parser.add_argument(
        "--modes",
        default="plaintext,tls,mtls",
        help=f"of {', '.join(MODES)}, each once, plaintext among them; the "
        "first round's order",
    )
    parser.add_argument("--rounds", type=int, default=2, help="each mode's turns")
    parser.add_argument("--key", choices=tuple(KEYS), default="ecdsa")
    parser.add_argument(
        "--rates",
        default="0.1,0.5,0.75,0.9",
        help="rate steps as fractions of the plaintext capacity",
    )
    parser.add_argument("--rps", help="rate steps in requests/s (overrides --rates)")
    parser.add_argument("--duration", type=float, default=8.0, help="s per step")
    parser.add_argument("--max-requests", type=int, default=3000, help="per step")
    parser.add_argument(
        "--clients", type=int, default=0, help="client processes (0: as e2e.py)"
    )
    parser.add_argument("--connections", type=int, default=4, help="per client")
    parser.add_argument("--api", choices=("unary", "stream"), default="unary")
    parser.add_argument("--deadline-s", type=float, default=10.0, help="per call")
    parser.add_argument("--handshakes", type=int, default=200, help="fresh channels")
    parser.add_argument("--probe-s", type=float, default=5.0, help="capacity probe")
    parser.add_argument(
        "--warmup-s", type=float, default=3.0, help="closed loop before the first"
    )
    parser.add_argument("--probe-concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.mode_list = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.mode_list if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; use {', '.join(MODES)}")
    if "plaintext" not in args.mode_list:
        parser.error("--modes must include plaintext: the ratios are against it")
    if len(set(args.mode_list)) != len(args.mode_list):
        parser.error("--modes names each mode once (--rounds repeats them)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def step_names(args: argparse.Namespace) -> list[str]:
    if args.rps:
        return [f"{float(r):g}/s" for r in args.rps.split(",")]
    return [f"{float(f):g}x" for f in args.rates.split(",")]


@contextlib.contextmanager
def stacks(args: argparse.Namespace, pki: Pki) -> Iterator[Running]:
    """A `berth serve` per mode, started one after another; all stopped
    after, however the block ends."""
    with contextlib.ExitStack() as started:
        out: Running = {}
        for mode in args.mode_list:
            tls, flags = pki.client(mode), pki.serve_args(mode)
            print(f"\n== {mode}: starting `berth serve` ({MODES[mode]})", flush=True)
            to = started.enter_context(
                target(
                    Profile(mode, MODES[mode], serve_args=flags),
                    Path(args.model_repository),
                    None,
                    "",
                    tls.credentials() if tls else None,
                )
            )
            print(f"  {mode}: serving on {to.address} (pid {to.pid})", flush=True)
            out[mode] = (to, tls)
        yield out


def probe_round(
    r: int,
    order: list[str],
    running: Running,
    args: argparse.Namespace,
    pool: list[str],
) -> dict[str, dict[str, Any]]:
    """Steps 1 and 2 of round ``r`` on each stack, in ``order``."""
    out = {}
    for mode in order:
        to, tls = running[mode]
        print(f"  {mode}: connection setup, {args.handshakes} channels", flush=True)
        setup = connection_setup(to, tls, args.handshakes)
        print(f"  {mode}: {json.dumps(setup)}", flush=True)
        loop = ClosedLoop(
            args.model,
            args.probe_s,
            args.warmup_s if r == 0 else 0.0,
            args.probe_concurrency,
            args.connections,
            args.deadline_s,
            tag=f"r{r}-",
        )
        print(
            f"  {mode}: capacity, closed loop ({loop.warmup_s} s unmeasured, "
            f"{loop.seconds} s measured)",
            flush=True,
        )
        cap = capacity(to.address, tls, pool, loop)
        print(f"  {mode}: {json.dumps(cap)}", flush=True)
        out[mode] = {"connection_setup": setup, "capacity": cap}
    return out


def step_round(
    r: int,
    order: list[str],
    running: Running,
    args: argparse.Namespace,
    pool: list[str],
    rates: list[float],
) -> dict[str, list[Step]]:
    """Step 3 of round ``r``: each rate, each mode in ``order``; the same
    texts (new in each round) and arrival times for every mode."""
    out: dict[str, list[Step]] = {mode: [] for mode in order}
    names = step_names(args)
    for i, (name, rate) in enumerate(zip(names, rates, strict=True)):
        n = min(args.max_requests, max(1, round(rate * args.duration)))
        first = (r * len(rates) + i) * args.max_requests
        for mode in order:
            to, tls = running[mode]
            load = Plan(
                to.address,
                args.model,
                pool[first : first + n],
                [],
                args.deadline_s,
                connections=args.connections,
                api=args.api,
                tls=tls,
            )
            print(f"  {mode}: step {name}, {rate:.1f} req/s, {n} texts", flush=True)
            step = run_step(name, load, rate, clients_for(rate, args.clients), i, to)
            print(f"{mode:<10}{table_row(step)}", flush=True)
            out[mode].append(step)
    return out


def _mean(values: list[float]) -> float:
    return round(float(np.mean(values)), 3)


def combine(
    probes: list[dict[str, dict[str, Any]]],
    steps: list[dict[str, list[Step]]],
    rates: list[float],
) -> dict[str, Any]:
    """Each mode's figures: the mean over the rounds, each round's kept."""
    modes = {}
    for mode in probes[0]:
        setups = [p[mode]["connection_setup"] for p in probes]
        caps = [p[mode]["capacity"] for p in probes]
        rows = []
        for i, name in enumerate(s.name for s in steps[0][mode]):
            turns = [round_steps[mode][i] for round_steps in steps]
            rows.append(
                {
                    "name": name,
                    "rate": round(rates[i], 1),
                    **{
                        k: sum(getattr(t, k) for t in turns)
                        for k in ("sent", "ok", "shed", "errors")
                    },
                    **{
                        k: _mean([getattr(t, k) for t in turns])
                        for k in ("throughput", *PERCENTILES)
                    },
                    "by_round": [asdict(t) for t in turns],
                }
            )
        modes[mode] = {
            "about": MODES[mode],
            "connection_setup": {
                k: _mean([s[k] for s in setups]) for k in setups[0] if k != "channels"
            }
            | {"channels": setups[0]["channels"], "by_round": setups},
            "capacity": {
                "throughput": _mean([c["throughput"] for c in caps]),
                "by_round": caps,
            },
            "steps": rows,
            "cpu_ms_per_request": cpu_per_request([r[mode] for r in steps]),
        }
    return modes


def cpu_per_request(turns: list[list[Step]]) -> dict[str, float]:
    """CPU ms each role used per answered request, over all of a mode's
    open-loop steps (the clients' TLS work included in theirs)."""
    every = [step for steps in turns for step in steps]
    answered = sum(step.ok for step in every)
    return {
        role: round(1000 * sum(s.cpu_s.get(role, 0.0) for s in every) / answered, 3)
        if answered
        else 0.0
        for role in ("gateway", "clients", "batcher", "engine")
    }


def _over(value: float, base: float) -> float | None:
    return round(value / base, 3) if base > 0 else None


def ratios(modes: dict[str, Any]) -> dict[str, Any]:
    """Each mode's means over plaintext's: connection setup, capacity, and
    each step's throughput and latency percentiles."""
    base = modes["plaintext"]
    out = {}
    for name, mode in modes.items():
        if name == "plaintext":
            continue
        setup, base_setup = mode["connection_setup"], base["connection_setup"]
        out[name] = {
            "first_call_p50": _over(
                setup["first_call_p50_ms"], base_setup["first_call_p50_ms"]
            ),
            "setup": _over(setup["setup_ms"], base_setup["setup_ms"]),
            "gateway_cpu_per_connection": _over(
                setup["gateway_cpu_ms_per_connection"],
                base_setup["gateway_cpu_ms_per_connection"],
            ),
            "capacity": _over(
                mode["capacity"]["throughput"], base["capacity"]["throughput"]
            ),
            **{
                f"{role}_cpu_per_request": _over(
                    mode["cpu_ms_per_request"][role], base["cpu_ms_per_request"][role]
                )
                for role in ("gateway", "clients")
            },
            "steps": {
                s["name"]: {
                    key: _over(s[key], b[key]) for key in ("throughput", *PERCENTILES)
                }
                for s, b in zip(mode["steps"], base["steps"], strict=True)
            },
        }
    return out


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _by_round(values: list[dict[str, Any]], key: str, digits: int) -> str:
    return "/".join(f"{v[key]:.{digits}f}" for v in values)


def report(modes: dict[str, Any], over: dict[str, Any]) -> str:
    """Two tables of the means over the rounds: connection setup and
    capacity per mode; every step per mode, with its ratios against
    plaintext's same step. "by round": each round's figure."""
    head = (
        f"{'mode':<10}{'first call':>11}{'connected':>10}{'setup':>7}"
        f"{'gw/conn':>8}{'gw/req':>8}{'capacity/s':>11}  {'by round':<10}"
        "x plaintext: setup/gw per conn/gw per req/capacity"
    )
    lines = [
        "",
        "connection setup (p50 ms: a fresh channel to its first answer, a call on "
        "a connected one, the difference), the gateway's CPU ms per connection and "
        "per request (the open-loop steps'), closed-loop capacity",
        head,
        "-" * len(head),
    ]
    keys = ("setup", "gateway_cpu_per_connection", "gateway_cpu_per_request")
    for name, mode in modes.items():
        s, c = mode["connection_setup"], mode["capacity"]
        r = over.get(name)
        ratio = "/".join(_x(r[k]) for k in (*keys, "capacity")) if r else ""
        lines.append(
            f"{name:<10}{s['first_call_p50_ms']:>11.2f}"
            f"{s['connected_call_p50_ms']:>10.2f}{s['setup_ms']:>7.2f}"
            f"{s['gateway_cpu_ms_per_connection']:>8.2f}"
            f"{mode['cpu_ms_per_request']['gateway']:>8.2f}{c['throughput']:>11.1f}  "
            f"{_by_round(c['by_round'], 'throughput', 0):<10}{ratio}"
        )
    head = (
        f"{'mode':<10}{'step':<7}{'rate/s':>7}{'sent':>6}{'err':>5}{'tput/s':>8}"
        f"{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}  {'p50 by round':<14}"
        "x plaintext: tput/p50/p90/p99"
    )
    lines += ["", "open-loop steps (the lowest: low load)", head, "-" * len(head)]
    for name, mode in modes.items():
        for s in mode["steps"]:
            r = over.get(name, {}).get("steps", {}).get(s["name"])
            ratio = (
                "/".join(_x(r[k]) for k in ("throughput", *PERCENTILES)) if r else ""
            )
            lines.append(
                f"{name:<10}{s['name']:<7}{s['rate']:>7.1f}{s['sent']:>6}"
                f"{s['shed'] + s['errors']:>5}{s['throughput']:>8.1f}"
                f"{s['p50_ms']:>8.2f}{s['p90_ms']:>8.2f}{s['p99_ms']:>8.2f}  "
                f"{_by_round(s['by_round'], 'p50_ms', 1):<14}{ratio}"
            )
    return "\n".join(lines)


def measure(
    args: argparse.Namespace, pool: list[str]
) -> tuple[dict[str, Any], list[float]]:
    """Every mode's stack, measured round by round: the modes' figures and
    the rates the steps ran at."""
    rates = [float(r) for r in args.rps.split(",")] if args.rps else []
    probes, steps = [], []
    with tempfile.TemporaryDirectory(prefix="berth-tls-bench-") as folder:
        pki = make_pki(Path(folder), args.key)
        print(f"certificates: {pki.about}", flush=True)
        with stacks(args, pki) as running:
            for r in range(args.rounds):
                order = args.mode_list[:: 1 if r % 2 == 0 else -1]
                load_average = [round(x, 2) for x in os.getloadavg()]
                print(
                    f"\n== round {r + 1} of {args.rounds}: {', '.join(order)}; "
                    f"load average {load_average}",
                    flush=True,
                )
                probes.append(probe_round(r, order, running, args, pool))
                if not rates:
                    plain = probes[0]["plaintext"]["capacity"]["throughput"]
                    rates = [float(f) * plain for f in args.rates.split(",")]
                steps.append(step_round(r, order, running, args, pool, rates))
    return combine(probes, steps, rates), rates


def main() -> int:
    args = parse_args()
    from services.repository import load_repository

    repository = Path(args.model_repository)
    if not (repository / args.model / "berth.json").exists():
        from services.cli.default_models import build_default_repository

        build_default_repository(repository)
    entry = load_repository(repository)[args.model]
    pool = make_texts(
        args.rounds * len(step_names(args)) * args.max_requests, args.seed
    )
    mix = text_mix(pool, entry.tokenizer_file)
    info = machine()
    print(f"machine: {info}", flush=True)
    print(f"text mix: {mix}", flush=True)
    modes, rates = measure(args, pool)
    over = ratios(modes)
    print(report(modes, over))
    if args.out:
        plain = modes["plaintext"]["capacity"]["by_round"][0]["throughput"]
        out = {
            "benchmark": "benchmarks/tls.py",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python", *sys.argv]),
            "machine": info
            | {"load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
            "model": args.model,
            "api": f"berth.v1.Berth/{'Embed' if args.api == 'unary' else 'Stream'}, "
            f"one text per request, {args.connections} connections per client",
            "certificates": f"{KEYS[args.key]} keys, SHA-256 signatures, one CA",
            "rounds": args.rounds,
            "order": f"{args.modes}, reversed in every other round",
            "rates": f"rate steps in requests/s (--rps {args.rps})"
            if args.rps
            else f"rate steps {args.rates} x the first round's plaintext "
            f"capacity, {plain:.1f} texts/s: {[round(r, 1) for r in rates]}",
            "text_mix": mix,
            "modes": modes,
            "ratios_over_plaintext": over,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
