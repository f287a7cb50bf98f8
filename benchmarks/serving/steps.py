"""Phases 2 and 3 of the end-to-end benchmark on one stack: the rate steps,
then the cache hits. A step spreads its arrivals over client processes
(load.py), reads the stack before and after (stack.py), and sums up what
the clients saw."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.serving.load import Answer, Plan, Step, client_main, summarize
from benchmarks.serving.report import table_row
from benchmarks.serving.stack import (
    Pages,
    Profile,
    Target,
    cpu_by_role,
    pipeline,
    read_metrics,
    server_cpu,
    target,
)
from benchmarks.serving.workload import arrivals


def serve_and_measure(
    profile: Profile,
    args: argparse.Namespace,
    repository: Path,
    pool: list[str],
    rates: list[float],
) -> list[Step]:
    """Phases 2 and 3 on one stack: the rate steps, then the cache hits."""
    steps: list[Step] = []
    with target(profile, repository, args.address, args.spread_over) as to:
        for i, rate in enumerate(rates):
            n = min(args.max_requests, max(1, round(rate * args.duration)))
            load = Plan(
                to.address,
                args.model,
                pool[i * args.max_requests : i * args.max_requests + n],
                [],
                args.deadline_s,
                connections=args.connections,
                api=args.api,
                spread=to.spread,
            )
            clients = clients_for(rate, args.clients)
            steps.append(run_step(f"served {i + 1}", load, rate, clients, i, to))
            print(table_row(steps[-1]), flush=True)
        # 3. The cache hit path: step 1's texts, sent once to warm the cache
        # of the gateway process this client reaches, then again at step 1's
        # rate (one client, one connection; no /metrics readout).
        load = Plan(
            to.address,
            args.model,
            pool[: steps[0].sent],
            [],
            args.deadline_s,
            warm=True,
            spread=to.spread,
        )
        steps.append(
            run_step("cache hits", load, rates[0], 1, 99, replace(to, metrics=[]))
        )
        print(table_row(steps[-1]), flush=True)
    return steps


def clients_for(rate: float, given: int) -> int:
    """Client processes for a step at ``rate``: ``given`` (--clients), or 1
    per 2500 requests/s, at most 1 per 4 cores."""
    return given or max(1, min(math.ceil(rate / 2500), (os.cpu_count() or 1) // 4))


def run_step(
    name: str, load: Plan, rate: float, clients: int, seed: int, to: Target
) -> Step:
    """Send ``load``'s texts to ``to`` as Poisson arrivals at ``rate``, split
    over ``clients`` processes (each a Plan like ``load``, with its share)."""
    plans = [
        replace(load, texts=texts, offsets=offsets, client=client)
        for client, (texts, offsets) in enumerate(
            arrivals(load.texts, rate, clients, seed)
        )
    ]
    answers, by_role, (read_before, read_after) = _drive(plans, to)
    every = [row for rows, _, _ in answers for row in rows]
    step = summarize(name, rate, every)
    # The step's wall time: from the common start to the last answer (not
    # the clients' exit, nor the readings after).
    wall = max((offset + latency for offset, latency, _, _ in every), default=0.0)
    step.cpu_s = by_role
    step.cpu_s["clients"] = round(sum(cpu for _, cpu, _ in answers), 2)
    step.pipeline = pipeline(read_before, read_after, wall)
    if step.pipeline:
        print(f"  {name}: {json.dumps(step.pipeline)}", flush=True)
    for _, _, examples in answers:
        for code, details in examples.items():
            step.error_examples.setdefault(code, details)
    for code, details in step.error_examples.items():
        print(f"  {name}: {code}: {details}", flush=True)
    return step


def _drive(
    plans: list[Plan], to: Target
) -> tuple[list[Answer], dict[str, float], tuple[Pages, Pages]]:
    """Run a client process per plan, all from one start 0.2 s after every
    one is connected: what each answered (rows, CPU seconds, error
    examples), the CPU seconds each server role used meanwhile, and the
    /metrics readings before and after."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = [
        ctx.Process(target=client_main, args=(plan, ready, go, start_at, results))
        for plan in plans
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    before = server_cpu(to.pid)
    read_before = read_metrics(to.metrics)
    start_at.value = time.monotonic() + 0.2
    go.set()
    answers = [results.get() for _ in procs]
    after = server_cpu(to.pid)
    read_after = read_metrics(to.metrics)
    for p in procs:
        p.join()
    return answers, cpu_by_role(before, after), (read_before, read_after)
