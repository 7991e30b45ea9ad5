"""Where a batched verify step's time goes when nothing is synchronised for measuring: the host timeline of the
engine's own steps, against the GPU time of its graphs.

    PYTHONPATH=. python benchmarks/spec_host_gap_h200.py --out DIR [--concurrency 16] [--steps 24]

`spec_h200.py`'s host breakdown synchronises before and after every phase, so each phase's time includes the GPU
work it waits for and the synchronisations themselves. Here the steps run as served (one synchronisation per step,
where the sampled tokens are read) and each phase only records its host wall time (perf_counter around the call):
the phases `spec_h200.patch_phases` names: schedule, drafts (propose), batch build, each graph's host launch
(graph_run_q4: input copies + replay; replay_state_q4), sampling (which waits for the GPU), the state copies, the
update. The step's wall time minus the GPU time of its verify and replay graphs (CUDA events) is the time the GPU
sits idle, to be set against the phases that run between the sampled tokens' arrival and the next launch. A torch.profiler trace of a few steps (CPU ops,
CUDA runtime calls) is summarised by self CPU time and saved as a Chrome trace.
Model: kimi-linear-48b-a3b with dummy weights, 1024-token prompts, forced acceptance of 3 drafts (benchmarking the
verify path, not a drafter), as `spec_h200.py`. Writes spec_host_gap_c<N>.json and the trace to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from spec_h200 import patch_phases

from tokenspeed import LLM, SamplingParams


def _stamp(times: dict, label: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            times[label].append((time.perf_counter() - t) * 1e3)
    return wrapper


def _record_graph_events(graphs, events: list) -> Callable[[], None]:
    """Record (label, start, end) CUDA events around each verify / replay graph's GPU work into `events`; returns
    the function that removes the recording."""
    originals = {name: getattr(graphs, name) for name in ("run", "replay_state")}
    for name, label in (("run", "verify"), ("replay_state", "replay")):
        fn = originals[name]

        def timed(*args, _fn=fn, _label=label, **kw):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = _fn(*args, **kw)
            e.record()
            events.append((_label, s, e))
            return out
        setattr(graphs, name, timed)

    def unrecord() -> None:
        for name, fn in originals.items():
            setattr(graphs, name, fn)
    return unrecord


def plot(result: dict, path: str) -> None:
    """One bar per quantity: the step's wall time against its graphs' GPU time and the GPU's idle time, and each
    phase's host time per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    host = result["host_ms_per_step"]
    rows = [("step (wall, median)", result["step_ms_median"]), ("verify graph (GPU)", result["verify_gpu_ms_median"]),
            ("replay graph (GPU)", result["replay_gpu_ms_median"]), ("GPU idle", result["gpu_idle_ms_per_step"]),
            *((f"host: {k}", v) for k, v in host.items() if not k.startswith(("execute", "sample")))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color="tab:blue")
    for i, (_, v) in enumerate(rows[::-1]):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    ax.set_xlabel("ms per step")
    ax.set_title(f"{result['model']}, {result['concurrency']} requests verifying 4-token windows "
                 f"({result['gpu']}, {result['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plot", help="only draw the PNG of this result JSON (next to it)")
    p.add_argument("--model", default="kimi-linear-48b-a3b")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=160)
    p.add_argument("--steps", type=int, default=24, help="steps timed once every request decodes")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no graphs, no events)")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    if a.plot:
        with open(a.plot) as f:
            plot(json.load(f), a.plot.replace(".json", ".png"))
        return
    spec = {"speculative_algorithm": "repeat", "speculative_num_steps": 3, "speculative_force_accept_length": 3}
    n = a.concurrency
    cuda = a.device.startswith("cuda")
    llm = LLM(a.model, device=a.device, load_format="dummy", max_num_seqs=n, max_model_len=a.prompt + a.output + 16,
              max_num_batched_tokens=max(a.prompt, 512), chunked_prefill_size=max(a.prompt, 512), **spec)
    engine, runner = llm.engine, llm.engine.runner
    vocab = engine.vocab_size
    llm.generate([[(3000 + i) % vocab for i in range(64)]], SamplingParams(max_tokens=9, ignore_eos=True,
                                                                           temperature=0.0))
    params = SamplingParams(max_tokens=a.output, ignore_eos=True, temperature=0.0)
    ids = [llm.add_request([(1000 + 7 * r + i) % vocab for i in range(a.prompt)], params) for r in range(n)]
    while any(engine.requests[rid].num_computed_tokens < engine.requests[rid].num_prompt_tokens for rid in ids):
        engine.step()
    for _ in range(3):  # every request verifying
        engine.step()

    times: dict[str, list[float]] = defaultdict(list)
    events: list = []
    unrecord = _record_graph_events(runner.graphs[4], events) if cuda else (lambda: None)  # inside the host stamps
    restore = patch_phases(engine, lambda label, fn: _stamp(times, label, fn))
    step_ms = []
    for _ in range(a.steps):
        t = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    gpu = defaultdict(list)
    for name, s, e in events:
        gpu[name].append(s.elapsed_time(e))
    sums = {k: sum(v) / a.steps for k, v in times.items()}  # per step (propose runs once per request)
    med = {k: statistics.median(v) if v else 0.0 for k, v in gpu.items()}
    result = {"model": a.model, "concurrency": n, "steps": a.steps,
              "step_ms_median": statistics.median(step_ms),
              "verify_gpu_ms_median": med.get("verify", 0.0),
              "replay_gpu_ms_median": med.get("replay", 0.0),
              "host_ms_per_step": sums,
              "verify_calls": len(gpu["verify"])}
    result["gpu_idle_ms_per_step"] = result["step_ms_median"] - result["verify_gpu_ms_median"] \
        - result["replay_gpu_ms_median"]

    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(a.profile_steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    os.makedirs(a.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(a.out, f"spec_host_gap_c{n}_trace.json"))
    subprocess.run(["gzip", "-f", os.path.join(a.out, f"spec_host_gap_c{n}_trace.json")], check=False)
    result["profile_self_cpu_top"] = table.splitlines()
    restore()
    unrecord()
    result["commit"] = os.environ.get("BENCH_COMMIT", "")
    result["gpu"] = torch.cuda.get_device_name() if cuda else "cpu"
    result["date"] = time.strftime("%Y-%m-%d")
    with open(os.path.join(a.out, f"spec_host_gap_c{n}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(a.out, f"spec_host_gap_c{n}.png"))
    print(json.dumps({k: v for k, v in result.items() if k != "profile_self_cpu_top"}, indent=1))
    print("\n".join(table.splitlines()))


if __name__ == "__main__":
    main()
