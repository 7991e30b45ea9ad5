"""Pick each decode projection's GEMV config by timing the whole decode step, not the projection alone.

    PYTHONPATH=benchmarks:. python benchmarks/gemv_step_tune_h200.py --sweep OUT/gemv_h200.json --out OUT

Why: configs that win `gemv_h200.py --producer-cycles` (a projection after a one-program spinning producer) have
lost inside the kimi-linear-48b-a3b batch-1 step more than once (o_proj's long-row CUDA-core configs: 5.6-6.1 us
against 7.1 alone, the step 2.3-2.5% slower, three times), because in the step the predecessor is a real kernel
whose programs hold the SMs the projection's programs want to be resident on. So for every (N, K) that the sweep
covered at M = --batch, this takes the sweep's --top fastest Triton configs (plus torch when the sweep timed it
within --torch-margin of the best), builds a one-bucket table per candidate over the packaged one, and times the
captured decode step with each, interleaved with the packaged table (`step_profile_h200.pdl_ab`: 5 rounds of 20
replays, medians). A shape's winner is kept when it beats the packaged table by more than --min-gain. Finally
the winners together are A/B-timed once more against the packaged table. Writes step_tune_h200.json (every
candidate's step time) and step_tune_table.json (the kept buckets, for `gemv_table_merge.py`) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from step_profile_h200 import pdl_ab  # benchmarks/ (the script's folder is on sys.path)

from tokenspeed.models.loader import load_model

BASE = "1:regs:0"


def candidates(sweep: dict, M: int, top: int, torch_margin: float) -> dict[str, list[dict]]:
    """{"N,K": [table bucket, ...]}: the `top` fastest passing Triton configs of each shape at M (distinct), and
    {"kernel": "torch"} when torch was within `torch_margin` of the fastest."""
    by_shape: dict[str, list[dict]] = {}
    for r in sweep["rows"]:
        if r.get("M") == M and r.get("ok", True) and r.get("us"):
            by_shape.setdefault(f"{r['N']},{r['K']}", []).append(r)
    out = {}
    for nk, rows in by_shape.items():
        best = min(r["us"] for r in rows)
        picks, seen = [], set()
        for r in sorted((r for r in rows if r.get("config")), key=lambda r: r["us"]):
            key = json.dumps(r["config"], sort_keys=True)
            if key not in seen:
                seen.add(key)
                picks.append({"kernel": "triton", **r["config"], "us": r["us"]})
            if len(picks) == top:
                break
        torch_rows = [r for r in rows if not r.get("config")]
        if torch_rows and min(r["us"] for r in torch_rows) <= best * (1 + torch_margin):
            picks.append({"kernel": "torch", "us": min(r["us"] for r in torch_rows)})
        out[nk] = picks
    return out


def write_table(path: str, entries: dict[str, dict[str, dict]]) -> str:
    with open(path, "w") as f:
        json.dump({"entries": entries}, f, indent=1)
    return path


def tune(model, cands: dict[str, list[dict]], M: int, out: str, min_gain: float) -> tuple[list[dict], dict]:
    """Step A/B of every candidate bucket, shape by shape; returns (rows, kept entries)."""
    rows, kept = [], {}
    for nk, picks in cands.items():
        paths = [write_table(os.path.join(out, f"cand_{nk.replace(',', 'x')}_{i}.json"), {nk: {str(M): p}})
                 for i, p in enumerate(picks)]
        res = pdl_ab(model, M, 4096, [BASE] + [f"{BASE}:table={p}" for p in paths])
        base_ms = res["configs"][BASE]["step_ms"]
        best = None
        for pick, path in zip(picks, paths, strict=True):
            ms = res["configs"][f"{BASE}:table={path}"]["step_ms"]
            rows.append({"shape": nk, "M": M, "candidate": pick, "step_ms": ms, "packaged_step_ms": base_ms})
            if ms < base_ms * (1 - min_gain) and (best is None or ms < best[1]):
                best = (pick, ms)
        print(f"{nk}: packaged {base_ms:.3f} ms; " + "; ".join(
            f"{r['candidate'].get('kind', 'torch')} {r['candidate'].get('block_n', '')}x{r['candidate'].get('block_k', '')}"
            f" s{r['candidate'].get('split_k', '')} w{r['candidate'].get('num_warps', '')} "
            f"st{r['candidate'].get('num_stages', '')} {r['step_ms']:.3f}" for r in rows if r["shape"] == nk),
            flush=True)
        if best is not None:
            kept[nk] = {str(M): {**best[0], "step_ms": best[1], "packaged_step_ms": base_ms}}
    return rows, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", required=True, help="a gemv_h200.py result (rows at M = --batch)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batch", type=int, default=1, help="decode batch = the GEMV's M")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--torch-margin", type=float, default=0.05)
    ap.add_argument("--min-gain", type=float, default=0.004, help="keep a winner only when the step gains more")
    ap.add_argument("--geometry", default="kimi-linear-48b-a3b")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    with open(args.sweep) as f:
        cands = candidates(json.load(f), args.batch, args.top, args.torch_margin)
    model = load_model(args.geometry, torch.bfloat16, "cuda", load_format="dummy", seed=0)
    rows, kept = tune(model, cands, args.batch, args.out, args.min_gain)
    final = None
    if kept:
        path = write_table(os.path.join(args.out, "step_tune_table.json"), kept)
        final = pdl_ab(model, args.batch, 4096, [BASE, f"{BASE}:table={path}"])
        ms = [c["step_ms"] for c in final["configs"].values()]
        print(f"all winners together: {ms[1]:.3f} vs packaged {ms[0]:.3f} ms (x{ms[0] / ms[1]:.3f})", flush=True)
    body = {"env": {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "unknown"),
                    "date": time.strftime("%Y-%m-%d"), "sweep": args.sweep, "batch": args.batch},
            "rows": rows, "kept": kept, "final_ab": final, "elapsed_s": time.perf_counter() - t0,
            "median_packaged_ms": statistics.median(r["packaged_step_ms"] for r in rows) if rows else None}
    with open(os.path.join(args.out, "step_tune_h200.json"), "w") as f:
        json.dump(body, f, indent=1)
    print(f"wrote {args.out}/step_tune_h200.json in {body['elapsed_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
