"""First-call cost of the expanded MLA attention at new shapes (what serving sees: every turn's tail and history
length is new), on one H200: the engine's path (`ops/cuda/sdpa.attention_expanded`, keys / values as the MLA layer
builds them), one masked SDPA call (cuDNN) and the same on the memory-efficient kernel (no plan per shape), wall time
of the first call at a shape vs a repeat at the same shape, and the engine path's error against the masked call.

    PYTHONPATH=. python benchmarks/sdpa_first_call_h200.py --out benchmarks/results [--layout bshd|bhsd] [--warm]
    python benchmarks/sdpa_first_call_h200.py --plot results/sdpa_first_call_h200_*_<commit>.json  # PNG beside them
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=0 PYTHONPATH=. python benchmarks/sdpa_first_call_h200.py ...

--layout: keys / values [S, H, d] in memory (the MLA layer's default, in `sdpa.padded_rows`) or [S, H, d] views of
head-major [H, S, d] tensors. --warm: `sdpa.warm_plans` first (chunks up to 8192 tokens, 72K keys), timed. For
shapes with a history, each part of the split (history call, square call, merge) is also timed alone on device
events (`hist_ms`, `square_ms`, `merge_ms`: where bucketed plans cost more at repeat). The
environment variable (read once per process by PyTorch; `ops/cuda/sdpa.py` sets it to 1 unless given) picks
bucketed or exact-shape cuDNN plans; the JSON is named by layout, that variable and --warm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from graph_timing import events_ms, write_result

from tokenspeed.ops.cuda import sdpa

H, DQK, DV = 32, 192, 128
ROWS = 75000


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def masked(q, k, v, scale):
    """One SDPA call with the bottom-right causal mask: q [L, H, D], k / v [S, H, *] -> [L, H, Dv]."""
    L, S = q.shape[0], k.shape[0]
    pos = torch.arange(L, device=q.device)[:, None] + (S - L)
    mask = torch.arange(S, device=q.device)[None, :] <= pos
    qn, kn, vn = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, scale=scale).squeeze(0).transpose(0, 1)


def masked_efficient(q, k, v, scale):
    """`masked` on SDPA's memory-efficient kernel (CUTLASS: no cuDNN plan to build at a new shape)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return masked(q, k, v, scale)


def time_shape(q, k, v, scale) -> dict:
    """First and repeat wall ms of the engine path and the masked call on q [L, H, D] over k / v [S, H, *], and the
    engine's error against the masked call."""
    L, S = q.shape[0], k.shape[0]
    calls = {"engine": lambda: sdpa.attention_expanded(q, k, v, [0, L], [0, S], scale),
             "masked": lambda: masked(q, k, v, scale),
             "efficient": lambda: masked_efficient(q, k, v, scale)}
    row, out = {}, {}
    for name, fn in calls.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out[name] = fn()
        torch.cuda.synchronize()
        row[f"{name}_first_ms"] = (time.perf_counter() - t0) * 1e3
        row[f"{name}_repeat_ms"] = statistics.median(wall_ms(fn) for _ in range(3))
    err = (out["engine"].float() - out["masked"].float()).abs().max() / out["masked"].float().abs().max()
    row["engine_rel_err_vs_masked"] = err.item()
    if L < S:  # where the split's time goes: each call alone, after its first call, on device events
        row.update(split_parts_ms(q, k, v, scale))
    return row


def split_parts_ms(q, k, v, scale) -> dict:
    """Device ms of the split's history call, square call and merge on q [L, H, D] over k / v [S, H, *], in the
    layouts the engine passes (this process's plan mode)."""
    L, S = q.shape[0], k.shape[0]
    qs = sdpa.padded_rows(L, *q.shape[1:], dtype=q.dtype, device=q.device).copy_(q)
    qn, kn, vn = (t.transpose(0, 1).unsqueeze(0) for t in (qs, k, v))
    qn = qn if sdpa.bucketed_plans() else qn.contiguous()  # as `attention_expanded` passes it
    hist = lambda: sdpa.cudnn_attend(qn, kn[:, :, : S - L], vn[:, :, : S - L], False, scale)
    square = lambda: sdpa.cudnn_attend(qn, kn[:, :, S - L:], vn[:, :, S - L:], True, scale)
    (o1, l1), (o2, l2) = hist(), square()
    return {"hist_ms": events_ms(hist, reps=10, warmup=1), "square_ms": events_ms(square, reps=10, warmup=1),
            "merge_ms": events_ms(lambda: sdpa.merge_partials(o1, l1, o2, l2), reps=10, warmup=1)}


def plot(paths: list[str]) -> None:
    """First-call and repeat wall ms of the engine path per shape, one bar group per result file (log scale)."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for p in paths:
        with open(p) as f:
            runs.append((os.path.basename(p).removeprefix("sdpa_first_call_h200_").removesuffix(".json"), json.load(f)))
    shapes = [f"{r['L']}@{r['S']}" for r in runs[0][1]["rows"]]
    fig, ax = plt.subplots(figsize=(13, 4.5))
    width = 0.8 / len(runs)
    for i, (label, run) in enumerate(runs):
        xs = [j + i * width for j in range(len(shapes))]
        ax.bar(xs, [r["engine_first_ms"] for r in run["rows"]], width, label=f"{label}: first call")
        ax.scatter(xs, [r["engine_repeat_ms"] for r in run["rows"]], color="k", s=8, zorder=3)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=30, fontsize=8)
    ax.set_ylabel("wall ms (dots: repeat at the same shape)")
    ax.set_title("MLA expanded attention, first call at a new (new tokens @ keys) shape, H200, 32 heads 192/128")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(paths[0]), "sdpa_first_call_h200.png")
    fig.savefig(out, dpi=110)
    print("wrote", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--plot", nargs="+", help="result JSONs to plot instead of measuring")
    ap.add_argument("--shapes", default="800:50000,813:50813,1300:52113,1311:53424,4:53428,8192:40960,7344:49152,"
                                        "300:3796,2000:2000,2001:2001,517:517,640:70000")
    ap.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd")
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.layout == "bshd":
        k = sdpa.padded_rows(ROWS, H, DQK, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
        v = sdpa.padded_rows(ROWS, H, DV, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
    else:
        k = torch.randn(H, ROWS, DQK, device="cuda", generator=g).bfloat16().transpose(0, 1)
        v = torch.randn(H, ROWS, DV, device="cuda", generator=g).bfloat16().transpose(0, 1)
    meta = {"bucketed": sdpa.bucketed_plans()}
    if args.warm:
        t0 = time.perf_counter()
        meta["warm_calls"] = sdpa.warm_plans(H, DQK, DV, 8192, 72000, torch.bfloat16, "cuda")
        torch.cuda.synchronize()
        meta["warm_s"] = time.perf_counter() - t0
        print(meta, flush=True)
    rows = []
    scale = DQK ** -0.5
    with torch.no_grad():
        for spec in args.shapes.split(","):
            L, S = (int(x) for x in spec.split(":"))
            q = torch.randn(L, H, DQK, device="cuda", generator=g).bfloat16()
            row = {"L": L, "S": S, **time_shape(q, k[:S], v[:S], scale)}
            print(row, flush=True)
            rows.append(row)
    avoid = os.environ.get(sdpa.BUCKETED_PLANS_ENV, "")
    name = f"sdpa_first_call_h200_{args.layout}_avoid{avoid}{'_warm' if args.warm else ''}.json"
    write_result(os.path.join(args.out, name), {"rows": rows, **meta}, layout=args.layout, avoid_recompile=avoid)


if __name__ == "__main__":
    main()
