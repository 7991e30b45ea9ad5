"""Measure the kimi-k3-mini-eagle3 draft through the engine (CPU, greedy): mean acceptance length at 3 speculative
steps on held-out snippets, and greedy outputs with the draft == without. Writes eval.json next to the draft.

    python scripts/default_model/eval_eagle3.py [--draft DIR] [--num-prompts 16] [--max-tokens 48]

Prompts: the first --prompt-len tokens of the CI snippet set (build/default_model/data/snippets.json, held-out
files) and of evenly spaced windows of the held-out stream (heldout.npy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tokenspeed import LLM, SamplingParams
from tokenspeed.models.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "build" / "default_model" / "data"
DRAFT = ROOT / "tokenspeed" / "assets" / "kimi-k3-mini-eagle3"


def heldout_prompts(n: int, prompt_len: int, data: Path = DATA) -> list[list[int]]:
    prompts = [s["ids"][:prompt_len] for s in json.loads((data / "snippets.json").read_text())]
    held = np.load(data / "heldout.npy").astype(np.int64)
    for start in np.linspace(0, held.size - prompt_len - 1, max(n - len(prompts), 0)).astype(int):
        prompts.append(held[start:start + prompt_len].tolist())
    return prompts[:n]


def measure(draft: Path, prompts: list[list[int]], max_tokens: int, steps: int = 3) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    model = default_model_path()
    plain = LLM(model, cache_memory_gb=0.05)
    spec = LLM(model, cache_memory_gb=0.05, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
               speculative_num_steps=steps)
    t0 = time.time()
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    t_plain = time.time() - t0
    t0 = time.time()
    outs = spec.generate(prompts, params)
    t_spec = time.time() - t0
    got = [o.outputs[0].token_ids for o in outs]
    steps_total = sum(o.metrics.num_spec_steps for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    per = [o.metrics.mean_acceptance_length for o in outs]
    return {
        "speculative_num_steps": steps, "num_prompts": len(prompts), "max_tokens": max_tokens,
        "greedy_equal": got == expected, "num_equal": sum(a == b for a, b in zip(got, expected)),
        "num_spec_steps": steps_total, "num_accepted_tokens": accepted,
        "mean_acceptance_length": (accepted + steps_total) / steps_total if steps_total else None,  # + bonus
        "per_prompt_acceptance_length": per, "plain_seconds": round(t_plain, 2), "spec_seconds": round(t_spec, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--train-log", type=Path, default=None, help="train_log.json of the run (numbers copied in)")
    args = ap.parse_args()
    result = measure(args.draft, heldout_prompts(args.num_prompts, args.prompt_len), args.max_tokens)
    result["command"] = "python scripts/default_model/eval_eagle3.py " + " ".join(sys.argv[1:])
    if args.train_log and args.train_log.is_file():
        info = json.loads(args.train_log.read_text())
        result["training"] = {k: info[k] for k in ("draft_params", "steps", "train_seconds", "tokens_seen",
                                                   "heldout_top1_agreement", "heldout_soft_ce", "device", "args")}
    (args.draft / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_prompt_acceptance_length", "training")}))


if __name__ == "__main__":
    main()
