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

--policies (alone: the cases above are skipped) sweeps the split policy instead, in one run (~30 s on an H200):
batch 1 / 4 / 16 / 64 x context 4096 / 32768 (equal lengths, Q = 1), each with min_chunk 64 / 128 / 256 / 512 rows
x max_splits = default_max_splits at 2 waves (the default) or 1 wave, or that capped at 32 / 16 / 8 (pairs that
give the same launch are timed once); the default policy also with PDL off (TOKENSPEED_PDL=0). Per config: the
split + combine time from a CUDA graph of 20 calls, each after an L2-clearing memset (a graph of the memsets
alone subtracted), the splits per sequence, and the partial bytes (written by the split kernel, read back by
the combine); the output is checked against the first policy's (mc64_w2). Prints a policy x shape table and the best
policy per shape; writes --out (default benchmarks/results/mla_decode_policies_h200.json).

--ragged (alone: the cases above are skipped) times one MLA layer's attention (`MLAAttention._attend`: the q
absorption, attention, the W_UV product; Kimi-Linear-48B's layer, bf16, random weights) on mixed batches, ~20 s
on an H200: a tail of 16 / 64 / 128 / 256 / 1024 new tokens on a 16K history, alone and beside 15 decodes at 4K.
Forms: `today` (the composition before the ragged kernel: the torch absorbed reference for sequences of <= 8 new
tokens, the expanded form for longer ones, gathers between), `ragged` (the whole batch through the ragged
absorbed kernel, ABSORBED_MAX_TAIL unbounded), `split` (beside decodes only: the tail expanded, the decodes
through the ragged kernel, as with a tail over ABSORBED_MAX_TAIL), and `kernel` (the ragged `mla_decode` call
alone, on absorbed queries). Per form: the median of 10 calls' CUDA-event time (host gaps included: the
reference and the gathers wait on the host) and the max relative error against `today`. Writes --out (default
benchmarks/results/mla_ragged_h200.json) and prints a table with the ragged / today and ragged / split ratios:
ABSORBED_MAX_TAIL (tokenspeed/models/kimi/mla.py) belongs below the tails where `split` beats `ragged`.

--loops (alone) times the split kernel's key-loop forms (`rows`: scores [rows, keys], mma.sync at 32 rows;
`keys`: scores [keys, rows], wgmma; `uniform_plan`: with UNIFORM_PLAN; `fp8`:
the same over an fp8 copy of the cache) and launch configs at min_chunk 64 / 128 / 256, split + combine as
--policies, over batch 1 / 4 / 16 / 64 x 4K / 32K and the mixed batch (16 x 64K/16K/4K/1K); HBM% = cache bytes /
time / 4.27 TB/s. Every form's output is checked against the first of its cache dtype. Writes --out (default
benchmarks/results/mla_loops_h200.json).
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


