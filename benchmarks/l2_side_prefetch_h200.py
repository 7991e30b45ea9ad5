"""Does a side-stream L2 prefetch of the next weights pay during a latency-bound kernel? One H200, CUDA graphs.

    PYTHONPATH=benchmarks:. python benchmarks/l2_side_prefetch_h200.py --out benchmarks/results

The chain (batch 1, bf16, Kimi-Linear shapes): producer -> projection, where the producer is a one-program kernel
spinning --spins microseconds (the KDA recurrence or MLA attention before o_proj) and the projection is
    o_proj     [2304 x 4096]  18.9 MB, the Triton GEMV (the routing table's config)
    experts    the routed experts at T = 1 with the folded shared expert (9 of 257 experts, 127 MB), the shared
               expert's 14.2 MB being what a prefetch can know in advance
Each graph holds --chains chains on rotating weight sets (> 3x the L2, so every chain starts cold); a case named
with "_warm" (o_proj_warm) keeps one weight set, so from the second chain on the projection reads a warm L2: what
the kernel takes when its bytes come from L2, the most a prefetch could give. Variants:
"none", and "side": an L2 prefetch of the projection's known weights (`cp.async.bulk.prefetch.L2.global`, 4 KiB requests)
issued right before the producer on a side stream (joined at the graph's end). Per chain: median us of graph replays / chains, and
the gain of "side" over "none" at the same spin; the spin alone is timed too, so "projection after the spin" =
chain - spin. Outputs are compared across variants (a prefetch changes no result: bit-equal expected).

Measured at accfa73 (H200, `results/l2_side_prefetch_h200_accfa73.json`): no gain. o_proj after a 6 / 11 us
spin 7.20 / 7.04 us cold, 7.08 / 7.05 with the side prefetch; from a warm L2 still 6.17 us: the batch-1 GEMV is
bound by its own dependent round trips (wait, x, tiles, the split-K reduction), not by HBM. The experts at T = 1
37.5 us with or without the shared expert prefetched. The same prefetch forked inside the kimi-linear-48b-a3b
decode step (o_proj, router and shared expert after each layer's input projection) made it 1-2% slower at batch
1 / 4 / 16 (2.658 vs 2.630 ms at batch 1, logits bit-equal), so the engine does not carry it.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from gemv_pdl_chain_h200 import produce  # benchmarks/ (the script's folder is on sys.path)
from graph_timing import replay_ms, warm_up, write_result

from tokenspeed import ops
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton._utils import l2_prefetch_bulk

E, TOP_K, D, DI = 256, 8, 2304, 1024
ROTATE_BYTES = 256 << 20
PIECE, PIECES = 4096, 64  # bytes per bulk prefetch request; requests per program (256 KiB, one warp)


@triton.jit(do_not_specialize=["nbytes"])
def _l2_prefetch_kernel(base, nbytes, PIECE: tl.constexpr, PIECES: tl.constexpr):
    """`cp.async.bulk.prefetch.L2.global` over bytes [0, nbytes) of `base` (the last piece rounded down to 16)."""
    start = tl.program_id(0).to(tl.int64) * (PIECE * PIECES) + tl.arange(0, PIECES).to(tl.int64) * PIECE
    size = tl.minimum(tl.maximum(nbytes - start, 0), PIECE).to(tl.int32) // 16 * 16
    l2_prefetch_bulk(base + start, size)


class SidePrefetch:
    """fork(tensors): after the work issued so far on the current stream, an L2 prefetch of `tensors` (contiguous,
    16-byte aligned) on a side stream; join(): the current stream waits for it (before a capture ends)."""

    def __init__(self) -> None:
        self.side = torch.cuda.Stream()
        self.forked = False

    def fork(self, tensors: list[torch.Tensor]) -> None:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                _l2_prefetch_kernel[(triton.cdiv(nbytes, PIECE * PIECES),)](t.view(-1).view(torch.uint8), nbytes,
                                                                           PIECE=PIECE, PIECES=PIECES, num_warps=1)
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)
        self.forked = False


PREFETCH: SidePrefetch | None = None  # made in main() (needs CUDA)


def weight_sets(case: str, gen: torch.Generator) -> list[dict]:
    """Enough weight sets of `case` to exceed ROTATE_BYTES; each {"w": ..., "known": [tensors to prefetch]}."""
    sets = []
    total = 0
    while total < (1 if case.endswith("_warm") else ROTATE_BYTES):
        if case.startswith("o_proj"):
            w = torch.randn(D, 4096, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            sets.append({"w": w, "known": [w]})
            total += w.numel() * 2
        else:  # experts: 257 stacked experts are 3.6 GB; stack only the 9 a token uses (ids 0..8, shared = 8)
            n = TOP_K + 1
            w1, w3 = (torch.randn(n, DI, D, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
                      for _ in range(2))
            w2 = torch.randn(n, D, DI, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            sets.append({"w": (w1, w3, w2), "known": [w1[TOP_K], w3[TOP_K], w2[TOP_K]]})
            total += 3 * w1.numel() * 2
    return sets


def make_chain(case: str, sets: list[dict], src: torch.Tensor, x: torch.Tensor, cycles: int, side: bool,
               project: bool):
    ids = torch.arange(TOP_K + 1, device="cuda").view(1, -1)
    weights = torch.full((1, TOP_K + 1), 1.0 / TOP_K, device="cuda")

    def chain(i: int):
        s = sets[i % len(sets)]
        if side:
            PREFETCH.fork(s["known"])
        produce(src, x, cycles, True)
        if not project:
            return x
        if case.startswith("o_proj"):
            return ops.linear(x.view(1, -1), s["w"])
        w1, w3, w2 = s["w"]
        return ops.moe_experts(x.view(1, -1)[:, :D], w1, w3, w2, weights, ids, Activation("silu"))

    return chain


def time_graph(chain, n: int, reps: int) -> tuple[float, torch.Tensor]:
    def run():
        outs = [chain(i) for i in range(n)]
        PREFETCH.join()
        return outs[-1]

    warm_up(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    ms = replay_ms(graph, reps, warmup=2)
    torch.cuda.synchronize()
    return ms * 1e3 / n, out.clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spins", default="3,6,11", help="producer spin, microseconds (at --clock-ghz)")
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--chains", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cases", default="o_proj,o_proj_warm,experts")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    global PREFETCH
    PREFETCH = SidePrefetch()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for case in args.cases.split(","):
        sets = weight_sets(case, gen)
        width = 4096 if case.startswith("o_proj") else D
        src = torch.randn(width, generator=gen, device="cuda", dtype=torch.bfloat16)
        x = torch.empty_like(src)
        for spin in (float(s) for s in args.spins.split(",")):
            cycles = int(spin * args.clock_ghz * 1e3)
            spin_us, _ = time_graph(make_chain(case, sets, src, x, cycles, False, False), args.chains, args.reps)
            res = {}
            for side in (False, True):
                us, out = time_graph(make_chain(case, sets, src, x, cycles, side, True), args.chains, args.reps)
                res[side] = (us, out)
            equal = torch.equal(res[False][1], res[True][1])
            row = {"case": case, "spin_us_asked": spin, "spin_chain_us": spin_us, "none_us": res[False][0],
                   "side_us": res[True][0], "projection_none_us": res[False][0] - spin_us,
                   "projection_side_us": res[True][0] - spin_us, "gain_us": res[False][0] - res[True][0],
                   "bit_equal": equal}
            rows.append(row)
            print(f"{case:8s} spin {spin:4.1f} us (chain {spin_us:6.2f}): none {row['none_us']:7.2f} side "
                  f"{row['side_us']:7.2f} us/chain; projection {row['projection_none_us']:6.2f} -> "
                  f"{row['projection_side_us']:6.2f} us (gain {row['gain_us']:+.2f}); bit-equal {equal}", flush=True)
    write_result(os.path.join(args.out, "l2_side_prefetch_h200.json"), {"rows": rows})


if __name__ == "__main__":
    main()
