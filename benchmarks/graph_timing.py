"""Shared by the H200 benchmarks: CUDA-event timing of eager calls, side-stream warm-up before a graph capture,
and the median GPU time of a captured graph's replay."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def events_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median over `reps` calls of fn()'s time in ms between two CUDA events (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def warm_up(fn: Callable[[], object], calls: int = 1) -> None:
    """Run fn() `calls` times on a side stream (compiles kernels, settles the allocator) before a graph capture,
    then wait for it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 1) -> float:
    """Median wall time in ms of `reps` replays of `graph`, each bracketed by CUDA events (after `warmup`)."""
    for _ in range(warmup):
        graph.replay()
    return events_ms(graph.replay, reps, warmup=0)
