"""Host (CPU) time of one decode step, phase by phase, with a model whose forward costs ~nothing.

The engine (`EngineCore`, tiny preset, dummy weights) runs `batch` requests with `--context` tokens of history
each; the model is replaced by a stub returning zero logits of the right shape, so a step's wall time is the
host work only: scheduling, `ForwardBatch.build`, the decode-graph input copies (`DecodeGraphs.run`, eager padded
static batch on the CPU; real graph replay of the stub on CUDA), sampling and `EngineCore._update` (commit to the
cache manager, append tokens, finish checks). Phases are timed with perf_counter wrappers around:

    schedule  Scheduler.schedule
    build     ForwardBatch.build (host lists -> device tensors)
    forward   DecodeGraphs.run: graph input copies + the stub model (+ replay on CUDA)
    sample    ModelRunner._sample (SamplerInput rows, sample(), acceptance)
    update    EngineCore._update
    other     the rest of EngineCore.step (runner.execute glue: _logits_rows, state copies, stats)
    total     EngineCore.step

Medians over `--steps` decode steps (after `--warmup`), in microseconds, per batch size; JSON to --out.
`--profile B` also prints a cProfile of the decode steps at batch B (sorted by own time). `--spec K` times verify
steps instead: the `repeat` proposer (or `--spec-algorithm ngram`, prompt lookup) drafts K tokens, every draft is
accepted (forced acceptance K), the stub's
verify forward runs through the (K + 1)-token static batches and its KDA replay is a no-op, so a step is the host
work of speculation (proposing, building the verify batch, sampling and accepting K + 1 positions); no async
scheduling, as with any speculation.

    /work/venv/bin/python benchmarks/host_overhead.py --out benchmarks/results/host_overhead_cpu.json
    python benchmarks/host_overhead.py --device cuda --out ...   # on a GPU machine (H2D copies, pinned memory)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch

from tokenspeed.config import EngineConfig
from tokenspeed.core.sampling_params import SamplingParams
from tokenspeed.engine.core import EngineCore
from tokenspeed.models import batch as batch_mod

PHASES = ("schedule", "build", "forward", "sample", "update", "other", "total")


class ZeroModel:
    """Stands in for the model: logits [len(logits_indices), vocab] of zeros plus a per-row ramp (so greedy tokens
    vary a little), no cache access."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.base = torch.zeros(4096, vocab, device=device)
        self.base[torch.arange(4096), torch.arange(4096) % (vocab - 3) + 3] = 1.0

    def __call__(self, forward, buffers, logits_indices, **_kw):
        n = logits_indices.shape[0]
        if n <= self.base.shape[0]:
            return self.base[:n].clone()
        return torch.zeros(n, self.vocab, device=self.device)

    def kda_replay_table(self, buffers) -> None:  # verify graphs: no KDA layer to replay
        return None

    def replay_kda(self, buffers, batch, num_accepted, **_kw) -> None:
        return None


