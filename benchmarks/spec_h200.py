"""Issue 9 on one H200: TPS/user at concurrency 1 with forced acceptance vs without speculation, and the cost of
KDA state replay after a verify step.

    PYTHONPATH=. python benchmarks/spec_h200.py --out benchmarks/results [--model kimi-linear-48b-a3b]

- TPS/user: one request (prompt `--prompt` tokens, `--output` tokens, greedy, ignore_eos) through `LLM` with decode
  CUDA graphs; then the same with `--speculative-algorithm repeat --speculative-num-steps 3
  --speculative-force-accept-length 3` (FORCED ACCEPTANCE: 3 drafts accepted per step whatever the target says;
  a benchmark of the verify path, not of a draft model) with verify CUDA graphs. TPS/user = output tokens / the
  time from the first to the last output token.
- Replay cost: inside the speculative run, the GPU time of each verify graph replay vs of the KDA replay that
  follows it (CUDA events), i.e. how much slower a verify step with replay is than one that writes no state.
Writes spec_h200.json to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from tokenspeed import LLM, SamplingParams


def run(model: str, device: str, prompt: int, output: int, spec: dict) -> dict:
    llm = LLM(model, device=device, load_format="dummy", max_num_seqs=1, max_model_len=prompt + output + 16,
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
    runner.model.replay_kda = timed("replay", runner.model.replay_kda)
    vocab = llm.engine.vocab_size
    llm.add_request([(1000 + i) % vocab for i in range(prompt)], SamplingParams(max_tokens=output, ignore_eos=True,
                                                                     temperature=0.0))
    stamps = []
    while llm.engine.has_work:
        outs = llm.engine.step()
        if any(o.new_token_ids for o in outs):
            stamps.append((time.perf_counter(), sum(len(o.new_token_ids) for o in outs)))
    if cuda:
        torch.cuda.synchronize()
    tokens = sum(n for _, n in stamps[1:])
    tps = tokens / (stamps[-1][0] - stamps[0][0])
    out = {"spec": spec, "tps_user": tps, "steps_after_first": len(stamps) - 1, "tokens_after_first": tokens,
           "verify_graphs": sorted(runner.graphs)}
    for name, evs in events.items():
        if evs:
            out[f"{name}_gpu_ms"] = statistics.median(s.elapsed_time(e) for s, e in evs[2:] or evs)
    print(out, flush=True)
    del llm, runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    plain = run(args.model, args.device, args.prompt, args.output, {})
    forced = run(args.model, args.device, args.prompt, args.output,
                 {"speculative_algorithm": "repeat", "speculative_num_steps": 3,
                  "speculative_force_accept_length": 3})
    result = {"model": args.model, "prompt": args.prompt, "output": args.output, "plain": plain,
              "forced_accept_3": forced,
              "tps_user_ratio": forced["tps_user"] / plain["tps_user"],
              "commit": os.environ.get("BENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    if "verify_gpu_ms" in forced and "replay_gpu_ms" in forced:
        result["replay_over_verify"] = forced["replay_gpu_ms"] / forced["verify_gpu_ms"]
    print({k: v for k, v in result.items() if k not in ("plain", "forced_accept_3")}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec_h200.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
