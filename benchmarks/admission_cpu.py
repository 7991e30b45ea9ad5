"""Host time of a new turn of a long conversation: what the engine loop spends on a request whose history is cached.

    PYTHONPATH=.:benchmarks python benchmarks/admission_cpu.py --histories 10000,50000,100000,200000 --out DIR

An agentic turn sends the whole history again (50K-200K tokens) plus a short tail. Before any GPU work the engine
validates the prompt (`EngineCore.add_request`), then admits it (`CacheManager.admit`: the chained page hashes of
the prompt, the prefix match, the page references) and builds the tail's prefill batch. That work runs on the
engine loop, so every decoding stream waits for it. The model is the stub of `host_overhead.py` (zero logits), so a
step costs host work only. Per history length: a first request (the history) is run to its end, then a second turn
(history + its output + a 100-token tail) is added and its first step taken; the timed phases are
`add_request`, `CacheManager.admit` (within the step) and the whole first step, medians over --reps turns (each a
new tail after the same history); and the engine process's intake of the same turn (msgpack unpack + add_request)
with the prompt sent as a list of ints (`wire_list`) or as int64 bytes (`wire_bytes`, `process.prompt_bytes`).
Prints a table; --out writes admission_cpu.json. `--plot BEFORE AFTER PNG` draws two such JSONs (e.g. the same
script run with PYTHONPATH at two commits) side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time

from host_overhead import ZeroModel

from tokenspeed.config import EngineConfig
from tokenspeed.core.sampling_params import SamplingParams
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine.process import pack, prompt_array, prompt_bytes, unpack

PAGE = 16


def _engine(max_len: int) -> EngineCore:
    config = EngineConfig.create(model="tiny-k3", load_format="dummy", device="cpu", page_size=PAGE, max_num_seqs=4,
                                 max_num_batched_tokens=8192, chunked_prefill_size=8192,
                                 num_pages=3 * (max_len // PAGE) + 64, max_model_len=max_len, cache_memory_gb=0.05,
                                 enforce_eager=True)
    engine = EngineCore(config)
    engine.runner.model = ZeroModel(engine.vocab_size, engine.runner.device)  # type: ignore[assignment]
    return engine


def _run_to_end(engine: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request(rid, prompt, params)
    out: list[int] = []
    while engine.has_work:
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def time_history(history: int, reps: int) -> dict:
    """Medians (ms) of a new turn's add_request, admit and first step after a cached `history`-token prompt."""
    rng = random.Random(history)
    engine = _engine(history + 4096)
    vocab = engine.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(history)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    output = _run_to_end(engine, "h", prompt, params)
    admit = engine.cache.admit
    spent: dict[str, list[float]] = {"add_request": [], "admit": [], "first_step": []}

    def timed_admit(*a, **kw):
        t = time.perf_counter()
        try:
            return admit(*a, **kw)
        finally:
            spent["admit"].append((time.perf_counter() - t) * 1e3)
    engine.cache.admit = timed_admit  # type: ignore[method-assign]
    hit = []
    for r in range(reps):
        turn = prompt + output + [rng.randrange(3, vocab) for _ in range(100)]
        t = time.perf_counter()
        engine.add_request(f"t{r}", turn, params)
        spent["add_request"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        outs = engine.step()
        spent["first_step"].append((time.perf_counter() - t) * 1e3)
        hit.append(engine.requests[f"t{r}"].num_cached_tokens if f"t{r}" in engine.requests else None)
        while engine.has_work:
            outs = engine.step()
        del outs
    turn = prompt + output + [7] * 100
    for wire, ids in (("wire_list", turn), ("wire_bytes", prompt_bytes(turn))):  # the engine process's add
        msg, spent[wire] = pack({"type": "add", "id": "w", "prompt_ids": ids}), []
        for r in range(reps):
            t = time.perf_counter()
            engine.add_request(f"{wire}{r}", prompt_array(unpack(msg)["prompt_ids"]), params)
            spent[wire].append((time.perf_counter() - t) * 1e3)
            engine.abort(f"{wire}{r}")
    return {"history": history, "cached_tokens": hit[-1],
            **{k: statistics.median(v[1:] or v) for k, v in spent.items()}}


def plot(before: str, after: str, png: str) -> None:
    """Admission and whole-first-step ms against history length, two runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for path, style in ((before, "--"), (after, "-")):
        with open(path) as f:
            doc = json.load(f)
        xs = [r["history"] / 1000 for r in doc["rows"]]
        for key, color in (("admit", "tab:blue"), ("first_step", "tab:orange")):
            ax.plot(xs, [r[key] for r in doc["rows"]], style, marker="o", color=color,
                    label=f"{key.replace('_', ' ')} ({doc.get('label') or doc['commit']})")
    ax.set_xlabel("cached history (K tokens), + 100-token tail")
    ax.set_ylabel("host ms on the engine loop (median)")
    ax.set_title("A new turn's admission, stub model, pages of 16 (CPU)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--histories", default="10000,50000,100000,200000")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="directory for admission_cpu.json")
    p.add_argument("--plot", nargs=3, metavar=("BEFORE", "AFTER", "PNG"), help="only draw two result JSONs")
    a = p.parse_args()
    if a.plot:
        plot(*a.plot)
        return
    rows = [time_history(int(h), a.reps) for h in a.histories.split(",")]
    print(f"{'history':>8} {'cached':>8} {'add_request ms':>15} {'admit ms':>9} {'first step ms':>14} "
          f"{'intake list ms':>15} {'intake bytes ms':>16}")
    for r in rows:
        print(f"{r['history']:>8} {r['cached_tokens']!s:>8} {r['add_request']:>15.2f} {r['admit']:>9.2f} "
              f"{r['first_step']:>14.2f} {r['wire_list']:>15.2f} {r['wire_bytes']:>16.2f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                                text=True).stdout.strip()
        doc = {"rows": rows, "commit": commit, "date": time.strftime("%Y-%m-%d"), "cpu": platform.processor(),
               "python": platform.python_version(), "command": "python benchmarks/admission_cpu.py "
               f"--histories {a.histories} --reps {a.reps}"}
        with open(os.path.join(a.out, "admission_cpu.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
