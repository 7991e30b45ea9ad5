"""Plot a `mla_decode_h200.py --loops` result: per case, each key-loop form's share of HBM bandwidth (cache bytes /
time / 4.27 TB/s) at its best min_chunk.

    python benchmarks/mla_loops_plot.py benchmarks/results/mla_loops_h200_<commit>.json [--out PNG]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def best_per_form(rows: list[dict]) -> tuple[list[str], list[str], dict]:
    """(cases, forms, {(case, form): best row}) of a --loops result; the best row has the least time."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    forms = list(dict.fromkeys(r["form"] for r in rows))
    best: dict = {}
    for r in rows:
        key = (r["case"], r["form"])
        if r.get("hbm_frac") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    return cases, forms, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None, help="PNG path (default: the JSON's with .png)")
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    cases, forms, best = best_per_form(data["rows"])
    width = 0.8 / max(len(forms), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cases)), 4.5))
    for i, form in enumerate(forms):
        xs = [c + (i - (len(forms) - 1) / 2) * width for c in range(len(cases))]
        ys = [100 * best[(c, form)]["hbm_frac"] if (c, form) in best else 0 for c in cases]
        ax.bar(xs, ys, width, label=form)
    ax.set_xticks(range(len(cases)), cases, rotation=30)
    ax.set_ylabel("% of 4.27 TB/s (cache bytes / time)")
    meta = data["meta"]
    ax.set_title(f"MLA split + combine, {meta.get('device')} ({meta.get('commit')}), best min_chunk per form")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = args.out or args.json.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    main()
