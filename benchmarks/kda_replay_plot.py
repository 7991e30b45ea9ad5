"""Plot the KDA replay timings of `kda_replay_gap_h200.py --time` (one JSON): per batch size, each schedule's time
of one multi-layer replay launch against the state read + write floor (bytes / 4.27 TB/s), log scale.

    python benchmarks/kda_replay_plot.py benchmarks/results/kda_replay_wy_h200_<commit>.json --out PNG
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args()
    with open(args.json) as f:
        timed = json.load(f)["timed"]
    sizes = sorted({r["N"] for r in timed})
    configs = list(dict.fromkeys(r["config"] for r in timed))
    us = {(r["N"], r["config"]): r["us"] for r in timed}
    floor = {r["N"]: r["floor_us"] for r in timed}
    width = 0.8 / (len(configs) + 1)
    fig, ax = plt.subplots(figsize=(11, 5))
    for i, cfg in enumerate(configs):
        ax.bar([x + i * width for x in range(len(sizes))], [us.get((n, cfg), float("nan")) for n in sizes], width,
               label=cfg)
    ax.bar([x + len(configs) * width for x in range(len(sizes))], [floor[n] for n in sizes], width,
           label="state read + write floor", color="lightgray")
    ax.set_xticks([x + 0.4 for x in range(len(sizes))], [f"{n} seqs" for n in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("us per replay launch (20 layers x 32 heads, 3 tokens)")
    ax.set_title("KDA state replay on the H200: split / window / chunked loops vs the WY form (two launches)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
