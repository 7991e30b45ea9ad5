"""Tile sweep of the routed experts at decode sizes on one H200 (the direct, align-free mode that batch 1-4 runs).

    PYTHONPATH=.:benchmarks python benchmarks/moe_decode_tiles_h200.py --out benchmarks/results

kimi-linear-48b-a3b geometry with its shared expert folded in (257 stacked experts, top-8 + the shared one = 9
pairs a token, hidden 2304, expert intermediate 1024, bf16). A CUDA graph holds CALLS `moe_experts` calls, each on
its own random routing (so, as in the model's chain of layers, one call's weights are not in L2 for the next: 9
experts are 127 MB against the 50 MB L2), with PDL as the engine launches it. Per token count T it times
`default_config` and then each gate/up tile choice (block_n1, block_k1, warps, stages) with the default down tiles,
and each down tile choice with the default gate/up tiles; medians of CUDA-event replays, per call. Every variant's
output is compared with the default's (the tiles change the fp32 summation order over K, so equality is not
expected; the max relative difference is reported). Roofline: the touched experts' weight bytes at 4.27 TB/s.
Writes moe_decode_tiles_h200.json to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import replace

import torch
from graph_timing import replay_ms, warm_up
from triton.runtime.errors import OutOfResources

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import moe_experts as mx

HBM = 4.27e12
E, TOP_K, D, DI = 256, 8, 2304, 1024
CALLS = 8


def make_calls(T: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """CALLS (x, weights, ids) routings: TOP_K distinct routed experts per token plus the shared expert E last."""
    calls = []
    for _ in range(CALLS):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        routed = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:TOP_K] for _ in range(T)])
        ids = torch.cat([routed, torch.full((T, 1), E, device="cuda", dtype=routed.dtype)], dim=1)
        w = torch.cat([torch.rand(T, TOP_K, device="cuda", generator=gen), torch.ones(T, 1, device="cuda")], dim=1)
        calls.append((x, w, ids))
    return calls


def time_config(cfg, weights, calls) -> tuple[float, torch.Tensor]:
    """Per-call us of CALLS chained calls in one graph, and the first call's output."""
    w1, w3, w2 = weights

    def run():
        return [mx.moe_experts(x, w1, w3, w2, w, ids, Activation(), prefetch_expert=E, config=cfg)
                for x, w, ids in calls]

    warm_up(run, 2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    us = replay_ms(g, 30, 3) * 1e3 / CALLS
    return us, outs[0].clone()


def variants(base) -> list[tuple[str, object]]:
    out = []
    for bn, bk, nw, ns in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 5)):
        out.append((f"gu n{bn} k{bk} w{nw} s{ns}",
                    replace(base, block_n1=bn, block_k1=bk, num_warps1=nw, num_stages1=ns)))
    for bn, bk, nw, ns in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 5)):
        out.append((f"dn n{bn} k{bk} w{nw} s{ns}",
                    replace(base, block_n2=bn, block_k2=bk, num_warps2=nw, num_stages2=ns)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--budget-s", type=float, default=240.0)
    args = ap.parse_args()
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = tuple(torch.randn(E + 1, *shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                    for shape in ((DI, D), (DI, D), (D, DI)))
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        calls = make_calls(T, gen)
        base = mx.default_config(T, TOP_K + 1, E + 1, D, DI, 2)
        touched = len(set(calls[0][2].flatten().tolist()))
        roof_us = touched * 3 * DI * D * 2 / HBM * 1e6
        base_us, base_out = time_config(base, weights, calls)
        row = {"T": T, "default": str(base), "default_us": base_us, "roofline_us": roof_us, "variants": []}
        print(f"T={T} default {base_us:.1f} us (roofline {roof_us:.1f})", flush=True)
        for name, cfg in variants(base):
            if time.time() - t0 > args.budget_s:
                row["cut_by_budget"] = True
                break
            try:
                us, out = time_config(cfg, weights, calls)
            except OutOfResources as e:  # a tile that does not fit in shared memory: record and go on
                row["variants"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            rel = ((out.float() - base_out.float()).norm() / base_out.float().norm()).item()
            row["variants"].append({"name": name, "us": us, "rel_diff": rel})
            print(f"  {name}: {us:.1f} us  x{base_us / us:.3f}  rel {rel:.1e}", flush=True)
        ok = [v for v in row["variants"] if "us" in v]
        for part in ("gu", "dn"):
            best = min((v for v in ok if v["name"].startswith(part)), key=lambda v: v["us"], default=None)
            row[f"best_{part}"] = best
            print(f"T={T} best {part}: {best}", flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_decode_tiles_h200.json"), "w") as f:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                   "commit": os.environ.get("BENCH_COMMIT", "unknown"), "calls_per_graph": CALLS}, f, indent=1)


if __name__ == "__main__":
    main()
