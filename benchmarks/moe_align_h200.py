"""The MoE alignment of prefill-sized calls on one H200: the torch sort path (`align_pairs`) against the
multi-program Triton kernels (`align_pairs_multi`), bit-equal outputs checked first.

    PYTHONPATH=. python benchmarks/moe_align_h200.py --out benchmarks/results

Per shape (tokens x (top-k + 1) pairs over 257 buckets, Kimi-Linear with its folded shared expert): the host time of
one call (wall time to return, nothing synchronised: what the eager forward's Python pays per MoE layer) and the GPU
time (CUDA events around 26 calls, one per MoE layer, divided by 26), medians of 20.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from graph_timing import events_ms, write_result

from tokenspeed.ops.triton.moe_align import align_pairs, align_pairs_multi


def host_us(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", default="463,1315,4096,8192")
    ap.add_argument("--block-m", default="16,64,128")
    args = ap.parse_args()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (int(t) for t in args.tokens.split(",")):
        ids = torch.rand(T, 256, device="cuda", generator=g).argsort(-1)[:, :8]
        ids = torch.cat([ids, torch.full((T, 1), 256, device="cuda")], dim=1)  # the folded shared expert
        for bm in (int(b) for b in args.block_m.split(",")):
            ref = align_pairs(ids, 257, bm)
            got = align_pairs_multi(ids, 257, bm)
            row = {"tokens": T, "pairs": T * 9, "block_m": bm,
                   "equal": bool(torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]))}
            for name, fn in (("torch", align_pairs), ("multi", align_pairs_multi)):
                row[f"{name}_host_us"] = host_us(lambda fn=fn, ids=ids, bm=bm: fn(ids, 257, bm))
                row[f"{name}_gpu_us"] = events_ms(
                    lambda fn=fn, ids=ids, bm=bm: [fn(ids, 257, bm) for _ in range(26)]) * 1e3 / 26
            print(row, flush=True)
            rows.append(row)
    write_result(os.path.join(args.out, "moe_align_h200.json"), {"rows": rows})


if __name__ == "__main__":
    main()
