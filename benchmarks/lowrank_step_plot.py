"""Plot the decode-step A/Bs of the KDA low-rank gates in the kernel (kimi-linear-48b-a3b, 4K, H200): for every
batch of each `step_profile_h200.py --pdl-ab` result, the unfused step (TOKENSPEED_KDA_FUSED_GATES=0) over each
other setting's step in the same interleaved run (> 1: that setting is faster than running the stacked GEMV).

    python benchmarks/lowrank_step_plot.py benchmarks/results/step_profile_h200_de428aa_lowrank_l2_ab.json \
        benchmarks/results/step_profile_h200_1c6d9d8_lowrank_regs_ab.json \
        benchmarks/results/step_profile_h200_cf8ea04_lowrank_ab.json \
        benchmarks/results/step_profile_h200_ef4b654_lowrank_ab.json --out benchmarks/results/lowrank_step_h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ratio_plot import plot_ratios, ratio_cli  # benchmarks/ (the script's folder is on sys.path)

UNFUSED = "TOKENSPEED_KDA_FUSED_GATES=0"
HEADS = 32  # kimi-linear's KDA heads
# ops.KDA_FUSED_GATES_MAX_PAIRS at each measured commit: a "default" setting above it is unfused too (a control)
MAX_PAIRS = {"de428aa": 128, "1c6d9d8": 128, "cf8ea04": 128, "ef4b654": 32}


def ratios(path: Path) -> list[tuple[str, float]]:
    """(label, unfused step / setting step) of every other setting of every batch in one result file; a default
    that did not fuse at that batch is labelled a control (both settings the same code)."""
    d = json.loads(path.read_text())
    commit = d["env"].get("commit", "?")
    out = []
    for ab in d.get("pdl_ab", []):
        cfgs = ab["configs"]
        ref = next(r["step_ms"] for name, r in cfgs.items() if name.endswith(UNFUSED))
        for name, r in cfgs.items():
            if name.endswith(UNFUSED):
                continue
            what = name.split(":")[-1] if "TOKENSPEED" in name else "default"
            if what == "default" and ab["batch"] * HEADS > MAX_PAIRS.get(commit, 0):
                what = "default = unfused (control)"
            out.append((f"{commit} b{ab['batch']} {what}", ref / r["step_ms"]))
    return out


def main() -> None:
    rows, out = ratio_cli(__doc__, ratios)
    plot_ratios(rows, out, xlabel="unfused step / step (4K; > 1: faster than the stacked GEMV launch)",
                title="kimi-linear-48b-a3b decode step on an H200: KDA gate up projections in the kernel, same-run A/B",
                xlim=(0.9, 1.03),
                colors=["tab:gray" if "control" in lab else "tab:green" if r > 1 else "tab:red" for lab, r in rows])


if __name__ == "__main__":
    main()
