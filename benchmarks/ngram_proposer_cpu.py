"""Host cost of the n-gram (prompt lookup) proposer per request and verify step: the window scan (no request key)
against the per-request index (`NgramProposer.propose(..., key=)`), on one CPU thread, with the same drafts.

A history of `--context` tokens grows by k + 1 tokens per step (the accepted drafts and the bonus token), drawn
either at random from a `--vocab`-token vocabulary (few long matches: the scan walks the whole window for n = 4,
3, 2; the worst case, and typical of fresh text) or by copying earlier stretches (agentic traffic re-reading files
and tool output: matches are found early). Prints and writes (--out) the median microseconds per call.

    python benchmarks/ngram_proposer_cpu.py --out benchmarks/results/ngram_proposer_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time

from tokenspeed.spec.proposer import NgramProposer


def history(kind: str, n: int, vocab: int, rng: random.Random) -> list[int]:
    if kind == "random":
        return [rng.randrange(vocab) for _ in range(n)]
    out = [rng.randrange(vocab) for _ in range(256)]
    while len(out) < n:  # copies of earlier stretches with a fresh token now and then
        s = rng.randrange(len(out))
        out.extend(out[s:s + rng.randint(8, 64)])
        out.append(rng.randrange(vocab))
    return out[:n]


def time_steps(kind: str, args: argparse.Namespace, keyed: bool) -> tuple[float, list[list[int]]]:
    """Median us per propose call over args.steps steps of a growing history, and the drafts."""
    rng = random.Random(7)
    tokens = history(kind, args.context, args.vocab, rng)
    grow = random.Random(11)
    p = NgramProposer()
    times, drafts = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        d = p.propose(tokens, args.k, key="r" if keyed else None)
        times.append((time.perf_counter() - start) * 1e6)
        drafts.append(d)
        src = tokens[grow.randrange(len(tokens)):][: args.k + 1] if kind == "copy" else []
        tokens.extend(src or [grow.randrange(args.vocab) for _ in range(args.k + 1)])
    return statistics.median(times[1:]), drafts  # the first keyed call builds the index: reported separately


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = {}
    for kind in ("random", "copy"):
        scan_us, scan_drafts = time_steps(kind, args, keyed=False)
        index_us, index_drafts = time_steps(kind, args, keyed=True)
        assert index_drafts == scan_drafts, f"{kind}: the index's drafts differ from the scan's"
        tokens = history(kind, args.context, args.vocab, random.Random(7))
        build = time.perf_counter()
        NgramProposer().propose(tokens, args.k, key="r")
        build_us = (time.perf_counter() - build) * 1e6
        rows[kind] = {"scan_us": round(scan_us, 1), "index_us": round(index_us, 1), "first_call_us": round(build_us),
                      "speedup": round(scan_us / index_us, 1),
                      "drafts_found": sum(bool(d) for d in scan_drafts) / len(scan_drafts)}
        print(f"{kind:6s}: scan {scan_us:8.1f} us, index {index_us:6.1f} us per call ({scan_us / index_us:5.1f}x); "
              f"first keyed call (builds the index) {build_us:7.0f} us; drafts found {rows[kind]['drafts_found']:.0%}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                            text=True).stdout.strip()
    out = {"date": time.strftime("%Y-%m-%d"), "hardware": f"CPU {platform.machine()}, 1 thread", "commit": commit,
           "command": "python benchmarks/ngram_proposer_cpu.py", "context": args.context, "vocab": args.vocab,
           "k": args.k, "steps": args.steps, "unit": "us per propose call (median)", "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
