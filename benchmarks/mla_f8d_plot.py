"""Plot the Gluon MLA split kernel's fp8-cache forms against each other (H200, page 16, split + combine): per case
of `mla_gluon_h200.py --fp8 --f8d-ab` results (the warp-specialized kernel forced at every batch) the bf16 dots'
time over the fp8 dots' (`mla_gluon.FP8_DOTS`); of the run with the consumer's next score wgmma issued early
(WS_PIPE 1 / 2, measured at 5ee4449 and dropped) the sequential consumer's time over each early order's (bf16
dots) and, for the fp8 dots, issued after the output wgmma over issued before the softmax; of an `--ws-ab` run the
one-warpgroup kernel's time over the warp-specialized one's (`mla_gluon.WS_MIN_SEQS`); of the run with two consumer
warpgroups (93b105e, dropped) one consumer's time over two's; and per (batch, context) of a
`step_profile_h200.py --pdl-ab` run over an fp8 cache, the decode step's time under each other setting over the
first's inverted (> 1 everywhere: the form named is faster).

    cd benchmarks/results && python ../mla_f8d_plot.py mla_gluon_f8d_fp8_7031f48.json \
        mla_gluon_pipe_fp8_5ee4449.json mla_gluon_ws_small_fp8_7031f48.json mla_gluon_nc2_fp8_93b105e.json \
        step_profile_h200_8930d1c_fp8_ws_f8d_ab.json --out mla_f8d_h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ratio_plot import plot_ratios, ratio_cli  # benchmarks/ (the script's folder is on sys.path)


EARLY = {1: "after the output wgmma", 2: "before the softmax"}


def _step_rows(d: dict) -> list[tuple[str, float]]:
    """(label, other setting's step / first setting's step) of every (batch, ctx, other setting) of a --pdl-ab run
    (> 1: the first, the defaults, is faster), labelled by the setting's TOKENSPEED_ variable."""
    out = []
    for ab in d["pdl_ab"]:
        cfgs = list(ab["configs"].items())
        first = cfgs[0][1]["step_ms"]
        for name, r in cfgs[1:]:
            setting = name.split(":")[-1]
            out.append((f"step b{ab['batch']} {ab['ctx'] // 1024}K: defaults vs {setting}", r["step_ms"] / first))
    return out


def ratios(path: Path) -> list[tuple[str, float]]:
    """(label, ratio) of every case: gluon_ws / gluon_f8d (an --f8d-ab run), the WS_PIPE run's forms as above,
    gluon_1wg / gluon_ws (an --ws-ab run), gluon_ws1 / gluon_ws2 (the two-consumer run), or a step A/B's
    (`_step_rows`). Cases whose row tiles are wider than 32
    (no warp-specialized kernel) are left out."""
    d = json.loads(path.read_text())
    if "pdl_ab" in d:
        return _step_rows(d)
    rows = d["rows"]
    out = []
    for r in rows:
        if r["q_len"] * r["heads"] > 32:
            continue
        if r.get("gluon_ws2_us"):  # two consumer warpgroups (WS_CONSUMERS 2 at 93b105e, dropped) vs one
            out.append((f"two consumers vs one {r['case']}", r["gluon_ws1_us"] / r["gluon_ws2_us"]))
        elif r.get("gluon_1wg_us") and r.get("gluon_ws_us"):
            out.append((f"warp-specialized vs one warpgroup {r['case']}", r["gluon_1wg_us"] / r["gluon_ws_us"]))
        elif r.get("gluon_f8d_us"):
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
                title="H200, MLA over an fp8 cache, page 16: split + combine (graph, cold L2; 32 heads, K3 TP8 as "
                      "named)\nand the kimi-linear-48b-a3b decode step", xlim=(0.8, 1.25))
