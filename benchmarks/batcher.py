"""Batcher benchmark: core throughput, padding efficiency and simulated queue wait.

Run: ``python -m benchmarks.batcher [--quick]`` (or ``python benchmarks/batcher.py``).
Prints a table, then one JSON line (the last line) with the headline numbers.

1. Throughput: sequences arrive in messages of 64 (one gateway message, one
   arrival time) and go in through one ``push_many`` per message (as the
   service queues a request's texts), then ``next_batch`` is called until it
   returns None; this is bucketing + batching + packing, the core's whole job.
   The same with one ``push`` per sequence is timed too. The Python twin runs
   on fewer sequences; rates are compared per sequence.
2. Padding efficiency and queue wait: Poisson arrivals and engines simulated
   in virtual time, for berth's policy with its fine buckets and with the
   design's default power-of-two templates, and for a FIFO batcher that pads
   each batch to its longest sequence under the same token budget (how
   Triton's dynamic batcher and text-embeddings-inference batch).

The engine in part 2 is simulated, not run: no model, no GPU, no gRPC. A
batch takes the time of a fixed cost model, FIXED_S + PER_TOKEN_S x its
padded tokens (0.3 ms + 0.5 us a padded token: a BERT-base-class encoder on
one GPU in fp16, about 2 M padded tokens/s), in virtual time. So padding
efficiency and queue wait are properties of the batcher (its policy on this
length mix; the engine enters only through when it is free to take the next
batch, here as the cost model says), while the "done" latencies and the load
are the cost model's, not a real engine's latencies. Latencies of the served
stack are ``benchmarks/e2e.py``'s. Part 1 is measured for real, in CPU time.

``--out FILE`` also writes the results as JSON; the committed run is
``benchmarks/results/batcher_simulated_engine_cpu.json``.

This file reports; part 1 is ``benchmarks/batcher_throughput.py``, part 2
``benchmarks/batcher_sim.py``, their workload and policy
``benchmarks/batcher_common.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # measure on one core
if not __package__:  # run as a file: this file must not shadow the batcher package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402

from benchmarks.batcher_common import (  # noqa: E402
    BUCKETS,
    CHUNK,
    ENGINES,
    FIXED_S,
    IN_FLIGHT,
    MAX_BATCH,
    MAX_DELAY_S,
    MAX_LEN,
    MEDIAN,
    MIN_LEN,
    PER_TOKEN_S,
    POW2_BUCKETS,
    RATE,
    RATES,
    SIGMA,
    SIMULATED_ENGINE,
    SIMULATED_MEANING,
    TOKEN_BUDGET,
    _core_c,
    sample_lengths,
)
from benchmarks.batcher_sim import (  # noqa: E402
    BerthPolicy,
    FifoPolicy,
    SimResult,
    poisson,
    simulate,
)
from benchmarks.batcher_throughput import throughput  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

# One row of part 1's table: core, API, sequences, ns per sequence.
CoreRow = tuple[str, str, int, float]


def machine() -> dict[str, Any]:
    """The CPU part 1 ran on (part 2 runs in virtual time)."""
    return {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "cython_core": _core_c is not None,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument(
        "--out",
        type=Path,
        help="also write the results as JSON here (the committed run: "
        "benchmarks/results/batcher_simulated_engine_cpu.json)",
    )
    return parser.parse_args()


def print_setup(quick: bool, probe: np.ndarray) -> None:
    """The title, the length mix and the policy."""
    print(f"berth batcher benchmark{' (--quick)' if quick else ''}")
    print(
        f"lengths: lognormal, median {MEDIAN} tokens, sigma {SIGMA}, clipped to "
        f"[{MIN_LEN}, {MAX_LEN}] (mean {probe.mean():.1f}, p99 "
        f"{np.percentile(probe, 99):.0f})"
    )
    print(
        f"policy: {len(BUCKETS)} buckets {BUCKETS[0]}..{BUCKETS[-1]} (step 8 to 64, "
        f"then coarser); token budget {TOKEN_BUDGET}; max batch {MAX_BATCH}; "
        f"max delay {MAX_DELAY_S * 1e3:.0f} ms"
    )


# ---- 1. throughput ----------------------------------------------------------


def core_table(tp: dict[str, float]) -> list[CoreRow]:
    """Part 1's rows: push_many then push, the Cython core (if built) first."""
    table: list[CoreRow] = []
    for api, key in (("push_many", "many_ns"), ("push", "ns")):
        if f"c_{key}" in tp:
            table.append(("cython", api, int(tp["n_c"]), tp[f"c_{key}"]))
        table.append(("python", api, int(tp["n_py"]), tp[f"py_{key}"]))
    return table


