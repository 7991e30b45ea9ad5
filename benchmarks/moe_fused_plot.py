"""Plot `moe_fused_h200.py` results: for every T and variant, the two launches' time over the variant's, from the
same interleaved run (> 1: the variant is faster than gate_up + down as two launches).

    python benchmarks/moe_fused_plot.py benchmarks/results/moe_fused_h200_44c2790.json \
        --out benchmarks/results/moe_fused_h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ratio_plot import plot_ratios, ratio_cli  # benchmarks/ (the script's folder is on sys.path)


def ratios(path: Path) -> list[tuple[str, float]]:
    """(label, two-launch us / variant us) of every variant but the default two launches, per T; a variant with
    other tiles is held against the two launches with those tiles."""
    d = json.loads(path.read_text())
    commit = d["env"].get("commit", "?")
    rows = d["rows"]
    ref = {(r["T"], r["label"]): r["us_per_call"] for r in rows if not r["fused"]}
    out = []
    for r in rows:
        if not r["fused"]:
            continue
        two = f"two_n{r['block_n1']}x{r['block_n2']}"
        base = ref.get((r["T"], two), ref[(r["T"], "two")])
        out.append((f"{commit} T{r['T']} {r['label']} ({r['us_per_call']:.1f} us)", base / r["us_per_call"]))
    return out


def main() -> None:
    rows, out = ratio_cli(__doc__, ratios)
    plot_ratios(rows, out, xlabel="two launches / variant (us per call; > 1: faster than gate_up + down)",
                title="kimi-linear-48b-a3b MoE at decode on an H200: gate_up + down in one persistent launch",
                xlim=(0.75, 1.1))


if __name__ == "__main__":
    main()
