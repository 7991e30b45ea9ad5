"""Tokenizing a chat conversation's next turn on the server: with and without the segment cache.

    PYTHONPATH=. python benchmarks/tokenize_turns_cpu.py --messages 25,50,100 --out DIR

The default model's HuggingFace fast tokenizer (also timed: the rendered text in one `encode` call, as before
the segment cache); a conversation of N messages of ~1,600 tokens of code-like text,
rendered as the server renders it (`render_chat_segments` with the model's Jinja chat template: one control
text, which `encode_segments` splits at added tokens). Per N: the time to render and encode turn N + 1 (the N
messages again, as new strings, plus one new message) with an empty segment cache (every turn before the cache)
and after turn N was encoded (the cache kept its runs), the same ids checked; medians of --reps.
Writes tokenize_turns_cpu.json (and a PNG) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time

from tokenspeed.engine.tokenizer import load_tokenizer
from tokenspeed.models import resolve_config
from tokenspeed.models.default_model import default_model_path
from tokenspeed.server.chat.template import render_chat_segments

WORDS = ["def", "return", "import", "self", "the", "error", "file", "value", "class", "print", "for", "in", "if",
         "else", "None", "True", "x", "y", "data", "result", "(", ")", ":", "\n", "    ", "=", "+", "tests", "assert"]


def _segments(tok, messages: list[str]) -> list[tuple[str, bool]]:
    """As the server renders them (each text a new str object, as parsed from a new request body)."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "".join(list(m))}
            for i, m in enumerate(messages)]
    return render_chat_segments(msgs, None, tok.chat_template)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", default="25,50,100")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()
    path = str(default_model_path())
    rng = random.Random(0)
    n_max = max(int(n) for n in a.messages.split(","))
    texts = [" ".join(rng.choice(WORDS) for _ in range(1500)) for _ in range(n_max + 1)]
    rows = []
    for n in (int(x) for x in a.messages.split(",")):
        cold, warm, whole, tokens = [], [], [], 0
        for _ in range(a.reps):
            tok = load_tokenizer(path, resolve_config(path)[0].vocab_size)
            text = _segments(tok, texts[: n + 1])[0][0]
            t = time.perf_counter()
            tok.encode(text)  # the rendered text in one call (before the cache)
            whole.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            want = tok.encode_segments(_segments(tok, texts[: n + 1]))
            cold.append((time.perf_counter() - t) * 1e3)
            tok = load_tokenizer(path, resolve_config(path)[0].vocab_size)
            tok.encode_segments(_segments(tok, texts[:n]))  # turn N
            t = time.perf_counter()
            got = tok.encode_segments(_segments(tok, texts[: n + 1]))  # turn N + 1
            warm.append((time.perf_counter() - t) * 1e3)
            assert got == want
            tokens = len(got)
        assert tok.chat_template is not None and tok._added_token_pattern() is not None  # the split path ran
        rows.append({"messages": n + 1, "tokens": tokens, "whole_ms": statistics.median(whole),
                     "uncached_ms": statistics.median(cold), "cached_ms": statistics.median(warm)})
        print(f"{n + 1:>4} messages {tokens:>7} tokens: {rows[-1]['whole_ms']:7.1f} ms in one call, "
              f"{rows[-1]['uncached_ms']:7.1f} ms in runs with an empty cache, {rows[-1]['cached_ms']:6.1f} ms "
              "after the previous turn")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                                text=True).stdout.strip()
        doc = {"rows": rows, "commit": commit, "date": time.strftime("%Y-%m-%d"),
               "command": f"python benchmarks/tokenize_turns_cpu.py --messages {a.messages} --reps {a.reps}"}
        with open(os.path.join(a.out, "tokenize_turns_cpu.json"), "w") as f:
            json.dump(doc, f, indent=1)
        _plot(doc, os.path.join(a.out, "tokenize_turns_cpu.png"))


def _plot(doc: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [r["tokens"] / 1000 for r in doc["rows"]]
    ax.plot(xs, [r["whole_ms"] for r in doc["rows"]], ":o", label="the rendered text in one call (before)")
    ax.plot(xs, [r["uncached_ms"] for r in doc["rows"]], "--o", label="in runs, empty segment cache")
    ax.plot(xs, [r["cached_ms"] for r in doc["rows"]], "-o", label="in runs, after the previous turn")
    ax.set_xlabel("conversation (K tokens)")
    ax.set_ylabel("ms to tokenize the next turn (median)")
    ax.set_title(f"Chat prompt tokenization on the server, default model tokenizer ({doc['commit']})", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
