"""MLA decode of one sequence over a long history (the agentic workload's batch-1 step: 32K-128K tokens), on one
H200: split + combine against the cache-read floor, across split counts, and where the time goes.

    PYTHONPATH=.:benchmarks python benchmarks/mla_b1_long_h200.py --out benchmarks/results/mla_b1_long_h200.json

Kimi-Linear's MLA (32 heads, latent 512 + rope 64), page 16 (the server's), bf16 and fp8 caches. For each history
length and each split budget (`mla_decode.default_max_splits(..., waves=w)`: w x 132 programs; the default is
DEFAULT_WAVES) and each combine tiling (TOKENSPEED_MLA_COMBINE_MAX_S 16, the former 16-slot blocks, and the
default `combine_tiles`), `mla_decode` (split + combine, the Gluon split kernel where it applies) timed as
`mla_decode_h200.graph_us` does (a CUDA graph of 20 calls, each after an L2-clearing memset, memsets subtracted),
outputs compared with the default budget's; then one eager call per length under torch.profiler (CUPTI): each
kernel's device time. Floor: the cache rows read once at 4.27 TB/s (the fp32 partials, 2 x splits x 32 x 516 x 4
B through L2, are listed beside it).
"""

from __future__ import annotations

import argparse
import collections
import math
import os

import torch
from graph_timing import write_result
from mla_decode_h200 import DL, HBM, H, V, graph_us, make_case, rel

from tokenspeed.ops.triton import mla_decode as k_mla
from tokenspeed.ops.triton import mla_gluon

PAGE = 16


def kernel_times(fn, reps: int = 5) -> dict[str, float]:
    """Mean device time (us) per call of each kernel fn() launches (torch.profiler, eager, after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:60]] += e.device_time / reps
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/mla_b1_long_h200.json")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--waves", default="0.5,1,2")
    ap.add_argument("--dtypes", default="bf16,fp8")
    args = ap.parse_args()
    mla_gluon.SMALL_PAGES = True
    mla_gluon.FP8_CACHE = True
    scale = 1.0 / math.sqrt(192)
    rows = []
    for dt in args.dtypes.split(","):
        cache_dtype = torch.float8_e4m3fn if dt == "fp8" else torch.bfloat16
        for ctx in [int(c) for c in args.contexts.split(",")]:
            q, cache, table, kv = make_case([ctx], 1, torch.bfloat16, "cuda", page=PAGE, cache_dtype=cache_dtype)
            default = k_mla.default_max_splits(1, H)
            want = k_mla.mla_decode(q, cache, table, kv, scale, V)
            floor_us = ctx * DL * cache.element_size() / HBM * 1e6
            for w, cap in [(float(x), c) for x in args.waves.split(",") for c in (16, k_mla.COMBINE_MAX_BLOCK_S)]:
                ms = k_mla.default_max_splits(1, H, waves=w)

                def fn(ms=ms):
                    return k_mla.mla_decode(q, cache, table, kv, scale, V, max_splits=ms)

                os.environ[k_mla.COMBINE_ENV] = str(cap)
                got = fn()
                us = graph_us(fn, n=20)
                os.environ.pop(k_mla.COMBINE_ENV)
                chunks, splits = k_mla.plan_splits([ctx], ms, block_n=mla_gluon.BLOCK_N)
                row = {"dtype": dt, "ctx": ctx, "waves": w, "combine_max_s": cap,
                       "combine_tiles": k_mla.combine_tiles(ms, V) if cap > 16 else (16, 128), "max_splits": ms, "splits": splits[0], "chunk": chunks[0],
                       "us": us, "floor_us": floor_us, "pct_hbm": 100 * floor_us / us,
                       "partials_mb": 2 * splits[0] * H * (V + 4) * 4 / 1e6, "rel_err_vs_default": rel(got, want),
                       "default": ms == default}
                rows.append(row)
                print(f"{dt} ctx {ctx:6d} combine<= {cap:3d} waves {w:4.2f} splits {splits[0]:4d} x {chunks[0]:5d}: {us:7.2f} us  "
                      f"floor {floor_us:6.2f} ({row['pct_hbm']:4.1f}%)  err {row['rel_err_vs_default']:.1e}"
                      + ("  (default)" if row["default"] else ""), flush=True)
            kt = kernel_times(lambda: k_mla.mla_decode(q, cache, table, kv, scale, V))
            rows.append({"dtype": dt, "ctx": ctx, "kernels_us": kt})
            print(f"{dt} ctx {ctx:6d} kernels (eager, us): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kt.items(), key=lambda x: -x[1])), flush=True)
            del q, cache, table, kv
            torch.cuda.empty_cache()
    write_result(args.out, {"rows": rows}, page=PAGE, heads=H)


if __name__ == "__main__":
    main()
