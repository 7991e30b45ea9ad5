"""Plot the FFN-junction-in-the-projection measurements (H200, kimi-linear-48b-a3b shapes): from
`junction_gemv_h200.py`'s result (the script is in git at 1d2e0ba / 8c7bd73 with the kernel it timed), unfused /
fused per-call time of each (T, N) pair (experts + junction + projection; 1d2e0ba: x tiles built in the K loop,
both LOOKAHEAD settings; 8c7bd73: the junction in the GEMV's prologue); from `step_profile_h200.py --pdl-ab`'s, the
unfused decode step (TOKENSPEED_MOE_JUNCTION_GEMV=0) over each fused setting's step in the same interleaved run. >
1: the fusion wins.

    python benchmarks/junction_plot.py benchmarks/results/junction_gemv_h200_{1d2e0ba,8c7bd73}.json \
        benchmarks/results/step_profile_h200_{1d2e0ba,8c7bd73}_junction_ab.json --out benchmarks/results/junction_h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ratio_plot import plot_ratios, ratio_cli  # benchmarks/ (the script's folder is on sys.path)

UNFUSED = "TOKENSPEED_MOE_JUNCTION_GEMV=0"


def ratios(path: Path) -> list[tuple[str, float]]:
    d = json.loads(path.read_text())
    commit = d["env"].get("commit", "?")
    out = []
    for r in d.get("rows", []):  # junction_gemv_h200.py
        for key, what in (("fused_us", "lookahead 1" if "fused_lookahead0_us" in r else "prologue"),
                          ("fused_lookahead0_us", "lookahead 0")):
            if key in r:
                out.append((f"{commit} op T{r['T']} N{r['N']} {what}", r["unfused_us"] / r[key]))
    for ab in d.get("pdl_ab", []):  # step_profile_h200.py --pdl-ab
        cfgs = ab["configs"]
        ref = next(r["step_ms"] for name, r in cfgs.items() if name.endswith(UNFUSED))
        for name, r in cfgs.items():
            if not name.endswith(UNFUSED):
                what = "lookahead 0" if "LOOKAHEAD=0" in name else "fused (default)"
                out.append((f"{commit} step b{ab['batch']} {what}", ref / r["step_ms"]))
    return out


def main() -> None:
    rows, out = ratio_cli(__doc__, ratios)
    plot_ratios(rows, out, xlabel="unfused / fused time (> 1: the fused junction is faster)",
                title="H200, kimi-linear-48b-a3b: MoE junction fused into the next projection's GEMV, same-run A/B",
                xlim=(0.6, 1.05))


if __name__ == "__main__":
    main()
