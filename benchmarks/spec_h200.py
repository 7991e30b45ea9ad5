"""Issue 9 on one H200: TPS/user at concurrency 1 with forced acceptance vs without speculation, and the cost of
KDA state replay after a verify step.

    PYTHONPATH=. python benchmarks/spec_h200.py --out benchmarks/results [--model kimi-linear-48b-a3b] [--concurrency N]

- TPS/user: one request (prompt `--prompt` tokens, `--output` tokens, greedy, ignore_eos) through `LLM` with decode
  CUDA graphs; then the same with `--speculative-algorithm repeat --speculative-num-steps 3
  --speculative-force-accept-length 3` (FORCED ACCEPTANCE: 3 drafts accepted per step whatever the target says;
  a benchmark of the verify path, not of a draft model) with verify CUDA graphs, each after a short warm-up request
  (Triton compiles). TPS/user = output tokens / the time from the first to the last output token; the ratio is also
  given from the host breakdown's median ms per token (insensitive to a one-off slow step).
- Replay cost: inside the speculative run, the GPU time of each verify graph replay vs of the KDA replay that
  follows it (CUDA events), i.e. how much slower a verify step with replay is than one that writes no state.
- Host breakdown: a second set of requests (as many as --concurrency) through the engine with every phase
  synchronised and timed
  (schedule, drafts, batch build, verify, sample, replay, update) and a cProfile of the host, so time that the GPU
  does not account for is attributed.
- Verify workspace: the bytes the verify graphs record for replay (measured from the captured tensors) next to the
  planner's figures for replay payloads and for per-position state snapshots.
- --concurrency N > 1: N requests of the same lengths run together (max_num_seqs N), so verify steps take batch-N
  graphs (where `kda_config.MULTI_TABLE` picks the WY verify kernel from 96 (sequence, head) pairs); TPS/user is the
  output tokens of all requests from the step where the last request got its first token (every prompt prefilled:
  the prefill chunks of later requests no longer fall into the window) to the step where the first request
  finished (the prompts prefill one per step, so requests finish at different steps and the batch would shrink),
  divided by N. A/B the KDA
  verify schedule with TOKENSPEED_KDA_VERIFY=<label> (e.g. bv32-split-w4, the old plain loop).
Writes spec_h200.json (spec_h200_c<N>.json with --concurrency N) to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable

import torch

from tokenspeed import LLM, SamplingParams


def run(model: str, device: str, prompt: int, output: int, spec: dict, concurrency: int = 1) -> dict:
    llm = LLM(model, device=device, load_format="dummy", max_num_seqs=concurrency, max_model_len=prompt + output + 16,
              max_num_batched_tokens=max(prompt, 512), chunked_prefill_size=max(prompt, 512), **spec)
    runner = llm.engine.runner
    events: dict[str, list] = {"verify": [], "replay": []}
    cuda = device.startswith("cuda")

    def timed(name, fn):
        def wrapper(*a, **kw):
            if not cuda:
                return fn(*a, **kw)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*a, **kw)
            e.record()
            events[name].append((s, e))
            return out
        return wrapper

    if 4 in runner.graphs:
        runner.graphs[4].run = timed("verify", runner.graphs[4].run)
        runner.graphs[4].replay_state = timed("replay", runner.graphs[4].replay_state)
    runner.model.replay_kda = timed("replay", runner.model.replay_kda)
    vocab = llm.engine.vocab_size
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
    llm.generate([[(3000 + i) % vocab for i in range(min(64, prompt))]], SamplingParams(max_tokens=9, ignore_eos=True,
                                                                         temperature=0.0))  # compile, warm up
    for evs in events.values():
        evs.clear()
    for r in range(concurrency):
        llm.add_request([(1000 + 7 * r + i) % vocab for i in range(prompt)], params)
    # (time, tokens) of the steps from the one where the last request got its first token to the one where the first
    # request finished: every request is decoding in between (the batch neither fills nor drains)
    stamps, started, done = [], set(), False
    while llm.engine.has_work:
        outs = llm.engine.step()
        started.update(o.request_id for o in outs if o.new_token_ids)
        if len(started) == concurrency and any(o.new_token_ids for o in outs) and not done:
            stamps.append((time.perf_counter(), sum(len(o.new_token_ids) for o in outs)))
        done = done or any(o.finished for o in outs)
    if cuda:
        torch.cuda.synchronize()
    tokens = sum(n for _, n in stamps[1:])
    tps = tokens / (stamps[-1][0] - stamps[0][0]) / concurrency
    out = {"spec": spec, "concurrency": concurrency, "tps_user": tps, "tok_s": tps * concurrency,
           "steps_after_first": len(stamps) - 1, "tokens_after_first": tokens,
           "verify_graphs": sorted(runner.graphs),
           "replay_graphs": sorted(runner.graphs[4].replay_graphs) if 4 in runner.graphs else []}
    for name, evs in events.items():
        if evs:
            out[f"{name}_gpu_ms"] = statistics.median(s.elapsed_time(e) for s, e in evs[2:] or evs)
            out[f"{name}_count"] = len(evs)
    out["host_breakdown"] = breakdown(llm, [[(2000 + 5 * r + i) % vocab for i in range(prompt)]
                                            for r in range(concurrency)], params, cuda)
    if 4 in runner.graphs:
        out["verify_workspace"] = workspace(llm)
    print(out, flush=True)
    del llm, runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def breakdown(llm: LLM, prompts: list[list[int]], params: SamplingParams, cuda: bool) -> dict:
    """Median wall ms per phase of the decode/verify steps of `prompts` run together (once every one of them is
    past its prompt), each phase synchronised, plus the top of a cProfile of the same steps (host time by
    function)."""
    engine = llm.engine
    times: dict[str, list[float]] = {}
    restore = patch_phases(engine, lambda label, fn: lambda *a, **kw: _timed_call(times, label, fn, cuda, *a, **kw))
    ids = [f"breakdown{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    profile = cProfile.Profile()
    step_ms, ms_per_token = [], []
    while engine.has_work:
        t = time.perf_counter()
        reqs = [engine.requests.get(rid) for rid in ids]  # gone once finished (async: one step still in flight)
        decoding = all(r is None or r.num_computed_tokens >= r.num_prompt_tokens for r in reqs)
        if decoding:
            profile.enable()
        outs = engine.step()
        if decoding:
            profile.disable()
            step_ms.append((time.perf_counter() - t) * 1e3)
            tokens = sum(len(o.new_token_ids) for o in outs) / len(prompts)  # per request
            if tokens:
                ms_per_token.append(step_ms[-1] / tokens)
    restore()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    result = {"step_ms_median": statistics.median(step_ms) if step_ms else None, "steps": len(step_ms),
              "ms_per_token_median": statistics.median(ms_per_token) if ms_per_token else None,
              "phase_ms_median": {k: statistics.median(v) for k, v in times.items()},
              "phase_calls": {k: len(v) for k, v in times.items()},
              "cprofile_top_tottime": text.getvalue().splitlines()[:60]}
    print("\n".join(result["cprofile_top_tottime"]), flush=True)
    return result


def patch_phases(engine, wrap) -> Callable[[], None]:
    """Replace each phase of the engine's step (schedule, update, execute, sample, state copies, batch build, the
    proposer, the eager KDA replay, each graph set's run and state replay) by wrap(label, fn); returns the function
    that puts the originals back."""
    from tokenspeed.executor import runner as runner_mod

    runner = engine.runner
    targets = [(engine.scheduler, "schedule", "schedule"), (engine, "_update", "update"), (runner, "execute", "execute"),
               (runner, "_sample", "sample"), (runner, "copy_states", "copy_states"),
               (runner.model, "replay_kda", "replay_eager")]
    for q, graphs in runner.graphs.items():
        targets += [(graphs, "run", f"graph_run_q{q}"), (graphs, "replay_state", f"replay_state_q{q}")]
    if runner.proposer is not None:
        targets.append((runner.proposer, "propose", "propose"))
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    for (obj, name, label), (_, _, fn) in zip(targets, originals, strict=True):
        setattr(obj, name, wrap(label, fn))
    build = runner_mod.ForwardBatch.build
    runner_mod.ForwardBatch.build = staticmethod(wrap("build", build))

    def restore() -> None:
        runner_mod.ForwardBatch.build = build
        for obj, name, fn in originals:
            setattr(obj, name, fn)
    return restore


def _timed_call(times: dict, label: str, fn, cuda: bool, *a, **kw):
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn(*a, **kw)
    if cuda:
        torch.cuda.synchronize()
    times.setdefault(label, []).append((time.perf_counter() - t) * 1e3)
    return result


def workspace(llm: LLM) -> dict:
    """Replay inputs the verify graphs hold (bytes, at batch 1 and at the largest size) vs the planner's replay
    payload and per-position snapshot figures for the same batch."""
    from tokenspeed.plan.cache import verify_workspace

    graphs = llm.engine.runner.graphs[4]
    config = llm.engine.model.config
    rows = {}
    for bs in (graphs.sizes[0], graphs.sizes[-1]):
        measured = sum(t.nbytes for rec in graphs.replay_inputs[bs].values() for t in (rec.projected, rec.f, rec.b))
        plan = verify_workspace(config, 1, bs, graphs.query_len)
        rows[bs] = {"measured_replay_bytes": measured, "planner_replay_bytes": plan.replay_bytes,
                    "planner_snapshot_bytes": plan.snapshot_bytes}
    return rows


def plot(result: dict, path: str) -> None:
    """Two panels: ms per output token (plain vs speculative, first-to-last and median step) and the GPU ms of a
    verify graph vs the KDA replay that follows it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    runs = [("plain", result["plain"]), ("forced accept 3", result["forced_accept_3"])]
    series = {"first-to-last token": [1e3 / r["tps_user"] for _, r in runs],
              "median step, phases synchronised": [(r.get("host_breakdown") or {}).get("ms_per_token_median") or 0.0
                                                   for _, r in runs]}
    for i, (label, vals) in enumerate(series.items()):
        a.bar([x + 0.4 * i for x in range(2)], vals, width=0.4, label=label)
    a.set_xticks([0.2, 1.2], [n for n, _ in runs])
    a.set_ylabel(f"ms per output token per user (concurrency {result.get('concurrency', 1)})")
    a.legend()
    f = result["forced_accept_3"]
    b.bar(["verify graph", "KDA replay"], [f.get("verify_gpu_ms", 0), f.get("replay_gpu_ms", 0)])
    b.set_ylabel("GPU ms per step")
    fig.suptitle(f"{result['model']} on {result['gpu']}, commit {result['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--concurrency", type=int, default=1, help="requests run together (also in the breakdown)")
    ap.add_argument("--plot-only", metavar="JSON", help="redraw the PNG of a saved result and exit")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), args.plot_only.replace(".json", ".png"))
        return
    c = args.concurrency
    plain = run(args.model, args.device, args.prompt, args.output, {}, c)
    forced = run(args.model, args.device, args.prompt, args.output,
                 {"speculative_algorithm": "repeat", "speculative_num_steps": 3,
                  "speculative_force_accept_length": 3}, c)
    result = {"model": args.model, "prompt": args.prompt, "output": args.output, "concurrency": c, "plain": plain,
              "forced_accept_3": forced,
              "tps_user_ratio": forced["tps_user"] / plain["tps_user"],
              "kda_verify_env": os.environ.get("TOKENSPEED_KDA_VERIFY", ""),
              "commit": os.environ.get("BENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    result["tps_user_ratio_median_step"] = (plain["host_breakdown"]["ms_per_token_median"]
                                            / forced["host_breakdown"]["ms_per_token_median"])
    if "verify_gpu_ms" in forced and "replay_gpu_ms" in forced:
        result["replay_over_verify"] = forced["replay_gpu_ms"] / forced["verify_gpu_ms"]
    print({k: v for k, v in result.items() if k not in ("plain", "forced_accept_3")}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = "spec_h200" if c == 1 else f"spec_h200_c{c}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, f"{name}.png"))


if __name__ == "__main__":
    main()
