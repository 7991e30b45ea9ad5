"""Issue 8: a MoE layer's FFN junction fused into the next projection (`ops.PendingNorm.project`, the
`gemv_junction` kernel) against the unfused launches it replaces, at kimi-linear-48b-a3b decode shapes on one GPU.

    PYTHONPATH=.:benchmarks python benchmarks/junction_gemv_h200.py --out benchmarks/results/junction_gemv_h200.json

Each timed call is what the model runs between a MoE layer's router and the next layer's first projection: the
routed experts' gate_up and down launches (E 256 + the folded shared expert, top 8 + 1, D 2304, I 1024), then
either `combine_add_rms_norm` and the projection's GEMV (`resolve()` + `ops.linear`: unfused) or the fused GEMV
(`project`, LOOKAHEAD 1 and 0). Projections: KDA's merged in_proj 12576 x 2304 and MLA's q / kv_a 6720 x 2304;
T = 1, 2, 4 rows. Per-call time inside a CUDA graph of 12 calls (PDL on, as decode runs), three copies of the
expert and projection weights used in turn so every call streams its weights from HBM (cold L2), median of 30
replays. "floor_us" is the bytes the call must move (the selected experts' weights + the projection's weights) at
4.27 TB/s. Parity: the fused y against the unfused within 1e-2 relative, summed bit for bit (exit 1 otherwise,
after the JSON is written).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from graph_timing import graph_us, write_result  # benchmarks/graph_timing.py

from tokenspeed import ops
from tokenspeed.ops.junction import LOOKAHEAD_ENV
from tokenspeed.ops.reference.activation import Activation

HBM = 4.27e12
EPS = 1e-6
SILU = Activation("silu")
E, K_ROUTED, D, DI = 256, 8, 2304, 1024
COPIES = 3


def _experts(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w1, w3 [E + 1, I, D] and w2 [E + 1, D, I] in bf16, drawn on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1, w3 = (torch.randn(E + 1, DI, D, generator=g, device="cuda", dtype=torch.bfloat16) * D ** -0.5
              for _ in range(2))
    return w1, w3, torch.randn(E + 1, D, DI, generator=g, device="cuda", dtype=torch.bfloat16) * DI ** -0.5


def _inputs(experts, T: int, N: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(T, D, generator=g).to(dev, bf)
    res = (torch.randn(T, D, generator=g) * 3).to(dev, bf)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, : K_ROUTED + 1].to(dev)
    tw = (torch.rand(T, K_ROUTED + 1, generator=g) + 0.1).to(dev)
    ids[:, -1], tw[:, -1] = E, 1.0
    nw = (torch.rand(D, generator=g) + 0.5).to(dev, bf)
    w = (torch.randn(N, D, generator=torch.Generator(device=dev).manual_seed(seed), device=dev, dtype=bf)
         * D ** -0.5)
    return (x, *experts, tw, ids, res, nw, w)


def _call(inp, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, w1, w3, w2, tw, ids, res, nw, w = inp
    p = ops.moe_experts_pending(x, w1, w3, w2, tw, ids, SILU, res, nw, EPS, prefetch_expert=E)
    y = p.project(w) if fused else ops.linear(p.resolve(), w)
    return y, p.summed


def _floor_us(T: int, N: int) -> float:
    experts = len({int(e) for e in torch.rand(T, E).argsort(-1)[:, :K_ROUTED].flatten()}) + 1  # distinct, approx.
    return (experts * 3 * DI * D * 2 + N * D * 2) / HBM * 1e6


def run(experts: list, T: int, N: int) -> dict:
    copies = [_inputs(experts[i], T, N, seed=100 * T + i) for i in range(COPIES)]
    want_y, want_s = _call(copies[0], fused=False)
    row = {"T": T, "N": N, "floor_us": _floor_us(T, N)}
    y, s = _call(copies[0], fused=True)
    row["parity_rel"] = ((y.float() - want_y.float()).abs().max() / want_y.float().abs().max()).item()
    row["summed_bit_equal"] = bool(torch.equal(s, want_s))
    for label, fused, la in (("unfused", False, "1"), ("fused", True, "1"), ("fused_lookahead0", True, "0")):
        os.environ[LOOKAHEAD_ENV] = la
        row[f"{label}_us"] = graph_us(lambda i, f=fused: _call(copies[i % COPIES], f), 12, 30)
    os.environ.pop(LOOKAHEAD_ENV, None)
    row["saving_us"] = row["unfused_us"] - row["fused_us"]
    row["saving_lookahead0_us"] = row["unfused_us"] - row["fused_lookahead0_us"]
    print(f"T={T} N={N}: unfused {row['unfused_us']:.2f} us, fused {row['fused_us']:.2f} "
          f"(lookahead 0: {row['fused_lookahead0_us']:.2f}), floor {row['floor_us']:.2f}; "
          f"parity {row['parity_rel']:.2e}, summed bit-equal {row['summed_bit_equal']}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--ns", default="12576,6720")
    ap.add_argument("--out", default="benchmarks/results/junction_gemv_h200.json")
    args = ap.parse_args()
    experts = [_experts(seed=i) for i in range(COPIES)]
    rows = [run(experts, int(t), int(n)) for n in args.ns.split(",") for t in args.tokens.split(",")]
    write_result(args.out, {"rows": rows})
    ok = all(r["parity_rel"] < 1e-2 and r["summed_bit_equal"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
