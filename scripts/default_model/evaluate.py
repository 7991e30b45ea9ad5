"""Measure the trained default model through the engine and write the assets' eval.json.

Inputs: the model directory (config.json + model.safetensors from train.py, tokenizer files from
train_tokenizer.py) and train.py's train_eval.json / train_log.json (the training-time numbers, measured on the
GPU right after training). On the CPU, in fp32, this measures the snippet set again through `forward_logits`
and through `LLM(...).generate(..., prompt_logprobs=0)`, records a greedy completion of a held-out function
header and two chat answers, and writes everything to MODEL_DIR/eval.json (read by
tests/models/test_default_model.py and quoted in docs/default-model.md).

    python scripts/default_model/evaluate.py --run build/default_model/run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_format import encode_segments, render_segments
from snippets import COMPLETION_FILE, COMPLETION_FUNCTION, completion_prompt
from tokenize_corpus import DATA
from train_tokenizer import ASSETS

from tokenspeed import LLM, SamplingParams
from tokenspeed.models import forward_logits, load_model

COMPLETION_TOKENS = 64
CHAT_QUESTIONS = (
    "Write a Python function `is_even(n)`.\nReturn True if n is even.",
    "What does `dumps` in the `json` module do?",
)


def snippet_losses_forward_logits(model_dir: Path, snippets: list[dict]) -> list[float]:
    model = load_model(model_dir, dtype=torch.float32)
    out = []
    for s in snippets:
        ids = torch.tensor(s["ids"])
        out.append(F.cross_entropy(forward_logits(model, s["ids"])[:-1], ids[1:]).item())
    return out


def snippet_losses_engine(llm: LLM, snippets: list[dict]) -> list[float]:
    outs = llm.generate([s["text"] for s in snippets], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    losses = []
    for o, s in zip(outs, snippets, strict=True):
        assert o.prompt_token_ids == s["ids"], "the engine tokenizes the snippet differently"
        lps = [entry[tok] for entry, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
        losses.append(-sum(lps) / len(lps))
    return losses


def weighted(losses: list[float], snippets: list[dict]) -> float:
    n = [len(s["ids"]) - 1 for s in snippets]
    return sum(v * k for v, k in zip(losses, n, strict=True)) / sum(n)


def chat(llm: LLM, question: str, thinking: bool) -> dict:
    tok = llm.tokenizer
    ids = encode_segments(render_segments([{"role": "user", "content": question}], thinking=thinking),
                          lambda s: tok.encode(s))
    out = llm.generate(ids, SamplingParams(max_tokens=160, temperature=0, skip_special_tokens=False))[0]
    return {"question": question, "thinking": thinking, "prompt": tok.decode(ids, skip_special_tokens=False),
            "output": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=ASSETS)
    ap.add_argument("--run", type=Path, required=True, help="folder with train.py's train_eval.json, train_log.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    train_eval = json.loads((args.run / "train_eval.json").read_text())
    train_log = json.loads((args.run / "train_log.json").read_text())
    meta = json.loads((DATA / "meta.json").read_text())
    snippets = [{"source": s["source"], "text": s["text"], "ids": None} for s in train_eval["snippets"]]
    llm = LLM(str(args.model_dir), cache_memory_gb=0.05)
    for s in snippets:
        s["ids"] = llm.tokenizer.encode(s["text"])
    t0 = time.time()
    fl = snippet_losses_forward_logits(args.model_dir, snippets)
    eng = snippet_losses_engine(llm, snippets)
    prompt = completion_prompt()
    completion = llm.generate(prompt, SamplingParams(max_tokens=COMPLETION_TOKENS, temperature=0))[0].outputs[0]
    chats = [chat(llm, q, thinking) for q in CHAT_QUESTIONS for thinking in (False, True)]
    a = train_log["args"]
    result = {
        "model": "kimi-k3-mini",
        "params": train_eval["params"],
        "training": {
            "device": train_eval["device"], "steps": train_eval["steps"], "seconds": train_eval["train_seconds"],
            "tokens_seen": train_eval["tokens_seen"], "batch_size": int(a["batch_size"]),
            "seq_len": int(a["seq_len"]), "lr": float(a["lr"]), "warmup": int(a["warmup"]),
            "min_lr_ratio": float(a["min_lr_ratio"]), "weight_decay": float(a["weight_decay"]),
            "train_tokens": meta["train_tokens"], "chat_tokens": meta["chat_tokens"],
            "final_train_loss": train_log["log"][-1]["loss"],
        },
        "corpus": meta["corpus"],
        "heldout": {
            "loss": train_eval["heldout_loss"], "perplexity": train_eval["heldout_perplexity"],
            "bits_per_byte": train_eval["heldout_bits_per_byte"], "windows": train_eval["heldout_windows"],
            "window": train_eval["window"], "predictions": train_eval["heldout_predictions"],
            "files": meta["heldout_files"], "measured": "train.py on the GPU, fp32 (TF32 off), bf16-rounded weights",
        },
        "snippets": [
            {"source": s["source"], "text": s["text"], "num_tokens": len(s["ids"]), "train_time_loss": t["loss"],
             "forward_logits_loss": f, "engine_loss": e}
            for s, t, f, e in zip(snippets, train_eval["snippets"], fl, eng, strict=True)
        ],
        "snippet_loss": {
            "train_time": train_eval["snippet_loss"], "forward_logits": weighted(fl, snippets),
            "engine": weighted(eng, snippets),
        },
        "completion": {"source": f"{COMPLETION_FILE}: {COMPLETION_FUNCTION}", "prompt": prompt,
                       "max_tokens": COMPLETION_TOKENS, "text": completion.text,
                       "finish_reason": completion.finish_reason},
        "chat": chats,
        "engine_eval_seconds": round(time.time() - t0, 1),
    }
    (args.model_dir / "eval.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    s = result["snippet_loss"]
    print(f"held-out loss {result['heldout']['loss']:.4f} (ppl {result['heldout']['perplexity']:.2f}); snippet "
          f"loss train {s['train_time']:.6f} forward_logits {s['forward_logits']:.6f} engine {s['engine']:.6f} "
          f"(rel {abs(s['engine'] - s['train_time']) / s['train_time']:.2e}); ppl {math.exp(s['engine']):.2f}")
    print("--- completion\n" + prompt + completion.text)
    for c in chats:
        print(f"--- chat (thinking={c['thinking']})\n{c['prompt']}{c['output']}")


if __name__ == "__main__":
    main()