class PhaseTimer:
    """Per-phase wall time (perf_counter) and CPU time of this thread (thread_time: robust when other processes
    compete for the cores; torch runs CPU ops in the calling thread with --threads 1)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - start
                self.cpu[name] += time.thread_time() - cpu
        return timed

    def pop(self) -> tuple[dict[str, float], dict[str, float]]:
        out = dict(self.wall), dict(self.cpu)
        self.wall, self.cpu = defaultdict(float), defaultdict(float)
        return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CHUNK = 2048  # prefill chunk; a step's budget is 4 chunks


def make_engine(batch: int, context: int, steps: int, page_size: int, device: str, model: str,
                spec: int = 0, spec_algorithm: str = "repeat") -> EngineCore:
    """An engine for `batch` requests of `context` prompt tokens that can then decode `steps` more steps each
    (requests that finish their prefill early decode during the others' prefill: room for that is added); spec > 0:
    verify steps of spec forced-accepted drafts."""
    chunk = CHUNK
    max_len = context + steps * (spec + 1) + -(-batch * context // (4 * chunk)) * (spec + 1) + 64
    spec_kw = {"speculative_algorithm": spec_algorithm, "speculative_num_steps": spec,
               "speculative_force_accept_length": spec} if spec else {}
    pages = batch * (-(-max_len // page_size) + 1) + chunk // page_size + 64
    config = EngineConfig.create(
        model=model, load_format="dummy", device=device, page_size=page_size, max_num_seqs=batch,
        max_num_batched_tokens=4 * chunk, chunked_prefill_size=chunk, num_pages=pages,
        max_model_len=max_len, cuda_graph_max_bs=batch, cache_memory_gb=0.05,
        enforce_eager=True,  # the real model is never captured: the stub's graphs are, below
        **spec_kw,
    )
    engine = EngineCore(config)
    stub = ZeroModel(engine.vocab_size, torch.device(device))
    engine.runner.model = stub  # type: ignore[assignment]
    # Decode steps go through DecodeGraphs like the GPU engine's: captured graphs of the stub on CUDA; on the CPU
    # the same padded static batch run eagerly (use_graphs=False, as the CPU tests do).
    engine.runner.capture_graphs(batch, engine.max_model_len, (1, spec + 1) if spec else (1,),
                                 use_graphs=device.startswith("cuda"))
    assert engine.runner.graphs, "decode graphs were not set up"
    return engine


def run_batch(batch: int, args, profile: bool) -> dict:
    engine = make_engine(batch, args.context, args.warmup + args.steps, args.page_size, args.device, args.model,
                         args.spec, args.spec_algorithm)
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # up to max_model_len
    for i in range(batch):
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(args.context)]
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):  # prefill
        engine.step()
    gc_threshold = gc.get_threshold()
    if args.gc_tuned:  # what-if: long-lived objects out of the collector's way, rarer young collections
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 50, 100)

    timer = PhaseTimer()
    orig_build = batch_mod.ForwardBatch.build.__func__
    batch_mod.ForwardBatch.build = classmethod(timer.wrap("build", orig_build))  # type: ignore[method-assign]
    try:
        engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
        engine.runner._sample = timer.wrap("sample", engine.runner._sample)  # type: ignore[method-assign]
        engine._update = timer.wrap("update", engine._update)  # type: ignore[method-assign]
        for g in engine.runner.graphs.values():
            g.run = timer.wrap("forward", g.run)  # type: ignore[method-assign]
        engine.runner.model = timer.wrap("forward", engine.runner.model)  # eager fallback (not expected)
        samples = {"wall": defaultdict(list), "cpu": defaultdict(list)}
        prof = cProfile.Profile() if profile else None
        gc_before = sum(s["collections"] for s in gc.get_stats())
        for i in range(args.warmup + args.steps):
            measure = i >= args.warmup
            _sync(args.device)
            timer.enabled = measure
            if measure and prof is not None:
                prof.enable()
            start, cpu = time.perf_counter(), time.thread_time()
            outs = engine.step()
            total, total_cpu = time.perf_counter() - start, time.thread_time() - cpu
            if measure and prof is not None:
                prof.disable()
            timer.enabled = False
            wall, cpu_phases = timer.pop()
            want = args.spec + 1  # tokens per request and step: decode 1, verify spec + 1 (every draft accepted)
            assert len(outs) == batch and all(len(o.new_token_ids) == want for o in outs), f"step {i}: not {want}"
            if not measure:
                continue
            for clock, phases, t in (("wall", wall, total), ("cpu", cpu_phases, total_cpu)):
                phases["total"] = t
                phases["other"] = t - sum(phases.get(p, 0.0) for p in PHASES[:5])
                for p in PHASES:
                    samples[clock][p].append(phases.get(p, 0.0) * 1e6)
        gc_collections = sum(s["collections"] for s in gc.get_stats()) - gc_before
    finally:
        batch_mod.ForwardBatch.build = classmethod(orig_build)  # type: ignore[method-assign]
        if args.gc_tuned:
            gc.set_threshold(*gc_threshold)
            gc.unfreeze()
    result = {p: round(statistics.median(samples["wall"][p]), 1) for p in PHASES}
    result["total_p90"] = round(sorted(samples["wall"]["total"])[int(0.9 * args.steps)], 1)
    result["cpu_time"] = {p: round(statistics.median(samples["cpu"][p]), 1) for p in PHASES}
    result["gc_collections_per_step"] = round(gc_collections / (args.warmup + args.steps), 2)
    result["context_tokens"] = [min(r.num_tokens for r in engine.scheduler.running),
                                max(r.num_tokens for r in engine.scheduler.running)]
    result["page_table_width"] = max(len(engine.cache.page_table(r.request_id)) for r in engine.scheduler.running)
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile_rows)
        print(f"---- cProfile, batch {batch}, {args.steps} decode steps (sorted by own time) ----")
        print(s.getvalue())
    return result


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], check=False, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def plot(before_path: str, after_path: str, png: str) -> None:
    """Stacked host microseconds per phase, before vs after, per batch size (two saved results)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in (before_path, after_path):
        with open(path) as f:
            runs.append(json.load(f))
    phases = [p for p in runs[0]["phases"] if p != "total"]
    batches = list(runs[0]["batches"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, (label, run) in enumerate(zip(("before", "after"), runs, strict=True)):
        bottom = [0.0] * len(batches)
        for k, phase in enumerate(phases):
            vals = [run["batches"][b][phase] / 1e3 for b in batches]
            ax.bar([i + 0.4 * j for i in range(len(batches))], vals, 0.38, bottom=bottom, color=f"C{k}",
                   label=phase if j == 0 else None, hatch="//" if j == 0 else None)
            bottom = [x + v for x, v in zip(bottom, vals, strict=True)]
    ax.set_xticks([i + 0.2 for i in range(len(batches))], [f"batch {b}\n(before | after)" for b in batches])
    step = f"verify step ({runs[1]['spec']} drafts)" if runs[1].get("spec") else "decode step"
    ax.set_ylabel(f"host ms per {step} (median)")
    ax.set_title(f"{runs[1]['hardware']}: engine host time per {step}, {runs[1]['model']} stub forward, "
                 f"{runs[1]['context']}-token histories", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-k3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens of history per request")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--gc-tuned", action="store_true",
                    help="what-if: gc.freeze() after setup and gc.set_threshold(50000, 50, 100) while measuring")
    ap.add_argument("--profile", type=int, default=None, help="print a cProfile of the decode steps at this batch")
    ap.add_argument("--spec", type=int, default=0, help="time verify steps of this many forced-accepted drafts")
    ap.add_argument("--spec-algorithm", default="repeat", choices=["repeat", "ngram"],
                    help="the drafts' proposer (ngram: prompt lookup over the request's last 4096 tokens)")
    ap.add_argument("--profile-rows", type=int, default=35)
    ap.add_argument("--out", default=None, help="JSON result file")
    ap.add_argument("--plot", nargs=3, metavar=("BEFORE", "AFTER", "PNG"), help="plot two saved results and exit")
    args = ap.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {}
    for b in sizes:
        results[str(b)] = run_batch(b, args, profile=args.profile == b)
        r = results[str(b)]
        print(f"batch {b:4d} wall: " + "  ".join(f"{p} {r[p]:8.1f}" for p in PHASES) + "  (us, median)")
        print(f"batch {b:4d}  cpu: " + "  ".join(f"{p} {r['cpu_time'][p]:8.1f}" for p in PHASES), flush=True)
    commit = os.environ.get("BENCH_COMMIT") or _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "hardware": (f"{torch.cuda.get_device_name()}" if args.device.startswith("cuda") else
                     f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"),
        "commit": commit + ("+dirty" if dirty else ""),
        "command": "python benchmarks/host_overhead.py",
        "model": args.model, "device": args.device, "gc_tuned": args.gc_tuned, "context": args.context,
        "page_size": args.page_size, "spec": args.spec, "spec_algorithm": args.spec_algorithm if args.spec else None,
        "steps": args.steps, "unit": "us per decode step (median; cpu_time: this thread's CPU time)", "phases": list(PHASES), "batches": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
