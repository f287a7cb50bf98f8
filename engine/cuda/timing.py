"""Timing GPU work as the engine runs it: inside CUDA graphs, from an idle
stream. What the choices made at capture (engine/cuda/choices.py) and the
GPU benchmarks measure with."""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F

from engine.cuda.graphs import capturing


def timing_lengths(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Random row lengths in (L/2, L]: what the choices at capture are timed on."""
    return torch.randint(length // 2 + 1, length + 1, (batch,), device=device)


def packed_starts(used: torch.Tensor) -> torch.Tensor:
    """int32 [B + 1]: where each packed row starts (cumulative lengths, 0 first)."""
    return F.pad(used.cumsum(0, dtype=torch.int32), (1, 0))


def time_in_graph(fn: Any, calls: int = 10, rounds: int = 3) -> float:
    """Milliseconds per call of fn's GPU work: ``calls`` calls captured in one
    CUDA graph, as the engine will run them, the best of a few replays.

    Back-to-back eager calls timed Python's launches instead, where kernels
    take a few microseconds: they picked flash attention for BERT-base 128 x
    16, whose graph then took 1.32 ms against 0.95 with berth's kernel
    (benchmarks/engine.py, H200)."""
    graph = captured(fn, calls)
    return min(replay_ms(graph) for _ in range(rounds)) / calls


def captured(fn: Any, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of fn, after one eager warm-up call
    (Triton compiles, cuBLAS picks its kernels)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        for _ in range(calls):
            fn()
    return graph


def time_in_turn(graphs: list[torch.cuda.CUDAGraph], rounds: int = 25) -> list[float]:
    """Milliseconds of one replay of each graph from an idle stream, as a
    batch runs: the median of ``rounds`` rounds that replay every graph once,
    in turn, each replay timed by events and waited for."""
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for graph, own in zip(graphs, times, strict=True):
            own.append(replay_ms(graph))
    return [statistics.median(own) for own in times]


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Milliseconds of one replay on the current stream: events around it,
    then waited for."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
