"""Plot, per shape of a `kda_decode_sweep_h200.py` result, the default decode and the best variant against the
copy kernels timed beside them (torch's copy, the Triton tile walks in place and into a second pool, torch's
in-place mul_), as % of the 4.27 TB/s HBM rate on the state bytes.

    python benchmarks/kda_ceilings_plot.py benchmarks/results/kda_decode_sweep_h200_oop_31fa434.json \
        --out benchmarks/results/kda_ceilings_h200_31fa434.png
    python benchmarks/kda_ceilings_plot.py benchmarks/results/kda_decode_sweep_h200_tma_c230e20.json --also tma \
        --out benchmarks/results/kda_ceilings_h200_tma_c230e20.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def bars(row: dict, also: list[str] = ()) -> list[tuple[str, float]]:
    """(label, % of HBM) of the default variant, the best one, the best whose label contains each of `also`, and
    every ceiling kernel of one shape."""
    by_label = {v["label"]: v for v in row["variants"] if "pct_hbm" in v}
    default = next((v for lab, v in by_label.items() if lab.startswith(row["default"])), None)
    out = [(f"decode default ({row['default']})", default["pct_hbm"])] if default else []
    out.append((f"decode best ({row['best']})", row["best_pct_hbm"]))
    for sub in also:
        hits = [v for lab, v in by_label.items() if sub in lab]
        if hits:
            top = max(hits, key=lambda v: v["pct_hbm"])
            out.append((f"decode best '{sub}' ({top['label']})", top["pct_hbm"]))
    out += [(v["label"], v["pct_hbm"]) for v in [row["copy"], *row["patterns"]] if "pct_hbm" in v]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--out", required=True)
    ap.add_argument("--also", default="", help="comma-separated label substrings: also plot the best of each")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(Path(args.result).read_text())["rows"]
    also = [a for a in args.also.split(",") if a]
    heights = [0.8 + 0.16 * len(bars(row, also)) for row in rows]
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, row in zip(axes[:, 0], rows, strict=True):
        data = bars(row, also)
        ax.barh(range(len(data)), [p for _, p in data],
                color=["tab:blue" if lab.startswith("decode") else "tab:gray" for lab, _ in data])
        ax.set_yticks(range(len(data)))
        ax.set_yticklabels([lab for lab, _ in data], fontsize=7)
        ax.axvline(85, color="tab:red", lw=0.8, ls="--")
        ax.set_xlim(60, 100)
        ax.set_title(f"{row['H']} heads x batch {row['N']}: % of 4.27 TB/s on the state bytes (red: 85% target)",
                     fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
