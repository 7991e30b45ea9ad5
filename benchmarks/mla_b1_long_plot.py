"""Plot `mla_b1_long_h200.py` results: batch-1 MLA decode (split + combine) against the cache-read floor, per
history length, split budget and combine tiling (the former 16-slot blocks vs `combine_tiles`), bf16 and fp8.

    python benchmarks/mla_b1_long_plot.py benchmarks/results/mla_b1_long_combine_h200_9d42056.json \
        --out benchmarks/results/mla_b1_long_h200.png
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.load(open(args.result))
    rows = [r for r in d["rows"] if "us" in r]
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.5), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        rs = [r for r in rows if r["dtype"] == dt]
        ctxs = sorted({r["ctx"] for r in rs})
        for w in sorted({r["waves"] for r in rs}):
            for cap, style in ((16, "--"), (max(r["combine_max_s"] for r in rs), "-")):
                pts = [next(r["us"] for r in rs if r["ctx"] == c and r["waves"] == w and r["combine_max_s"] == cap)
                       for c in ctxs]
                ax.plot([c // 1024 for c in ctxs], pts, style, marker="o",
                        label=f"{w:g} wave{'s' if w != 1 else ''}, combine {'16-slot blocks' if cap == 16 else 'one tile'}")
        ax.plot([c // 1024 for c in ctxs], [next(r["floor_us"] for r in rs if r["ctx"] == c) for c in ctxs], "k:",
                label="cache read at 4.27 TB/s")
        ax.set_xlabel("history (K tokens), batch 1")
        ax.set_ylabel("split + combine (us)")
        ax.set_title(f"MLA decode, 1 sequence, {dt} cache, page 16 (H200, {d['env']['commit']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
