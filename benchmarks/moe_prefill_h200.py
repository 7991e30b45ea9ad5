"""Routed experts at prefill sizes on one H200: our Triton grouped kernels (default tiles and a few others) vs the
grouped-GEMM path (`torch._grouped_mm`, `tokenspeed.ops.cuda.moe_grouped`) vs the matmul rate measured in the run.

    PYTHONPATH=. python benchmarks/moe_prefill_h200.py [--out benchmarks/results/moe_prefill_h200.json]

Geometries: kimi-linear-48b-a3b (E 256, top-8, D 2304, I 1024, SiLU) and k3-slice (E 64, top-16 in the 3584 latent,
SiTU), bf16, T = 2048 / 8192 tokens, router ids from a seeded random softmax (roughly balanced, as dummy weights
give). FLOPs = 6 * T * k * D * I (gate, up, down). Times: CUDA events, 3 warm-ups, median of 10 (eager; each call
is many ms, so launch gaps do not matter). Parity: every path against the Triton default, rel L2 < 1e-2.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from graph_timing import events_ms

from tokenspeed.models import resolve_config
from tokenspeed.ops.cuda import moe_grouped
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import moe_experts as tk

TILES = {  # (block_m, bn1, bk1, warps1, stages1, bn2, bk2, warps2, stages2)
    "m64n128k64": (64, 128, 64, 8, 3, 128, 64, 4, 4),
    "m128n128k64": (128, 128, 64, 8, 3, 128, 64, 8, 3),
    "m128n64k64": (128, 64, 64, 8, 3, 128, 64, 8, 3),
    "m128n128k64s4": (128, 128, 64, 8, 4, 128, 64, 8, 4),
    "m64n256k64": (64, 256, 64, 8, 3, 256, 64, 8, 3),
}


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = events_ms(lambda: a @ b, reps=20)
    return 2 * 8192**3 / ms / 1e9


def case(name: str, T: int, peak: float) -> dict:
    cfg, _ = resolve_config(name)
    E, k, I = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    D = cfg.routed_expert_hidden_size or cfg.hidden_size
    act = Activation(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(T, D, device="cuda", dtype=dt, generator=g)
    w1 = torch.randn(E, I, D, device="cuda", dtype=dt, generator=g) * D**-0.5
    w3 = torch.randn(E, I, D, device="cuda", dtype=dt, generator=g) * D**-0.5
    w2 = torch.randn(E, D, I, device="cuda", dtype=dt, generator=g) * I**-0.5
    logits = torch.randn(T, E, device="cuda", generator=g)
    tw, ids = torch.softmax(logits, -1).topk(k, -1)
    flops = 6 * T * k * D * I
    out = {"geometry": name, "T": T, "E": E, "k": k, "D": D, "I": I, "act": act.kind, "gflop": flops / 1e9}
    ref = tk.moe_experts(x, w1, w3, w2, tw, ids, act).float()
    paths = {"triton_default": lambda: tk.moe_experts(x, w1, w3, w2, tw, ids, act),
             "grouped_mm": lambda: moe_grouped.moe_experts(x, w1, w3, w2, tw, ids, act)}
    for tag, t in TILES.items():
        c = tk.ExpertsConfig(*t)
        paths[f"triton_{tag}"] = lambda c=c: tk.moe_experts(x, w1, w3, w2, tw, ids, act, config=c)
    for tag, fn in paths.items():
        try:
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            ms = events_ms(fn, reps=10)
            out[tag] = {"ms": ms, "tflops": flops / ms / 1e9, "pct_matmul": 100 * flops / ms / 1e9 / peak,
                        "rel_l2_vs_default": err}
            print(f"{name} T={T} {tag:>22}: {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s "
                  f"({100 * flops / ms / 1e9 / peak:4.1f}% of matmul)  rel_l2 {err:.1e}", flush=True)
        except Exception as e:  # a tile that does not fit shared memory: record and go on
            out[tag] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"{name} T={T} {tag}: {out[tag]['error']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe_prefill_h200.json")
    ap.add_argument("--geometries", default="kimi-linear-48b-a3b,k3-slice")
    ap.add_argument("--tokens", default="2048,8192")
    args = ap.parse_args()
    peak = matmul_tflops()
    print(f"matmul bf16 8192^3: {peak:.1f} TFLOP/s", flush=True)
    res = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "commit": os.environ.get("BENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d")},
           "matmul_tflops": peak, "cases": []}
    with torch.no_grad():
        for name in args.geometries.split(","):
            for T in (int(t) for t in args.tokens.split(",")):
                res["cases"].append(case(name, T, peak))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
