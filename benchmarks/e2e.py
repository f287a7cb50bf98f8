"""End to end: open-loop load over berth's API against offline batching.

    python benchmarks/e2e.py                      # start a stack, run, print
    python benchmarks/e2e.py --out benchmarks/results/e2e_cpu.json

Phases, in one run:

1. offline: the ceiling a user gets with no server at all. The same texts
   the served phase sends, encoded in this process by sentence-transformers
   (``encode``, batched, sorted by length as it does) on the same model.
2. served: `berth serve` on loopback (or --address), driven open-loop:
   single-text Embed calls arrive as a Poisson process at each rate step,
   whatever the answers do, from --clients processes (each a Poisson
   stream of rate/clients). Latency is counted from the scheduled send
   time, so a late client cannot hide queueing (no coordinated omission).
   Every served text is distinct, so the response cache never helps here.
3. cache: texts already served are sent again at one rate: every call is
   a hit that never reaches the batcher; its latency is the hit path.

Rates are given as fractions of the offline throughput (--rates) or in
requests per second (--rps). Each step is bounded by --duration seconds
and --max-requests calls. Texts are a realistic mix: mostly short
assistant-style queries, a long tail of paragraphs (lognormal lengths).

The offline baseline is measured in the run (phase 1) unless
--offline-throughput gives one. A given baseline is labelled as given
wherever it appears: in the JSON ("offline": {"source": "given", ...},
"baseline_given": true, "baseline_note", each profile's
"served_over_offline_against") and on every printed line that quotes it
or a ratio against it ("served/given baseline = ...").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file: import berth's packages, not benchmarks/'s
    sys.path[0] = str(ROOT)

from benchmarks.serving.offline import baseline, baseline_label  # noqa: E402
from benchmarks.serving.report import (  # noqa: E402
    document,
    profile_result,
    rates_about,
    report,
)
from benchmarks.serving.stack import PROFILES, Profile, machine  # noqa: E402
from benchmarks.serving.steps import serve_and_measure  # noqa: E402
from benchmarks.serving.workload import make_texts, text_mix  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _stack_args(parser)
    _load_args(parser)
    _custom_args(parser)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.offline_throughput is not None and args.offline_throughput <= 0:
        parser.error("--offline-throughput must be positive")
    return args


def _stack_args(parser: argparse.ArgumentParser) -> None:
    """What to measure: a running gateway, or the stacks to start."""
    parser.add_argument("--address", help="a running gateway (default: start one)")
    parser.add_argument(
        "--spread-over",
        default="",
        help="with --address: the gateways' own addresses (host:port,...; "
        "`berth serve --gateway-own-port`), to spread the connections over",
    )
    parser.add_argument("--model", default="minilm", help="embedding model to call")
    parser.add_argument(
        "--model-repository",
        default=os.environ.get(
            "BERTH_MODEL_REPOSITORY", str(ROOT / "model_repository")
        ),
    )
    parser.add_argument(
        "--profiles",
        default="stock",
        help=f"stacks to start and measure, of {', '.join(PROFILES)}",
    )
    parser.add_argument(
        "--rates",
        default="0.5,0.75,0.9,1.0,1.1",
        help="rate steps as fractions of the offline throughput",
    )


def _load_args(parser: argparse.ArgumentParser) -> None:
    """The rate steps, the load generator and the offline baseline."""
    parser.add_argument("--rps", help="rate steps in requests/s (overrides --rates)")
    parser.add_argument("--duration", type=float, default=10.0, help="s per step")
    parser.add_argument("--max-requests", type=int, default=2000, help="per step")
    parser.add_argument(
        "--clients",
        type=int,
        default=0,
        help="client processes (0: 1 per 2500 rps, at most 1 per 4 cores)",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=4,
        help="connections per client process, used in turn (the cache step: 1)",
    )
    parser.add_argument(
        "--api",
        choices=("unary", "stream"),
        default="unary",
        help="single-text Embed calls, or single-text requests on one Stream per "
        "connection (berth's API for high-rate callers)",
    )
    parser.add_argument("--deadline-s", type=float, default=10.0, help="per call")
    parser.add_argument("--batch-size", type=int, default=32, help="offline batch")
    parser.add_argument(
        "--offline-texts",
        type=int,
        default=20000,
        help="texts encoded offline (the first of the served ones)",
    )
    parser.add_argument(
        "--offline-throughput",
        type=float,
        help="skip phase 1 and use this texts/s as the baseline (quick tuning "
        "runs only); the results then say the baseline was given, not measured",
    )


def _custom_args(parser: argparse.ArgumentParser) -> None:
    custom = parser.add_argument_group(
        "a custom profile (measured as 'custom' when any of these is given)"
    )
    custom.add_argument("--engines", type=int, help="engine processes")
    custom.add_argument("--gateways", type=int, help="gateway processes")
    custom.add_argument("--batchers", type=int, help="batcher processes")
    custom.add_argument(
        "--buckets",
        help="length buckets, e.g. 16,32,48,64,512; several sets separated by / "
        "are measured one after another",
    )
    custom.add_argument(
        "--serve-args",
        default="",
        help='more `berth serve` flags, e.g. "--batcher-mode inline --idle-cpus spin"',
    )
    custom.add_argument(
        "--own-ports",
        action="store_true",
        help="connections spread over the gateways' own ports, as the spread profile",
    )
    custom.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="BERTH_X=V",
        help="settings for the stack, e.g. BERTH_MAX_DELAY_MS=2 (repeatable)",
    )


def profiles_of(args: argparse.Namespace) -> list[Profile]:
    if args.address:
        over = (
            f", connections spread over {args.spread_over}" if args.spread_over else ""
        )
        return [Profile("external", f"the gateway at {args.address}{over}")]
    chosen = []
    for name in filter(None, args.profiles.split(",")):
        if name not in PROFILES:
            raise SystemExit(f"unknown profile {name!r}; use {', '.join(PROFILES)}")
        chosen.append(PROFILES[name])
    if (
        args.engines
        or args.gateways
        or args.batchers
        or args.buckets
        or args.env
        or args.own_ports
        or args.serve_args
    ):
        # One custom profile per bucket set ("32,128,512/16,32,64,512": two).
        for buckets in (args.buckets or "").split("/"):
            chosen.append(
                Profile(
                    f"custom {buckets or 'default'}"
                    if "/" in (args.buckets or "")
                    else "custom",
                    "from --engines/--gateways/--batchers/--buckets/--env",
                    engines=args.engines or 0,
                    gateways=args.gateways or 0,
                    batchers=args.batchers or 0,
                    buckets=[int(b) for b in buckets.split(",")] if buckets else None,
                    env=dict(kv.split("=", 1) for kv in args.env),
                    spread=args.own_ports,
                    serve_args=args.serve_args.split(),
                )
            )
    return chosen


def main() -> int:
    args = parse_args()
    from services.repository import load_repository

    repository = Path(args.model_repository)
    if not (repository / args.model / "berth.json").exists():
        from services.cli.default_models import build_default_repository

        build_default_repository(repository)
    entry = load_repository(repository)[args.model]
    profiles = profiles_of(args)
    fractions = [float(r) for r in args.rates.split(",")]
    steps_n = len(args.rps.split(",")) if args.rps else len(fractions)
    pool = make_texts(steps_n * args.max_requests, args.seed)
    mix = text_mix(pool, entry.tokenizer_file)
    info = machine()
    print(f"machine: {info}", flush=True)
    print(f"text mix: {mix}", flush=True)

    # 1. Offline, before any server runs, so it has the machine to itself.
    base = baseline(
        args.offline_throughput,
        entry.checkpoint_dir,
        pool[: args.offline_texts],
        args.batch_size,
    )
    print(f"offline baseline: {baseline_label(base)}: {base}", flush=True)
    if args.rps:
        rates = [float(r) for r in args.rps.split(",")]
    else:
        rates = [f * base["throughput"] for f in fractions]

    results: dict[str, Any] = {}
    for profile in profiles:
        print(f"\n== {profile.name}: {profile.about}", flush=True)
        steps = serve_and_measure(profile, args, repository, pool, rates)
        key, n = profile.name, 1
        while key in results:  # the same profile twice: each its own entry
            n += 1
            key = f"{profile.name} #{n}"
        results[key] = profile_result(profile, steps, base)

    about = rates_about(args.rps, args.rates, base)
    print(report(base, results, args.api, about))
    if args.out:
        out = document(base, results, machine=info, **_fields(args, about, mix))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def _fields(
    args: argparse.Namespace, rates: str, mix: dict[str, Any]
) -> dict[str, Any]:
    """What the JSON says of the run besides the results and the machine."""
    return {
        "command": " ".join(["python", *sys.argv]),
        "model": args.model,
        "api": "berth.v1.Berth/Embed, one text per call"
        if args.api == "unary"
        else "berth.v1.Berth/Stream, one text per request, a stream per "
        f"connection ({args.connections} per client process)",
        "rates": rates,
        "text_mix": mix,
    }


if __name__ == "__main__":
    sys.exit(main())
