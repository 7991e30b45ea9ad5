"""Plot the per-lane softmax sum of the Gluon MLA split kernel (`mla_gluon.LAZY_SUM`) against the per-tile one:
per case of `mla_gluon_h200.py --lazy-ab` results (split + combine, H200, page 16), the per-tile kernel's time
over the lazy kernel's (> 1: the lazy sum is faster), and per batch of `step_profile_h200.py --pdl-ab` results
with a TOKENSPEED_MLA_GLUON_LAZY_SUM setting, the decode step's ratio the same way.

    cd benchmarks/results && python ../mla_lazy_plot.py mla_gluon_lazy_{bf16,fp8}_2ab7dc7.json \
        step_profile_h200_{2ab7dc7,23dbb7c}_lazy_sum_ab.json step_profile_h200_1cc725c_lazy_sum_128k_ab.json \
        --out mla_lazy_h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ratio_plot import plot_ratios, ratio_cli  # benchmarks/ (the script's folder is on sys.path)

ENV = "TOKENSPEED_MLA_GLUON_LAZY_SUM"


def _kernel_rows(d: dict) -> list[tuple[str, float]]:
    """(label, per-tile us / lazy us) of every case of an --lazy-ab run (the per-tile kernel is its `gluon` form)."""
    dtype = "fp8" if "float8" in d["meta"]["cache_dtype"] else "bf16"
    return [(f"kernel {dtype} {r['case']}", r["gluon_us"] / r["gluon_lazy_us"]) for r in d["rows"]
            if r.get("gluon_us") and r.get("gluon_lazy_us")]


def _step_rows(d: dict) -> list[tuple[str, float]]:
    """(label, per-tile step / lazy step) of every batch of a --pdl-ab run: the setting that names ENV=0 is the
    per-tile one, or the first setting when one names ENV=1."""
    out = []
    for ab in d.get("pdl_ab", []):
        cfgs = ab["configs"]
        off = [r["step_ms"] for name, r in cfgs.items() if f"{ENV}=0" in name]
        on = [r["step_ms"] for name, r in cfgs.items() if f"{ENV}=1" in name]
        rest = [r["step_ms"] for name, r in cfgs.items() if ENV not in name]
        per_tile, lazy = (off[0], rest[0]) if off else (rest[0], on[0])
        out.append((f"decode step b{ab['batch']} ctx {ab['ctx'] // 1024}K", per_tile / lazy))
    return out


def ratios(path: Path) -> list[tuple[str, float]]:
    d = json.loads(path.read_text())
    return _kernel_rows(d) if "rows" in d else _step_rows(d)


if __name__ == "__main__":
    rows, out = ratio_cli(__doc__, ratios)
    plot_ratios(rows, out, xlabel="per-tile softmax sum / lazy sum (> 1: the lazy sum is faster)",
                title="H200, kimi-linear MLA (32 heads; K3 cases as named), page 16: split + combine (CUDA graph, "
                      "cold L2) and the kimi-linear-48b-a3b decode step", xlim=(0.9, 1.15))
