"""A routing table that sends every (N, K, M) of a `gemv_h200.py` run to its fastest Triton config, even where
torch was faster in that run: for A/B-timing the Triton GEMV inside a decode step (`step_profile_h200.py
--pdl-configs "...:table=PATH"`), where its PDL chain may win what the isolated timing gives to cuBLAS.

    python benchmarks/gemv_table_triton_only.py OUT/gemv_h200.json OUT/triton_only.json
"""

from __future__ import annotations

import json
import sys


def triton_only(result: dict) -> dict:
    """{"entries": {"N,K": {"M": {"kernel": "triton", **config, "us": ...}}}} from a gemv_h200.py result."""
    entries: dict[str, dict] = {}
    for w in result["winners"]:
        if w.get("triton_config"):
            entries.setdefault(f"{w['N']},{w['K']}", {})[str(w["M"])] = {
                "kernel": "triton", **w["triton_config"], "us": w["triton_us"], "torch_us": w["torch_us"]}
    return {"entries": entries}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        table = triton_only(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(table, f, indent=1)
    print(f"wrote {sys.argv[2]}: " + ", ".join(f"{nk} M {m}: {e['kind']} {e['block_n']}x{e['block_k']} "
                                                f"split {e['split_k']} {e['us']:.2f} us (torch {e['torch_us']:.2f})"
                                                for nk, per in table["entries"].items() for m, e in per.items()))
