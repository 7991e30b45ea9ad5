"""Plot the "smem" GEMV's batch-1 decode-step A/Bs (kimi-linear-48b-a3b, 4K, H200): each candidate table's step time
against the packaged table's in the same interleaved run, from `gemv_step_tune_h200.py` and
`step_profile_h200.py --pdl-ab` results.

    python benchmarks/smem_step_plot.py benchmarks/results/step_tune_h200_smem_f4fc755.json \
        benchmarks/results/step_tune_h200_smem_603ca0b.json \
        benchmarks/results/step_profile_h200_1cf1fe9_smemdiag_packaged.json --out benchmarks/results/smem_step_h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

from ratio_plot import plot_ratios, ratio_cli  # benchmarks/ (the script's folder is on sys.path)


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
    def labelled(path: Path) -> list[tuple[str, float]]:
        commit = json.loads(path.read_text())["env"].get("commit", "?")
        return [(f"{commit}: {lab}", r) for lab, r in ratios(path)]

    rows, out = ratio_cli(__doc__, labelled)
    plot_ratios(rows, out, width=11, xlim=(0.92, 1.02),
                xlabel="packaged-table step time / candidate step time (batch 1, 4K; > 1: the candidate is faster)",
                title="kimi-linear-48b-a3b batch-1 decode step on an H200: smem GEMV candidates, same-run A/B")


if __name__ == "__main__":
    main()
