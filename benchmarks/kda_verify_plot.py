"""Plot KDA verify-window sweeps (`kda_decode_sweep_h200.py --verify K`): per shape, the time of the plain split loop
(the old default), the best window-loop variant and the best WY variant (from the last file), against the state-read
floor (bytes / 4.27 TB/s), from one or more sweep JSONs.

    python benchmarks/kda_verify_plot.py benchmarks/results/kda_verify_h200_<commit>.json [...] --out PNG
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

FORMS = {"plain split (old default)": lambda lab: "-split-" in lab and "-win" not in lab and "-wy" not in lab,
         "window loop": lambda lab: lab.endswith(("-win-vfirst", "-win")),
         "WY (chunk form)": lambda lab: "-wy" in lab}


def best_times(paths: list[str]) -> tuple[list[str], dict, dict]:
    """(shape labels, {shape: floor us}, {(shape, form): (us, label)}): the fastest parity-ok variant per form. The WY
    form is read from the last file only (earlier files may hold an earlier WY design under the same labels)."""
    shapes, floor, best = [], {}, {}
    for n, path in enumerate(paths):
        with open(path) as f:
            rows = json.load(f)["rows"]
        for r in rows:
            shape = f"{r['H']}x{r['N']}"
            if shape not in floor:
                shapes.append(shape)
                floor[shape] = r["floor_us"]
            for v in r["variants"]:
                if not v.get("parity_ok") or not v.get("us"):
                    continue
                for form, match in FORMS.items():
                    if form.startswith("WY") and n < len(paths) - 1:
                        continue
                    key = (shape, form)
                    if match(v["label"]) and (key not in best or v["us"] < best[key][0]):
                        best[key] = (v["us"], v["label"])
    return shapes, floor, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args()
    shapes, floor, best = best_times(args.json)
    width = 0.8 / (len(FORMS) + 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(shapes)), 4.8))
    xs = range(len(shapes))
    for i, form in enumerate(FORMS):
        ys = [best.get((s, form), (float("nan"), ""))[0] for s in shapes]
        ax.bar([x + i * width for x in xs], ys, width, label=form)
    ax.bar([x + len(FORMS) * width for x in xs], [floor[s] for s in shapes], width, label="state read floor",
           color="lightgray")
    ax.set_xticks([x + width * len(FORMS) / 2 for x in xs], [f"{s}\n(heads x seqs)" for s in shapes])
    ax.set_yscale("log")
    ax.set_ylabel("us per launch (log)")
    ax.set_title("KDA 4-token verify windows on the H200, [V, K] pools, fused norm (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    for s in shapes:
        print(s, {form: round(best[(s, form)][0], 2) for form in FORMS if (s, form) in best}, f"floor {floor[s]:.1f}")


if __name__ == "__main__":
    main()
