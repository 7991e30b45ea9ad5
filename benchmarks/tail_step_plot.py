"""Plot a turn's prefill step before / after from `step_profile_h200.py` prefill results (one JSON per commit and
batch shape): wall time and summed kernel time per (tail, decodes beside) case, the eager step as the engine runs it.

    python benchmarks/tail_step_plot.py --before A.json [A2.json ...] --after B.json [B2.json ...] --out X.png
"""

from __future__ import annotations

import argparse
import json


def rows(paths: list[str]) -> dict[tuple[int, int], dict]:
    out = {}
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        for r in data["prefill"]:
            out[(r["tail"], r.get("beside", 0))] = r
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", nargs="+", required=True)
    ap.add_argument("--after", nargs="+", required=True)
    ap.add_argument("--labels", default="before,after")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    before, after = rows(args.before), rows(args.after)
    cases = sorted(set(before) & set(after), key=lambda c: (-c[1], c[0]))
    names = args.labels.split(",")
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.2
    for i, case in enumerate(cases):
        for j, (name, res) in enumerate(zip(names, (before, after), strict=True)):
            r = res[case]
            ax.bar(i + (j - 0.5) * 2 * w - w / 2, r["wall_ms"], w, color=f"C{j}", label=f"{name}: wall" if i == 0 else None)
            ax.bar(i + (j - 0.5) * 2 * w + w / 2, r["kernel_ms"], w, color=f"C{j}", alpha=0.45,
                   label=f"{name}: kernels" if i == 0 else None)
            ax.text(i + (j - 0.5) * 2 * w - w / 2, r["wall_ms"], f"{r['wall_ms']:.0f}", ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(range(len(cases)), [f"{t} new tokens\n+ {b} decodes" for t, b in cases], fontsize=8)
    ax.set_ylabel("ms per eager step")
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
