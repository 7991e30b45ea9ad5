"""Plot the "smem" GEMV's batch-1 decode-step A/Bs (kimi-linear-48b-a3b, 4K, H200): each candidate table's step time
against the packaged table's in the same interleaved run, from `gemv_step_tune_h200.py` and
`step_profile_h200.py --pdl-ab` results.

    python benchmarks/smem_step_plot.py benchmarks/results/step_tune_h200_smem_f4fc755.json \
        benchmarks/results/step_tune_h200_smem_603ca0b.json \
        benchmarks/results/step_profile_h200_1cf1fe9_smemdiag_packaged.json --out benchmarks/results/smem_step_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _label(cfg: dict) -> str:
    if cfg.get("kind") == "smem":
        return f"smem n{cfg['block_n']} w{cfg['num_warps']} st{cfg['num_stages']} pps{cfg.get('programs_per_sm', 0)}"
    return f"{cfg.get('kind')} n{cfg.get('block_n')} k{cfg.get('block_k')} s{cfg.get('split_k')}"


def ratios(path: Path) -> list[tuple[str, float]]:
    """(label, packaged step / candidate step) of every candidate in one result file (> 1: the candidate wins)."""
    d = json.loads(path.read_text())
    if "rows" in d:  # gemv_step_tune_h200.py
        return [(f"{r['shape']} {_label(r['candidate'])}", r["packaged_step_ms"] / r["step_ms"]) for r in d["rows"]]
    out = []
    for ab in d.get("pdl_ab", []):  # step_profile_h200.py --pdl-ab: the first config is the reference
        cfgs = list(ab["configs"].items())
        ref = cfgs[0][1]["step_ms"]
        for name, r in cfgs[1:]:
            tail = name.split("table=")[-1].split("/")[-1].replace(".json", "").replace("TOKENSPEED_GEMV_SMEM_", "")
            out.append((f"2304,4096 {tail}", ref / r["step_ms"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{json.loads(Path(p).read_text())['env'].get('commit', '?')}: {lab}", r)
            for p in args.results for lab, r in ratios(Path(p))]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r for _, r in rows], color=["tab:green" if r > 1 else "tab:red" for _, r in rows])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([lab for lab, _ in rows], fontsize=6)
    ax.set_xlim(0.92, 1.02)
    ax.set_xlabel("packaged-table step time / candidate step time (batch 1, 4K; > 1: the candidate is faster)")
    ax.set_title("kimi-linear-48b-a3b batch-1 decode step on an H200: smem GEMV candidates, same-run A/B", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(rows)} candidates)")


if __name__ == "__main__":
    main()
