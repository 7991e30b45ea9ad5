"""Plot a `kda_decode_sweep_h200.py` run with Gluon variants (`benchmarks/kda_gluon_h200.sh`): per shape, the
Triton decode of DECODE_TABLE, the Gluon decode of GLUON_DECODE_TABLE, the best Gluon variant, fla's
`fused_recurrent_kda` and torch's copy of the same bytes, as % of the 4.27 TB/s HBM rate on the state bytes, with
issue 7's 85% target (96 heads x 64 sequences).

    python benchmarks/kda_gluon_plot.py benchmarks/results/kda_decode_sweep_h200_gluon_ac403b0.json \
        --out benchmarks/results/kda_gluon_h200.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenspeed.ops.triton.kda_config import DECODE_TABLE, GLUON_DECODE_TABLE  # noqa: E402


def _row(table, pairs: int):
    return [cfg for bound, cfg in table if bound <= pairs][-1]


def bars(row: dict) -> list[tuple[str, float | None]]:
    """(label, % of HBM or None) of the five series for one shape of the sweep."""
    by_label = {v["label"].removesuffix("-vfirst"): v for v in row["variants"] if v.get("pct_hbm")}
    pairs = row["H"] * row["N"]
    tri, glu = _row(DECODE_TABLE, pairs).label, _row(GLUON_DECODE_TABLE, pairs).label
    gl_best = max((v for lab, v in by_label.items() if lab.endswith("-gl")), key=lambda v: v["pct_hbm"], default=None)
    return [(f"Triton ({tri})", by_label.get(tri, {}).get("pct_hbm")),
            (f"Gluon ({glu})", by_label.get(glu, {}).get("pct_hbm")),
            ("Gluon, best variant", gl_best["pct_hbm"] if gl_best else None),
            ("fla fused_recurrent_kda", row["fla"].get("pct_hbm")), ("torch copy", row["copy"].get("pct_hbm"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.result).read_text())
    rows = [r for r in data["rows"] if r["H"] * r["N"] >= GLUON_DECODE_TABLE[0][0]]
    series = [bars(r) for r in rows]
    names = [s[0].split(" (")[0] for s in series[0]]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(rows))]
        ys = [s[j][1] or 0.0 for s in series]
        ax.bar(xs, ys, width, label=name)
        for x, y in zip(xs, ys):
            if y:
                ax.text(x, y + 0.8, f"{y:.0f}", ha="center", fontsize=7)
    ax.axhline(85, color="k", lw=0.8, ls="--", label="issue 7 target at 96 x 64 (85%)")
    ax.set_xticks(range(len(rows)), [f"{r['H']} heads x {r['N']}" for r in rows])
    ax.set_ylabel("% of 4.27 TB/s on the state bytes")
    meta = data["meta"]
    ax.set_title(f"KDA decode, [V, K] pools, fused norm, CUDA graph (cold L2 < 120 MB): {meta['device']}, "
                 f"commit {meta['commit']}", fontsize=9)
    ax.set_ylim(0, 110)
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