def make_case(kv_lens, Q, dtype, device, seed=0, heads=H, page=PAGE, cache_dtype=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = len(kv_lens)
    pages = [-(-k // page) for k in kv_lens]
    W = max(pages)
    P = sum(pages)
    perm = torch.randperm(P, generator=g).to(torch.int32)
    table = torch.zeros(N, W, dtype=torch.int32)
    off = 0
    for n, np_ in enumerate(pages):
        table[n, :np_] = perm[off:off + np_]
        off += np_
    cache = torch.randn(P, page, DL, dtype=dtype, device=device).to(cache_dtype or dtype)
    q = torch.randn(N, Q, heads, DL, dtype=dtype, device=device)
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
            bn = k_mla.launch_block_n(cache.dtype, kw.get("keys_major"), kw.get("BLOCK_N"))
            _, counts = k_mla.plan_splits(kv_lens, ms, kw["balanced"], bn,
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


POLICY_BATCHES = (1, 4, 16, 64)
POLICY_CONTEXTS = (4096, 32768)
POLICY_MIN_CHUNKS = (64, 128, 256, 512)
POLICY_SPLITS = ("w2", "w1", "cap32", "cap16", "cap8")  # w2 = the default (DEFAULT_WAVES = 2)


def policy_max_splits(kind: str, batch: int, q_rows: int) -> int:
    """max_splits of a named policy: default_max_splits at 2 or 1 waves, or the 2-wave value capped."""
    if kind.startswith("w"):
        return k_mla.default_max_splits(batch, q_rows, waves=float(kind[1:]))
    return min(k_mla.default_max_splits(batch, q_rows, waves=2.0), int(kind[3:]))


def policy_case(batch: int, ctx: int, args, rows: list[dict]) -> None:
    """Every (min_chunk, max_splits) policy on `batch` sequences of `ctx` rows (see --policies)."""
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    lens = [ctx] * batch
    q, cache, table, kv = make_case(lens, 1, dtype, dev)
    scale = DL ** -0.5
    base = None
    seen = set()
    runs = [(mc, kind, True) for kind in POLICY_SPLITS for mc in POLICY_MIN_CHUNKS] + [(k_mla.MIN_CHUNK, "w2", False)]
    for mc, kind, pdl_on in runs:
        ms = policy_max_splits(kind, batch, H)
        if (ms, mc, pdl_on) in seen:
            continue
        seen.add((ms, mc, pdl_on))
        kw = {"max_splits": ms, "min_chunk": mc}
        if args.smoke:
            kw["BLOCK_N"] = 16

        def fn(kw=kw):
            return k_mla.mla_decode(q, cache, table, kv, scale, V, **kw)

        saved = os.environ.get("TOKENSPEED_PDL")
        os.environ["TOKENSPEED_PDL"] = "1" if pdl_on else "0"  # read by pdl.enabled at each launch (capture)
        try:
            out = fn()
            base = out.clone() if base is None else base
            t = graph_us(fn, n=20, smoke=args.smoke)
        finally:
            if saved is None:
                os.environ.pop("TOKENSPEED_PDL", None)
            else:
                os.environ["TOKENSPEED_PDL"] = saved
        chunks, counts = k_mla.plan_splits(lens, ms, True, k_mla.launch_block_n(cache.dtype, None, kw.get("BLOCK_N")),
                                           mc)
        part_bytes = (sum(counts) if counts[0] > 1 else 0) * H * V * 4
        row = {"batch": batch, "ctx": ctx, "policy": f"mc{mc}_{kind}" + ("" if pdl_on else "_nopdl"),
               "min_chunk": mc, "max_splits": ms, "splits_per_seq": counts[0], "chunk": chunks[0],
               "partial_bytes": part_bytes, "cache_bytes": batch * ctx * DL * cache.element_size(), "us": t,
               "pdl": pdl_on, "max_rel_err_vs_first_policy": rel(out, base)}
        rows.append(row)
        print(f"b{batch:<3d} ctx {ctx:6d} {row['policy']:18s} ms {ms:4d} splits/seq {counts[0]:4d} chunk "
              f"{chunks[0]:6d} partials {part_bytes / 1e6:7.2f} MB  {t:8.2f} us", flush=True)


def _cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['us']:.2f}"


def print_policy_table(rows: list[dict]) -> None:
    shapes = sorted({(r["batch"], r["ctx"]) for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["policy"], r["batch"], r["ctx"]): r for r in rows}
    print("\nsplit + combine, us (CUDA graph, cold L2; '-' = same launch as a policy above)")
    print(f"{'policy':18s}" + "".join(f"{f'b{b}/{c // 1024}K':>10s}" for b, c in shapes))
    for p in policies:
        cells = [by.get((p, b, c)) for b, c in shapes]
        print(f"{p:18s}" + "".join(f"{_cell(r):>10s}" for r in cells))
    print("best per shape:")
    for b, c in shapes:
        cand = [r for r in rows if (r["batch"], r["ctx"]) == (b, c) and r["pdl"]]
        best = min(cand, key=lambda r: r["us"])
        dflt = by.get((f"mc{k_mla.MIN_CHUNK}_w2", b, c))
        print(f"  b{b}/{c // 1024}K: {best['policy']} {best['us']:.2f} us (splits/seq {best['splits_per_seq']}); "
              f"default {dflt['us'] if dflt else float('nan'):.2f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/mla_decode_h200.json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--verify", action="store_true", help="also Q = 4 (verify) on the mixed and 16 x 16K cases")
    ap.add_argument("--sweep", action="store_true", help="also launch configurations / waves on the mixed case")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU interpreter")
    ap.add_argument("--policies", action="store_true", help="only the split-policy sweep (batch x context)")
    ap.add_argument("--ragged", action="store_true", help="only the mixed-batch layer attention forms (ragged)")
    ap.add_argument("--loops", action="store_true", help="only the split kernel's key-loop forms and tiles")
    ap.add_argument("--uniform-plan", action="store_true", help="set mla_decode.UNIFORM_PLAN for the whole run")
    args = ap.parse_args()
    if args.loops and args.out == ap.get_default("out"):
        args.out = "benchmarks/results/mla_loops_h200.json"
    if args.policies and args.out == ap.get_default("out"):
        args.out = "benchmarks/results/mla_decode_policies_h200.json"
    if args.ragged and args.out == ap.get_default("out"):
        args.out = "benchmarks/results/mla_ragged_h200.json"
    t0 = time.time()
    global H, DL, V, PAGE, k_mla
    if args.smoke:
        H, DL, V, PAGE = 4, 40, 32, 8
        os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import
    k_mla = importlib.import_module("tokenspeed.ops.triton.mla_decode")
    k_mla.UNIFORM_PLAN = k_mla.UNIFORM_PLAN or args.uniform_plan
    import triton
    if args.smoke:
        cases = [("mixed", [300, 80, 20, 5] * 2), ("equal", [100] * 4)]
    else:
        cases = [("mixed_b16", [65536, 16384, 4096, 1024] * 4), ("equal_16x16k", [16384] * 16),
                 ("equal_64x4k", [4096] * 64), ("equal_1x64k", [65536])]
    rows: list[dict] = []
    if args.policies:
        return run_policies(args, t0, triton)
    if args.ragged:
        return run_ragged(args, t0, triton)
    if args.loops:
        return run_loops(args, t0, triton)
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
    write_result(args, t0, triton, rows, python=platform.python_version(), hbm_bytes_per_s=HBM, page_size=PAGE,
                 min_chunk=k_mla.MIN_CHUNK)
    print(f"\n{'case':22s} {'config':18s} {'plan':9s} {'Q':>2s} {'us':>9s} {'graph_us':>9s} {'HBM%':>6s} "
          f"{'speedup':>8s} {'ref_us':>10s}")
    for r in rows:
        sp = r.get("speedup_vs_uniform")
        print(f"{r['case']:22s} {r['config']:18s} {r['plan']:9s} {r['Q']:2d} {r['us']:9.2f} {r['graph_us']:9.2f} "
              f"{r['hbm_frac'] * 100:6.1f} {(f'{sp:.2f}x' if sp else ''):>8s} {r['ref_us'] or float('nan'):10.1f}")



def write_result(args, t0: float, triton, rows: list[dict], **extra) -> None:
    """Write {"meta", "rows"} to args.out; meta: the device, versions, commit (BENCH_COMMIT), date, the layer
    geometry, wall time, plus `extra` (what the mode measured and how)."""
    meta = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "commit": os.environ.get("BENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
        "H": H, "Dl": DL, "v_dim": V, "keys_major_default": str(k_mla.KEYS_MAJOR),
        "uniform_plan": k_mla.UNIFORM_PLAN, **extra, "wall_s": time.time() - t0, "smoke": args.smoke,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out} ({time.time() - t0:.1f} s)")

def run_policies(args, t0: float, triton) -> None:
    global POLICY_BATCHES, POLICY_CONTEXTS, POLICY_MIN_CHUNKS
    if args.smoke:
        POLICY_BATCHES, POLICY_CONTEXTS, POLICY_MIN_CHUNKS = (1, 3), (100,), (16, 32)
    rows: list[dict] = []
    for ctx in POLICY_CONTEXTS:
        for batch in POLICY_BATCHES:
            policy_case(batch, ctx, args, rows)
    print_policy_table(rows)
    write_result(args, t0, triton, rows, page_size=PAGE, Q=1, default_min_chunk=k_mla.MIN_CHUNK,
                 default_waves=k_mla.DEFAULT_WAVES,
                 timing="CUDA graph of 20 calls, each after a 256 MiB memset; memset-only graph subtracted; median "
                        "of 10")


RAGGED_TAILS = (16, 64, 128, 256, 1024)
RAGGED_HISTORY, RAGGED_DECODE_CTX, RAGGED_DECODES = 16384, 4096, 15


def ragged_layer(smoke: bool):
    """(MLAAttention of Kimi-Linear-48B (tiny-kimi-linear for --smoke) with random weights, its dtype, device)."""
    from tokenspeed.distributed import ParallelContext
    from tokenspeed.models import parse_hf_config, preset_hf_config
    from tokenspeed.models.kimi.mla import MLAAttention
    from tokenspeed.models.weights import init_dummy_weights

    config = parse_hf_config(preset_hf_config("tiny-kimi-linear" if smoke else "kimi-linear-48b-a3b"))
    dtype, dev = (torch.float32, "cpu") if smoke else (torch.bfloat16, "cuda")
    attn = MLAAttention(config, 0, ParallelContext(), dtype, dev).eval()
    init_dummy_weights(attn, seed=0)
    return attn, dtype, dev


def ragged_batch(attn, q_lens: list[int], kv_lens: list[int], dtype, dev, page: int):
    """(ForwardBatch, latent cache [P, page, Dl] random, queries [T, H, nope + rope]); pages in random order."""
    from tokenspeed.models.batch import ForwardBatch

    g = torch.Generator().manual_seed(0)
    need = [-(-k // page) for k in kv_lens]
    perm = torch.randperm(sum(need), generator=g).tolist()
    tables, off = [], 0
    for k in need:
        tables.append(perm[off:off + k])
        off += k
    ids = [[5] * q for q in q_lens]
    batch = ForwardBatch.build(ids, [k - q for k, q in zip(kv_lens, q_lens)], tables, list(range(len(q_lens))), page,
                               device=dev)
    cache = torch.randn(sum(need), page, attn.kv_lora_rank + attn.rope, generator=g).to(dtype).to(dev)
    q = torch.randn(sum(q_lens), attn.num_heads, attn.nope + attn.rope, generator=g).to(dtype).to(dev)
    return batch, cache, q


def ragged_forms(attn, batch, cache, q) -> dict:
    """name -> a thunk computing the batch's attention in that form (see --ragged)."""
    from tokenspeed import ops
    from tokenspeed.models.kimi import mla

    def attend(max_tail: int | None, kernel: bool):
        def fn():
            saved = mla.ABSORBED_MAX_TAIL, ops.mla_decode_kernel_usable
            mla.ABSORBED_MAX_TAIL = max_tail if max_tail is not None else saved[0]
            if not kernel:  # the layer then composes as before the ragged kernel existed
                ops.mla_decode_kernel_usable = lambda *a, **k: False
            try:
                return attn._attend(q, batch, cache, 1.0)
            finally:
                mla.ABSORBED_MAX_TAIL, ops.mla_decode_kernel_usable = saved
        return fn

    r, h = attn.kv_lora_rank, attn.num_heads
    q_lat = torch.randn(q.shape[0], h, r, dtype=q.dtype, device=q.device)
    max_q = max(batch.query_lens_host)
    forms = {"today": attend(None, False), "ragged": attend(10**9, True)}
    if batch.num_seqs > 1:
        forms["split"] = attend(8, True)
    forms["kernel"] = lambda: ops.mla_decode(q_lat, cache, batch.page_table, batch.kv_lens, attn.scale, r,
                                             q_rope=q[..., attn.nope:], cu_seqlens_q=batch.cu_seqlens, max_q=max_q)
    return forms


def ragged_case(attn, dtype, dev, tail: int, decodes: int, args, rows: list[dict]) -> None:
    """Every form of --ragged on one batch: a `tail`-token tail on the history beside `decodes` decodes."""
    from graph_timing import events_ms

    hist, ctx, page = (40, 20, 8) if args.smoke else (RAGGED_HISTORY, RAGGED_DECODE_CTX, PAGE)
    q_lens = [1] * decodes + [tail]
    kv_lens = [ctx] * decodes + [hist + tail]
    batch, cache, q = ragged_batch(attn, q_lens, kv_lens, dtype, dev, page)
    forms = ragged_forms(attn, batch, cache, q)
    times = {}
    with torch.no_grad():
        base = forms["today"]()
        for name, fn in forms.items():
            err = rel(fn(), base) if name != "kernel" else None
            if args.smoke:
                t = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t) * 1e3
            else:
                ms = events_ms(fn, reps=10, warmup=2)
            times[name] = ms
            rows.append({"tail": tail, "history": hist, "decodes": decodes, "decode_ctx": ctx, "form": name,
                         "ms": ms, "max_rel_err_vs_today": err})
            print(f"tail {tail:5d} + {decodes:2d} decodes  {name:7s} {ms:9.3f} ms  "
                  f"err {err if err is not None else float('nan'):.1e}", flush=True)
    rows[-1]["ragged_over_today"] = times["ragged"] / times["today"]
    if "split" in times:
        rows[-1]["ragged_over_split"] = times["ragged"] / times["split"]


def print_ragged_table(rows: list[dict]) -> None:
    forms = ("today", "ragged", "split", "kernel")
    print(f"\n{'tail':>5s} {'decodes':>7s} " + "".join(f"{f:>9s}" for f in forms) + "  ragged/today ragged/split")
    by = {(r["tail"], r["decodes"], r["form"]): r for r in rows}
    for tail, decodes in sorted({(r["tail"], r["decodes"]) for r in rows}, key=lambda k: (k[1], k[0])):
        cells = [by.get((tail, decodes, f)) for f in forms]
        last = by[(tail, decodes, "kernel")]
        print(f"{tail:5d} {decodes:7d} " + "".join(f"{c['ms']:9.3f}" if c else f"{'-':>9s}" for c in cells)
              + f"  {last['ragged_over_today']:12.2f} {last.get('ragged_over_split', float('nan')):11.2f}")


def run_ragged(args, t0: float, triton) -> None:
    """--ragged: every tail alone and beside the decodes; the table; the JSON."""
    global RAGGED_TAILS
    if args.smoke:
        RAGGED_TAILS = (3, 12)
        os.environ["TOKENSPEED_OPS"] = "triton"  # the interpreter serves the kernel on the CPU
    attn, dtype, dev = ragged_layer(args.smoke)
    rows: list[dict] = []
    for decodes in (0, 3 if args.smoke else RAGGED_DECODES):
        for tail in RAGGED_TAILS:
            ragged_case(attn, dtype, dev, tail, decodes, args, rows)
    print_ragged_table(rows)
    write_result(args, t0, triton, rows, layer="kimi-linear-48b-a3b MLA, bf16",
                 timing="median of 10 calls, CUDA events (host gaps included), after 2 warm-up calls")


# name -> mla_decode keywords of a key-loop form (the first: the rows-major launch, the default before keys-major);
# "fp8": over an fp8 e4m3 copy of the cache; "uniform_plan": with UNIFORM_PLAN set
LOOP_FORMS = {
    "rows_n32_w8_s2": {"keys_major": False, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    "keys_n64_w4_s2": {"keys_major": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    "keys_n64_w4_s2_uniform_plan": {"keys_major": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                                    "uniform_plan": True},
    "keys_n64_w8_s2": {"keys_major": True, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    "rows_n32_w8_s2_fp8": {"keys_major": False, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "fp8": True},
    "keys_n64_w4_s2_fp8": {"keys_major": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "fp8": True},
}
LOOP_MIN_CHUNKS = (64, 128, 256)


def loops_case(name: str, lens: list[int], args, rows: list[dict]) -> None:
    """Every (key-loop form, min_chunk) on one batch of histories `lens` (see --loops)."""
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    q, cache, table, kv = make_case(lens, 1, dtype, dev)
    cache8 = None if args.smoke else cache.to(torch.float8_e4m3fn)
    scale = DL ** -0.5
    base = {}
    for form, kw in LOOP_FORMS.items():
        kw = dict(kw)
        fp8, uniform_plan = kw.pop("fp8", False), kw.pop("uniform_plan", False)
        if fp8 and cache8 is None:
            continue
        c = cache8 if fp8 else cache
        cache_bytes = sum(lens) * DL * c.element_size()
        for mc in LOOP_MIN_CHUNKS:
            call = {**kw, "min_chunk": mc}
            if args.smoke:
                call["BLOCK_N"] = 16

            def fn(call=call, c=c):
                return k_mla.mla_decode(q, c, table, kv, scale, V, **call)

            saved, k_mla.UNIFORM_PLAN = k_mla.UNIFORM_PLAN, uniform_plan  # read at call (and capture) time
            try:
                out = fn()
                t = graph_us(fn, n=20, smoke=args.smoke)
            except Exception as e:  # noqa: BLE001 - a form that does not compile is reported, not fatal
                print(f"{name:14s} {form:24s} mc {mc:4d} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            finally:
                k_mla.UNIFORM_PLAN = saved
            base.setdefault(fp8, out.clone())
            row = {"case": name, "batch": len(lens), "ctx": max(lens), "form": form, "min_chunk": mc, **kw,
                   "uniform_plan": uniform_plan, "cache_dtype": str(c.dtype), "us": t,
                   "hbm_frac": cache_bytes / (t * 1e-6) / HBM if math.isfinite(t) and t > 0 else None,
                   "cache_bytes": cache_bytes, "max_rel_err_vs_first_of_dtype": rel(out, base[fp8])}
            rows.append(row)
            print(f"{name:14s} {form:24s} mc {mc:4d} {t:9.2f} us  HBM {100 * (row['hbm_frac'] or 0):5.1f}%  "
                  f"err {row['max_rel_err_vs_first_of_dtype']:.2e}", flush=True)


def run_loops(args, t0: float, triton) -> None:
    cases = [(f"b{b}_{c // 1024}k", [c] * b) for c in POLICY_CONTEXTS for b in POLICY_BATCHES]
    cases.append(("mixed_b16", [65536, 16384, 4096, 1024] * 4))
    if args.smoke:
        cases = [("b1", [100]), ("mixed", [300, 80, 20, 5])]
    rows: list[dict] = []
    for name, lens in cases:
        loops_case(name, lens, args, rows)
    print("\nbest per case (us, HBM%):")
    for name, _ in cases:
        cand = [r for r in rows if r["case"] == name and math.isfinite(r["us"])]
        if cand:
            best, dflt = min(cand, key=lambda r: r["us"]), cand[0]
            print(f"  {name:14s} default {dflt['us']:8.2f} ({100 * (dflt['hbm_frac'] or 0):4.1f}%)  best "
                  f"{best['form']} mc {best['min_chunk']} {best['us']:8.2f} ({100 * (best['hbm_frac'] or 0):4.1f}%)")
    write_result(args, t0, triton, rows, page_size=PAGE, Q=1, forms=LOOP_FORMS,
                 timing="CUDA graph of 20 calls, each after a 256 MiB memset; memset-only graph subtracted; median "
                        "of 10")


if __name__ == "__main__":
    main()