def speedups(
    tp: dict[str, float],
) -> tuple[float | None, float | None, float | None]:
    """(cython / python with push_many, the same with push, the core's seq/s)."""
    if "c_ns" not in tp:
        return None, None, None
    ratio = tp["py_many_ns"] / tp["c_many_ns"]
    ratio_push = tp["py_ns"] / tp["c_ns"]
    return ratio, ratio_push, 1e9 / tp["c_many_ns"]


def print_throughput(tp: dict[str, float], table: list[CoreRow]) -> None:
    """Part 1's table and the Cython core's speedup over its twin."""
    print(
        f"\n1. core throughput: messages of {CHUNK} sequences, each queued with one "
        "push_many\n   (or one push per sequence), then next_batch until None; "
        "best of interleaved\n   runs, timed in CPU time of this thread (one core)"
    )
    print(f"   {'core':<8}{'API':<11}{'sequences':>11}{'ns/seq':>9}{'seq/s':>14}")
    for core, api, n, ns in table:
        print(f"   {core:<8}{api:<11}{n:>11,}{ns:>9.0f}{1e9 / ns:>14,.0f}")
    ratio, ratio_push, _ = speedups(tp)
    if ratio is not None:
        net = (tp["py_ns"] - tp["loop_ns"]) / (tp["c_ns"] - tp["loop_ns"])
        print(
            f"   cython / python, per sequence, end to end (the twin ran "
            f"{tp['n_py']:,} sequences):\n     push_many: {ratio:.1f}x (the JSON "
            f"line's cython_vs_python and core_seq_per_s)\n     push:      "
            f"{ratio_push:.1f}x; {net:.1f}x without the benchmark loop's own "
            f"{tp['loop_ns']:.0f} ns/seq (iterating the messages)"
        )
    else:
        print("   cython core not built: build it to measure (cythonize -i ...)")


# ---- 2. simulation ----------------------------------------------------------


def print_simulation_header() -> None:
    """What part 2 simulates, and its table's header."""
    print(
        f"\n2. simulated serving, SIMULATED ENGINE (a cost model; no model, GPU "
        f"or gRPC runs),\n   virtual time: Poisson arrivals, {ENGINES} engine, "
        f"latency = {FIXED_S * 1e3:.1f} ms + {PER_TOKEN_S * 1e6:.2f} us x padded "
        f"tokens,\n   {IN_FLIGHT} batches in flight per engine (1 running + 1 "
        f"prefetched); wait = arrival -> batch formed; done = -> batch finished;"
        f"\n   load = engine work / time (an idle engine always takes a batch, so "
        f"about 1; above 1 the queue grows without bound)"
    )
    header = (
        f"   {'arrivals/s':>10}  {'policy':<22}{'efficiency':>11}{'wait p50':>11}"
        f"{'wait p99':>11}{'done p99':>11}{'rows/batch':>11}{'load':>6}"
    )
    print(header)


def simulate_rates(
    seconds: float, rng: np.random.Generator
) -> tuple[dict[str, SimResult], list[dict[str, Any]]]:
    """Every policy at every rate, printed as it goes: (the headline rate's
    results by policy key, the table's rows for the JSON)."""
    headline: dict[str, SimResult] = {}
    rows: list[dict[str, Any]] = []
    for rate in RATES:
        arrivals = poisson(rate, seconds, rng)
        lengths = sample_lengths(len(arrivals), rng)
        policies: dict[str, BerthPolicy | FifoPolicy] = {
            "berth": BerthPolicy(BUCKETS, lengths),
            "pow2": BerthPolicy(POW2_BUCKETS, lengths),
            "fifo": FifoPolicy(lengths),
        }
        for key, policy in policies.items():
            r = simulate(policy, arrivals)
            if rate == RATE:
                headline[key] = r
            named = {"busy": "load", "mean_batch": "rows_per_batch"}  # the table's
            rows.append(
                {"arrivals_per_s": rate, "policy": policy.name}
                | {named.get(k, k): round(v, 3) for k, v in asdict(r).items()}
            )
            print(
                f"   {rate:>10,.0f}  {policy.name:<22}{r.efficiency:>11.3f}"
                f"{r.wait_p50_ms:>9.2f}ms{r.wait_p99_ms:>9.2f}ms"
                f"{r.done_p99_ms:>9.2f}ms{r.mean_batch:>11.1f}{r.busy:>6.2f}"
            )
    return headline, rows


