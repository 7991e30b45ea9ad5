"""Routed experts at decode sizes on one H200: the align-free direct mode against the aligned path.

    PYTHONPATH=. python benchmarks/moe_decode_h200.py --out benchmarks/results/moe_decode_h200.json

kimi-linear-48b-a3b geometry (256 experts, top-8, hidden 2304, expert intermediate 1024, bf16), T = 1..16 tokens
with random distinct top-k ids per token: `moe_experts` under `default_config` with its direct-mode threshold, and
the same config with the direct mode off (`direct_max_tokens=0`: the alignment launch + aligned kernels), each
captured in a CUDA graph and replayed (median of CUDA-event times), outputs compared bit for bit. Roofline: the
touched experts' weight bytes (distinct ids x 3 x 1024 x 2304 x 2 B) at 4.27 TB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch
from graph_timing import replay_ms, warm_up

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import moe_experts as mx

HBM = 4.27e12


def graph_of(fn):
    warm_up(fn, 2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe_decode_h200.json")
    ap.add_argument("--tokens", default="1,2,3,4,6,8,16")
    args = ap.parse_args()
    E, k, D, DI = 256, 8, 2304, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(E, DI, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w3 = torch.randn(E, DI, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(E, D, DI, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda", generator=gen)
        base = mx.default_config(T, k, E, D, DI, 2)
        res = {"T": T, "direct_max_tokens": base.direct_max_tokens}
        outs = {}
        for name, cfg in (("default", base), ("aligned", replace(base, direct_max_tokens=0))):
            g, out = graph_of(lambda cfg=cfg, x=x, ids=ids, w=w: mx.moe_experts(x, w1, w3, w2, w, ids, Activation(),
                                                                                  config=cfg))
            res[f"{name}_us"] = replay_ms(g, 50, 5) * 1e3
            outs[name] = out.clone()
        touched = len(set(ids.flatten().tolist()))
        res["roofline_us"] = touched * 3 * DI * D * 2 / HBM * 1e6
        res["bit_identical"] = bool(torch.equal(outs["default"], outs["aligned"]))
        res["saved_us"] = res["aligned_us"] - res["default_us"]
        print(res, flush=True)
        rows.append(res)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                   "commit": os.environ.get("BENCH_COMMIT", "unknown")}, f, indent=1)


if __name__ == "__main__":
    main()
