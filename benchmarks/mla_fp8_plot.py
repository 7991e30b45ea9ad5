"""Plot the MLA Gluon split kernel over an fp8 cache (`mla_gluon_h200.py --fp8 --ws-ab` results): split + combine
time per case for the kernel before (a results file of an earlier tree's plain `--fp8` run), the one-warpgroup
kernel, the warp-specialized one and the same case over a bf16 cache, as grouped horizontal bars.

    python benchmarks/mla_fp8_plot.py --ws results/mla_gluon_h200_fp8_ws_page16_<c>.json \
        [--before results/mla_gluon_h200_fp8_base_page16_<c0>.json] --out results/mla_fp8_h200.png
"""

from __future__ import annotations

import argparse
import json

# (label, the result row's timing key, colour)
FORMS = [("fp8 before", "before", "tab:gray"), ("fp8, one warpgroup", "gluon_1wg_us", "tab:orange"),
         ("fp8, warp-specialized", "gluon_ws_us", "tab:green"), ("bf16 cache", "gluon_bf16_us", "tab:blue")]


def rows_of(ws_path: str, before_path: str | None) -> list[dict]:
    """The --ws-ab rows, each with `before` (the earlier tree's gluon_us for the same case) where given. Rows of an
    --ws-ab run before the `gluon_ws` form existed carry the forced kernel as gluon_us: copied over."""
    with open(ws_path) as f:
        rows = json.load(f)["rows"]
    before = {}
    if before_path:
        with open(before_path) as f:
            before = {r["case"]: r.get("gluon_us") for r in json.load(f)["rows"]}
    for r in rows:
        r.setdefault("gluon_ws_us", r.get("gluon_us"))
        r["before"] = before.get(r["case"])
    return rows


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forms = [f for f in FORMS if any(r.get(f[1]) for r in rows)]
    h = 0.8 / len(forms)
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    for j, (label, key, colour) in enumerate(forms):
        ys = [i + (j - (len(forms) - 1) / 2) * h for i in range(len(rows))]
        ax.barh(ys, [r.get(key) or 0 for r in rows], height=h, color=colour, label=label)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["case"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("split + combine, us (CUDA graph, cold L2; log scale)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ws", required=True, help="an `mla_gluon_h200.py --fp8 --ws-ab` result JSON")
    ap.add_argument("--before", help="an earlier tree's `mla_gluon_h200.py --fp8` result JSON, same cases")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.ws) as f:
        meta = json.load(f)["meta"]
    title = (f"MLA decode over an fp8 cache, page {meta.get('page')}, {meta.get('device')}, "
             f"{meta.get('commit')} ({meta.get('date')})")
    plot(rows_of(args.ws, args.before), args.out, title)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
