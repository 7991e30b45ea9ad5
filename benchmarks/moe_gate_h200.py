"""Time the fused MoE gate (`tokenspeed.ops.triton.moe_gate`: add + RMSNorm + router GEMV + routing, one launch)
against the three launches it replaces (`add_rms_norm`, the fp32-output router GEMV, `moe_route`) on an H200, in
CUDA graphs, at Kimi-Linear's shapes (bf16, hidden 2304, 256 experts, top-8 + the folded shared expert).

    PYTHONPATH=benchmarks:. python benchmarks/moe_gate_h200.py [--tokens 1,2,4,8,16] [--chain 26]

Each graph holds `--chain` gates in a row (a decode step has 26 MoE layers), each behind a producer (an
elementwise op writing attn_out, as attention's o_proj would) so every gate waits on fresh data; the per-gate
time is (graph time - producers-only graph time) / chain. The cold-L2 effect of the router weights is included:
each link of the chain has its own router weight (26 x 1.2 MB). Rows: the unfused trio, the fused default
configuration, then a few `GateConfig`s. PDL as set by TOKENSPEED_PDL (default on).
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import replay_ms, warm_up

from tokenspeed import ops
from tokenspeed.ops.triton import moe_gate

K, E, TOP_K = 2304, 256, 8
CONFIGS = [moe_gate.GateConfig(1, 1, 4), moe_gate.GateConfig(2, 1, 4), moe_gate.GateConfig(2, 1, 8),
           moe_gate.GateConfig(4, 1, 8), moe_gate.GateConfig(2, 2, 8), moe_gate.GateConfig(2, 4, 8),
           moe_gate.GateConfig(1, 4, 8), moe_gate.GateConfig(4, 2, 8)]


def links(T: int, chain: int):
    g = torch.Generator(device="cuda").manual_seed(T)
    dt = torch.bfloat16
    mk = lambda *s: (torch.randn(*s, generator=g, device="cuda") * 0.05).to(dt)
    return [(mk(T, K), mk(T, K), mk(K) + 1, mk(E, K), torch.randn(E, generator=g, device="cuda") * 0.1)
            for _ in range(chain)]


def step(data, gate) -> None:
    for a, r, nw, w, b in data:
        a.mul_(1.0)  # the producer
        if gate is not None:
            gate(a, r, nw, w, b)


def unfused(a, r, nw, w, b):
    x, _ = ops.add_rms_norm(a, r, nw, 1e-6)
    return ops.moe_route(ops.linear(x, w, out_dtype=torch.float32), b, TOP_K, routed_scaling_factor=2.446,
                         shared_expert_id=E)


def fused(cfg):
    return lambda a, r, nw, w, b: moe_gate.moe_gate(a, r, nw, 1e-6, w, b, TOP_K, routed_scaling_factor=2.446,
                                                    shared_expert_id=E, config=cfg)


def graph_ms(data, gate, reps: int) -> float:
    warm_up(lambda: step(data, gate), 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(data, gate)
    return replay_ms(graph, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--chain", type=int, default=26)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    moe_gate.counter(torch.device("cuda"))  # before any capture
    for T in (int(t) for t in args.tokens.split(",")):
        data = links(T, args.chain)
        base = graph_ms(data, None, args.reps)
        rows = [("unfused (3 launches)", unfused), (f"fused default {moe_gate.default_config(T, E, K)}", fused(None))]
        rows += [(f"fused {cfg}", fused(cfg)) for cfg in CONFIGS]
        for name, gate in rows:  # us per gate: (graph - producers only) / chain
            us = (graph_ms(data, gate, args.reps) - base) * 1e3 / args.chain
            print(f"T={T:2d}  {name:60s} {us:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
