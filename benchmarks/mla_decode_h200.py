"""Paged absorbed-MLA decode on one H200: balanced vs uniform split-KV, against the HBM roofline.

    PYTHONPATH=. python benchmarks/mla_decode_h200.py --out benchmarks/results/mla_decode_h200.json

Shape: Kimi-Linear-48B MLA layers, H = 32 query heads, latent row Dl = 576 (kv_lora_rank 512 + rope 64),
v_dim 512, page_size 64, bf16 cache and queries, Q = 1 (decode; --verify adds Q = 4 rows). Cases: (a) mixed
histories, batch 16 cycling 65536 / 16384 / 4096 / 1024; (b) equal-length controls, 16 x 16384, 64 x 4096,
1 x 65536. Pages are handed out in random order.

Per case and plan (balanced / uniform, default max_splits = default_max_splits): the median of 50 timed calls
with CUDA events after warm-up, with the L2 cleared (a 256 MiB memset) before each call, as
triton.testing.do_bench does (`us`); and the per-call time from a CUDA graph of 10 calls (how the engine runs
decode), each preceded by the same memset inside the graph, a graph of the memsets alone subtracted
(`graph_us`). Bytes = sum(kv_len) * Dl * 2 (every latent row read once); `hbm_frac` = bytes / time / 4.27 TB/s
(the measured copy rate of shared/docs/h200-baseline.md). `speedup` = uniform time / balanced time. The torch
reference `_paged_decode` (padded to the longest history, fp32) is timed where its fp32 gather fits in memory,
and every timed case is checked against it once (max relative error in the JSON). --sweep also times a few
launch configurations (BLOCK_H, BLOCK_N, num_warps, num_stages) and max_splits (waves) on the mixed case.
Writes the JSON to --out and prints a table. --smoke: tiny fp32 shapes on the CPU interpreter (plumbing only).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import time

import torch
from graph_timing import replay_ms, warm_up  # benchmarks/graph_timing.py (the script's own folder is on sys.path)

from tokenspeed.ops.reference.mla import _paged_decode

k_mla = None  # tokenspeed.ops.triton.mla_decode, imported by main() (after TRITON_INTERPRET for --smoke)

HBM = 4.27e12  # bytes/s
H, DL, V, PAGE = 32, 576, 512, 64


def make_case(kv_lens, Q, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = len(kv_lens)
    pages = [-(-k // PAGE) for k in kv_lens]
    W = max(pages)
    P = sum(pages)
    perm = torch.randperm(P, generator=g).to(torch.int32)
    table = torch.zeros(N, W, dtype=torch.int32)
    off = 0
    for n, np_ in enumerate(pages):
        table[n, :np_] = perm[off:off + np_]
        off += np_
    cache = torch.randn(P, PAGE, DL, dtype=dtype, device=device)
    q = torch.randn(N, Q, H, DL, dtype=dtype, device=device)
    return q, cache, table.to(device), torch.tensor(kv_lens, dtype=torch.int64, device=device)


_FLUSH = None


def _flush():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    _FLUSH.zero_()


def time_us(fn, iters=50, warmup=5, smoke=False) -> float:
    """Median per-call GPU time (CUDA events), L2 cleared before each call."""
    if smoke:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        _flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2] * 1e3


def graph_us(fn, n=10, reps=10, smoke=False) -> float:
    """Per-call time of `fn` replayed from a CUDA graph of n calls, each after an L2-clearing memset (the memsets'
    own graph subtracted)."""
    if smoke:
        return float("nan")
    _flush()
    warm_up(fn)

    def capture(with_fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                _flush()
                if with_fn:
                    fn()
        return g

    def median_ms(g):
        return replay_ms(g, reps)

    try:
        return max(median_ms(capture(True)) - median_ms(capture(False)), 0.0) / n * 1e3
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print("graph timing failed:", type(e).__name__, e)
        return float("nan")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def ref_fits(kv_lens, Q) -> bool:
    """_paged_decode gathers [N, max_len, Dl] fp32 (plus a few like it); keep it under ~1/4 of free memory."""
    if Q != 1 or not torch.cuda.is_available():
        return Q == 1
    need = 3 * len(kv_lens) * max(kv_lens) * DL * 4
    return need < torch.cuda.mem_get_info()[0] / 4


def bench_case(name, kv_lens, Q, args, rows, configs=None):
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    q, cache, table, lens = make_case(kv_lens, Q, dtype, dev)
    scale = DL ** -0.5
    nbytes = sum(kv_lens) * DL * cache.element_size()
    ref = ref_us = None
    if ref_fits(kv_lens, Q):
        def ref_fn():
            return _paged_decode(q.view(len(kv_lens), H, DL), cache, table, kv_lens, scale, V, 1.0)
        ref = ref_fn().view(len(kv_lens), Q, H, V)
        ref_us = time_us(ref_fn, iters=5, warmup=1, smoke=args.smoke)
    qh = Q * H
    for cfg_name, cfg in (configs or {"default": {}}).items():
        times = {}
        for plan in ("balanced", "uniform"):
            kw = dict(cfg)
            kw["balanced"] = plan == "balanced"
            waves = kw.pop("waves", None)
            if waves is not None:
                kw["max_splits"] = k_mla.default_max_splits(len(kv_lens), qh, block_h=kw.get("BLOCK_H"), waves=waves)
            if args.smoke:
                kw["min_chunk"] = 16
                kw.setdefault("BLOCK_N", 16)
                kw.setdefault("max_splits", 3)

            def fn(kw=kw):
                return k_mla.mla_decode(q, cache, table, lens, scale, V, **kw)

            try:
                out = fn()
                err = rel(out, ref) if ref is not None else None
                t = time_us(fn, iters=args.iters, smoke=args.smoke)
                tg = graph_us(fn, smoke=args.smoke) if not args.no_graph else float("nan")
            except Exception as e:  # noqa: BLE001 - a config that does not compile / fit: reported, not fatal
                print(f"{name} {cfg_name} {plan}: {type(e).__name__}: {str(e)[:200]}")
                continue
            ms = kw.get("max_splits") or k_mla.default_max_splits(len(kv_lens), qh, block_h=kw.get("BLOCK_H"))
            _, counts = k_mla.plan_splits(kv_lens, ms, kw["balanced"], kw.get("BLOCK_N", 32),
                                          kw.get("min_chunk", k_mla.MIN_CHUNK))
            times[plan] = t
            row = {
                "case": name, "config": cfg_name, "plan": plan, "Q": Q, "batch": len(kv_lens),
                "kv_lens": sorted(set(kv_lens)), "max_splits": ms, "total_splits": sum(counts),
                "max_split_rows": max((-(-k // c) if c else 0) for k, c in zip(kv_lens, counts)),
                "us": t, "graph_us": tg, "bytes": nbytes, "hbm_frac": nbytes / (t * 1e-6) / HBM,
                "graph_hbm_frac": (nbytes / (tg * 1e-6) / HBM) if not math.isnan(tg) and tg > 0 else None,
                "roofline_us": nbytes / HBM * 1e6, "ref_us": ref_us, "max_rel_err": err,
                "launch": {k: v for k, v in kw.items() if k != "balanced"},
            }
            rows.append(row)
            print(f"{name:22s} {cfg_name:18s} {plan:9s} Q{Q} splits {ms:4d}/{sum(counts):5d}  {t:9.2f} us  "
                  f"graph {tg:9.2f} us  {row['hbm_frac'] * 100:5.1f}% HBM  ref {ref_us or float('nan'):10.1f} us  "
                  f"err {err if err is not None else float('nan'):.1e}", flush=True)
        if len(times) == 2:
            rows[-2]["speedup_vs_uniform"] = times["uniform"] / times["balanced"]
            print(f"{'':22s} {cfg_name:18s} balanced/uniform speedup {times['uniform'] / times['balanced']:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/mla_decode_h200.json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--verify", action="store_true", help="also Q = 4 (verify) on the mixed and 16 x 16K cases")
    ap.add_argument("--sweep", action="store_true", help="also launch configurations / waves on the mixed case")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU interpreter")
    args = ap.parse_args()
    t0 = time.time()
    global H, DL, V, PAGE, k_mla
    if args.smoke:
        H, DL, V, PAGE = 4, 40, 32, 8
        os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import
    k_mla = importlib.import_module("tokenspeed.ops.triton.mla_decode")
    import triton
    if args.smoke:
        cases = [("mixed", [300, 80, 20, 5] * 2), ("equal", [100] * 4)]
    else:
        cases = [("mixed_b16", [65536, 16384, 4096, 1024] * 4), ("equal_16x16k", [16384] * 16),
                 ("equal_64x4k", [4096] * 64), ("equal_1x64k", [65536])]
    rows: list[dict] = []
    for name, lens in cases:
        bench_case(name, lens, 1, args, rows)
    if args.verify:
        for name, lens in cases[:2]:
            bench_case(name, lens, 4, args, rows)
    if args.sweep:
        configs = {
            "waves1": {"waves": 1.0}, "waves4": {"waves": 4.0},
            "H16_N32_w4_s2": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
            "H16_N32_w4_s3": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
            "H32_N64_w8_s2": {"BLOCK_H": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
            "H32_N32_w8_s3": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
            "H32_N16_w8_s4": {"BLOCK_H": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 4},
        }
        bench_case(cases[0][0], cases[0][1], 1, args, rows, configs)
    meta = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "hbm_bytes_per_s": HBM, "H": H, "Dl": DL, "v_dim": V, "page_size": PAGE, "min_chunk": k_mla.MIN_CHUNK,
        "wall_s": time.time() - t0, "smoke": args.smoke,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'case':22s} {'config':18s} {'plan':9s} {'Q':>2s} {'us':>9s} {'graph_us':>9s} {'HBM%':>6s} "
          f"{'speedup':>8s} {'ref_us':>10s}")
    for r in rows:
        sp = r.get("speedup_vs_uniform")
        print(f"{r['case']:22s} {r['config']:18s} {r['plan']:9s} {r['Q']:2d} {r['us']:9.2f} {r['graph_us']:9.2f} "
              f"{r['hbm_frac'] * 100:6.1f} {(f'{sp:.2f}x' if sp else ''):>8s} {r['ref_us'] or float('nan'):10.1f}")
    print(f"wrote {args.out} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
