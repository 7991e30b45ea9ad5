"""Shared by the H200 benchmarks: CUDA-event timing of eager calls, side-stream warm-up before a graph capture,
the median GPU time of a captured graph's replay (and per call of a graph of n calls), and the JSON result file
with the run's environment."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
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


def graph_us(call: Callable[[int], object], n_calls: int, reps: int) -> float:
    """Per-call GPU time (us): median over `reps` replays of a CUDA graph of call(0..n_calls-1), / n_calls (call(0)
    and call(1) warmed up first, outside the capture)."""
    warm_up(lambda: (call(0), call(1)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            call(i)
    ms = replay_ms(g, reps, warmup=2)
    del g
    return ms / n_calls * 1e3


def write_result(path: str, body: dict, **env: object) -> None:
    """Write {"env": GPU, torch, Python, commit ($BENCH_COMMIT), command, date, plus `env`; **body} as JSON to
    `path` (folders made) and say so."""
    info = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "python": platform.python_version(), "commit": os.environ.get("BENCH_COMMIT", "unknown"),
            "command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d"), **env}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"env": info, **body}, f, indent=1)
    print(f"wrote {path}")
