"""Plot the fp8 dots of the warp-specialized Gluon MLA split kernel (`mla_gluon.FP8_DOTS`) and the consumer orders
tried beside them, over an fp8 cache: per case of `mla_gluon_h200.py --fp8 --f8d-ab` results (split + combine,
H200, page 16, the warp-specialized kernel forced at every batch), the bf16 dots' time over the fp8 dots' (> 1: the
fp8 dots are faster); and per case of the run with the consumer's next score wgmma issued early (WS_PIPE 1 / 2,
measured at 5ee4449 and dropped), the sequential consumer's time over each early order's (bf16 dots), and for the
fp8 dots, issued after the output wgmma over issued before the softmax.

    cd benchmarks/results && python ../mla_f8d_plot.py mla_gluon_f8d_fp8_ce5aaee.json \
        mla_gluon_pipe_fp8_5ee4449.json --out mla_f8d_h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ratio_plot import plot_ratios, ratio_cli  # benchmarks/ (the script's folder is on sys.path)


EARLY = {1: "after the output wgmma", 2: "before the softmax"}


def ratios(path: Path) -> list[tuple[str, float]]:
    """(label, ratio) of every case: gluon_ws / gluon_f8d (an --f8d-ab run), or the WS_PIPE run's forms as above.
    Cases whose row tiles are wider than 32 (no warp-specialized kernel) are left out."""
    rows = json.loads(path.read_text())["rows"]
    out = []
    for r in rows:
        if r["q_len"] * r["heads"] > 32:
            continue
        if r.get("gluon_f8d_us"):
            out.append((f"fp8 dots {r['case']}", r["gluon_ws_us"] / r["gluon_f8d_us"]))
        for pipe in (1, 2):  # bf16 dots: each early order against the sequential consumer
            if r.get(f"gluon_ws_p{pipe}_us"):
                out.append((f"bf16 dots, scores {EARLY[pipe]} {r['case']}",
                            r["gluon_ws_p0_us"] / r[f"gluon_ws_p{pipe}_us"]))
        if r.get("gluon_f8d_p2_us"):  # fp8 dots: that run's p0 and p1 both issued them after the output wgmma
            out.append((f"fp8 dots, scores {EARLY[2]} {r['case']}", r["gluon_f8d_p1_us"] / r["gluon_f8d_p2_us"]))
    return out


if __name__ == "__main__":
    rows, out = ratio_cli(__doc__, ratios)
    plot_ratios(rows, out, xlabel="time of the reference form / time of the variant (> 1: the variant is faster)",
                title="H200, kimi-linear MLA (32 heads; K3 TP8 as named), fp8 cache, page 16, warp-specialized split "
                      "+ combine (CUDA graph, cold L2)", xlim=(0.8, 1.2))