def print_simulation_footer(headline: dict[str, SimResult]) -> None:
    """The buckets, the headline efficiencies, and what the simulation means."""
    berth, pow2, fifo = headline["berth"], headline["pow2"], headline["fifo"]
    print(
        f"   buckets: {len(BUCKETS)} = {BUCKETS[0]}..{BUCKETS[-1]} as above; "
        f"templates: the design's default {POW2_BUCKETS}"
    )
    print(
        f"   headline: {RATE:,.0f} arrivals/s: efficiency {berth.efficiency:.3f} "
        f"with the {len(BUCKETS)} buckets, {pow2.efficiency:.3f} with the "
        f"{len(POW2_BUCKETS)} templates, {fifo.efficiency:.3f} FIFO"
    )
    print(
        "   the engine is simulated: efficiency and wait are properties of the "
        "batcher\n   (its policy on this mix, given when the cost model frees "
        "the engine); done and\n   load are the cost model's, not a real "
        "engine's latencies (served: benchmarks/e2e.py)"
    )


# ---- report -----------------------------------------------------------------


def headline_line(
    tp: dict[str, float], headline: dict[str, SimResult]
) -> dict[str, Any]:
    """The JSON line printed last (and the document's "headline")."""
    ratio, ratio_push, core_rate = speedups(tp)
    berth, pow2, fifo = headline["berth"], headline["pow2"], headline["fifo"]
    return {
        "cython_vs_python": None if ratio is None else round(ratio, 1),
        "core_seq_per_s": None if core_rate is None else round(core_rate),
        "cython_vs_python_push": (None if ratio_push is None else round(ratio_push, 1)),
        "padding_efficiency": round(berth.efficiency, 3),
        "templates_padding_efficiency": round(pow2.efficiency, 3),
        "fifo_padding_efficiency": round(fifo.efficiency, 3),
        "p99_queue_wait_ms": round(berth.wait_p99_ms, 2),
        "max_delay_ms": MAX_DELAY_S * 1e3,
        "engine": "simulated (cost model)",
    }


def document(
    info: dict[str, Any],
    seconds: float,
    table: list[CoreRow],
    loop_ns: float,
    rows: list[dict[str, Any]],
    line: dict[str, Any],
) -> dict[str, Any]:
    """The results as ``--out`` writes them."""
    return {
        "benchmark": "benchmarks/batcher.py",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": info,
        "command": " ".join(["python", *sys.argv]),
        "engine": SIMULATED_ENGINE,
        "engine_simulated": True,
        "what_the_figures_mean": SIMULATED_MEANING,
        "workload": {
            "lengths": f"lognormal, median {MEDIAN}, sigma {SIGMA}, clipped "
            f"to [{MIN_LEN}, {MAX_LEN}]",
            "arrivals": "Poisson",
            "seconds_per_rate": seconds,
            "message_sequences": CHUNK,
        },
        "policy": {
            "buckets": BUCKETS,
            "templates": POW2_BUCKETS,
            "token_budget": TOKEN_BUDGET,
            "max_batch": MAX_BATCH,
            "max_delay_ms": MAX_DELAY_S * 1e3,
        },
        "core_throughput": {
            "measured": "CPU time of one thread, best of interleaved runs",
            "rows": [
                {
                    "core": core,
                    "api": api,
                    "sequences": n,
                    "ns_per_seq": round(ns, 1),
                    "seq_per_s": round(1e9 / ns),
                }
                for core, api, n, ns in table
            ],
            "loop_ns_per_seq": round(loop_ns, 1),
        },
        "simulation": rows,
        "headline": line,
    }


def main() -> None:
    args = parse_args()
    info = machine()
    rng = np.random.default_rng(2024)
    seconds = 0.5 if args.quick else 2.0
    print_setup(args.quick, sample_lengths(1_000_000, rng))

    tp = throughput(args.quick, rng)
    table = core_table(tp)
    print_throughput(tp, table)

    print_simulation_header()
    headline, rows = simulate_rates(seconds, rng)
    print_simulation_footer(headline)
    line = headline_line(tp, headline)
    if args.out:
        results = document(info, seconds, table, tp["loop_ns"], rows, line)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
