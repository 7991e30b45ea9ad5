"""Shared by the H200 kernel benchmarks: the median GPU time of a captured CUDA graph's replay."""

from __future__ import annotations

import statistics

import torch


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 1) -> float:
    """Median wall time in ms of `reps` replays of `graph`, each bracketed by CUDA events (after `warmup`)."""
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
