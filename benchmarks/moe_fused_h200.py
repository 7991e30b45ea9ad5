"""The direct mode's gate_up + down as one persistent launch (`ops/triton/moe_fused.py`) against its two launches,
on one H200, at decode sizes.

    PYTHONPATH=.:benchmarks python benchmarks/moe_fused_h200.py --out benchmarks/results/moe_fused_h200.json

kimi-linear-48b-a3b's MoE as the model calls it: 256 routed experts + the folded shared expert (id 256, in every
token's ids: k = 9), hidden 2304, expert intermediate 1024, bf16, SiLU, with the FFN junction (residual add + the
next RMSNorm) in the combine. Four layers' weights (4 x 3.6 GB) and eight calls a CUDA graph cycling over them,
each with its own random routed ids, so every call reads its experts cold from HBM (the shared expert comes back
every fourth call, after ~0.5 GB of other weights). Every launch is a PDL dependent of the one before, as in the
step. Per T (tokens): the two launches (gate_up, down) and the fused launch under its knobs (residency cap
`PROGRAMS_PER_SM`, round-robin or ticket order `DYNAMIC`, W2 L2 prefetch `PREFETCH_W2`) and two other tiles
(block_n1 / block_n2), all graphs captured first and timed interleaved
(rounds of median replay times), per call; each variant's outputs bit for bit its two-launch counterpart's.
Roofline: the touched experts' weight bytes (T x 9 distinct ids x 3 x 1024 x 2304 x 2 B, at most) at 4.27 TB/s.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch
from graph_timing import replay_ms, warm_up, write_result

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import moe_experts as mx
from tokenspeed.ops.triton import moe_fused

HBM = 4.27e12
E, K_ROUTED, D, DI = 256, 8, 2304, 1024
LAYERS, CALLS = 4, 8


def make_calls(T: int, gen: torch.Generator, weights: list) -> list[dict]:
    """CALLS argument sets: layer i % LAYERS, random distinct routed ids per token plus the shared id E."""
    calls = []
    for i in range(CALLS):
        routed = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K_ROUTED] for _ in range(T)])
        ids = torch.cat([routed, torch.full((T, 1), E, device="cuda", dtype=routed.dtype)], 1)
        w = torch.rand(T, K_ROUTED + 1, device="cuda", generator=gen)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        res = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        calls.append({"w": weights[i % LAYERS], "x": x, "ids": ids, "tw": w, "res": res})
    return calls


def run_calls(calls: list[dict], cfg, norm_w: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for c in calls:
        w1, w3, w2 = c["w"]
        normed, _ = mx.moe_experts(c["x"], w1, w3, w2, c["tw"], c["ids"], Activation("silu"), residual=c["res"],
                                   norm_weight=norm_w, config=cfg)
        outs.append(normed)
    return outs


def capture(calls, cfg, norm_w, fused: bool, knobs: dict):
    """(graph, outputs, residency) of the CALLS calls under cfg with the fused launch on / off and the
    `moe_fused` module knobs (PROGRAMS_PER_SM, DYNAMIC, PREFETCH_W2) set."""
    moe_fused.FUSED = fused
    for name, value in {**DEFAULT_KNOBS, **knobs}.items():
        setattr(moe_fused, name, value)
    moe_fused._resident.clear()
    warm_up(lambda: run_calls(calls, cfg, norm_w), 2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run_calls(calls, cfg, norm_w)
    g.replay()
    torch.cuda.synchronize()
    return g, [o.clone() for o in outs], dict(moe_fused._resident)


DEFAULT_KNOBS = {"PROGRAMS_PER_SM": moe_fused.PROGRAMS_PER_SM, "DYNAMIC": moe_fused.DYNAMIC,
                 "PREFETCH_W2": moe_fused.PREFETCH_W2}


def variants(T: int, base, sweep: bool) -> list[tuple[str, object, bool, dict]]:
    """(label, config, fused, knobs): the two launches and the fused launch; with `sweep` the order / residency /
    prefetch grid and two other tile shapes."""
    out = [("two", base, False, {}), ("fused", base, True, {}),
           ("fused_dyn_cap3", base, True, {"DYNAMIC": True, "PROGRAMS_PER_SM": 3})]
    if not sweep:
        return out
    for cap in (1, 2, 3):
        for dyn in (False, True):
            for pf in (False, True):
                label = f"fused_cap{cap}" + ("_dyn" if dyn else "") + ("_pf" if pf else "")
                if label not in ("fused_cap2", "fused_cap3_dyn"):
                    out.append((label, base, True, {"PROGRAMS_PER_SM": cap, "DYNAMIC": dyn, "PREFETCH_W2": pf}))
    for bn1, bn2 in ((64, 128), (16, 64)):
        c = replace(base, block_n1=bn1, block_n2=bn2)
        out.append((f"two_n{bn1}x{bn2}", c, False, {}))
        out += [(f"fused_n{bn1}x{bn2}_cap{cap}_dyn", c, True, {"PROGRAMS_PER_SM": cap, "DYNAMIC": True})
                for cap in (2, 3)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe_fused_h200.json")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--sweep-tokens", default="1", help="T values that also run the tile / cap grid")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [tuple(torch.randn(E + 1, *s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                     for s in ((DI, D), (DI, D), (D, DI))) for _ in range(LAYERS)]
    norm_w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    sweep = {int(t) for t in args.sweep_tokens.split(",") if t}
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        calls = make_calls(T, gen, weights)
        base = replace(mx.default_config(T, K_ROUTED + 1, E + 1, D, DI), direct_max_tokens=T)
        graphs, outs, refs = {}, {}, {}
        for label, cfg, fused, knobs in variants(T, base, T in sweep):
            g, o, resident = capture(calls, cfg, norm_w, fused, knobs)
            graphs[label], outs[label] = g, o
            refs[label] = (cfg, fused, knobs, resident)
        times = {label: [] for label in graphs}
        for _ in range(args.rounds):
            for label, g in graphs.items():
                times[label].append(replay_ms(g, 20, 2) * 1e3 / CALLS)
        touched = statistics.mean(len(set(c["ids"].flatten().tolist())) for c in calls)
        roof = touched * 3 * DI * D * 2 / HBM * 1e6
        for label in graphs:
            cfg, fused, knobs, resident = refs[label]
            two = f"two_n{cfg.block_n1}x{cfg.block_n2}" if f"two_n{cfg.block_n1}x{cfg.block_n2}" in outs else "two"
            us = statistics.median(times[label])
            row = {"T": T, "label": label, "fused": fused, **knobs, "block_n1": cfg.block_n1,
                   "block_n2": cfg.block_n2, "programs_per_sm": max(resident.values()) if resident else None,
                   "us_per_call": us, "rounds_us": times[label], "roofline_us": roof, "pct_hbm": 100 * roof / us,
                   "bit_equal_to_two_launches": all(torch.equal(a, b) for a, b in zip(outs[label], outs[two]))}
            rows.append(row)
            print(f"T {T} {label:22s} {us:7.2f} us/call  roof {roof:6.2f} ({row['pct_hbm']:5.1f}%)  "
                  f"per_sm {row['programs_per_sm']}  bit_equal {row['bit_equal_to_two_launches']}", flush=True)
        del graphs
        torch.cuda.empty_cache()
    write_result(args.out, {"rows": rows}, geometry="kimi-linear-48b-a3b MoE (256 + folded shared, k 9)")


if __name__ == "__main__":
    main()
