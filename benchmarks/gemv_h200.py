"""Small-M projections on one H200: the Triton GEMV (`tokenspeed.ops.triton.gemv`) against torch (F.linear ->
cuBLAS) with a cold L2, and the routing table that `tokenspeed.ops.linear` reads at run time.

    PYTHONPATH=. python benchmarks/gemv_h200.py --out benchmarks/results
    PYTHONPATH=. python benchmarks/gemv_h200.py --device cpu --dry-run --out /tmp/gemv   # plumbing check, no GPU
    PYTHONPATH=. python benchmarks/gemv_h200.py --chain --out benchmarks/results    # PDL / prefetch chain A/B only

Shapes: every dense projection (nn.Linear weight [N, K]) of the `kimi-linear-48b-a3b` and `k3-slice` presets,
read off the models built on the meta device (KDA qkv / f / b / g / o, MLA q / kv_a / kv_b / g / o, dense MLP,
shared experts, the latent routed-expert down/up, lm_head), the MoE routers ([E, hidden]; the model computes their
fp32 logits with `ops.linear(x, w, out_dtype=torch.float32)`, which takes the table's config for that (N, K), or
the default config without one), and the K3 TP8 shapes of the small-M table in shared/docs/h200-baseline.md.
M in (1, 2, 4, 8), bf16.

Timing (cold L2): each measurement is a CUDA graph of n calls, call i reading weight copy i mod c, where the c
copies together hold >= 192 MiB (over 3x the 60 MiB L2; at most 512 copies, so the smallest layers rotate over
~75 MB), so every call streams its weight from HBM; x (a few KB) stays hot as in decode. Each call is preceded
in the graph by a plain copy kernel that writes x (a decode step's projection always waits for the kernel that
produced its input, which matters for our PDL launches); a graph of those copies alone is timed and subtracted.
Per-call time = median over `--reps` (default 20) graph replays (CUDA events, after two warm-up replays) / n.
Graph replay is how the engine runs decode, so launch gaps are the graph's, not Python's.
For each (shape, M) this times torch and a small sweep of launch configs (kind fma|dot, BLOCK_N, BLOCK_K,
SPLIT_K, num_warps, num_stages), checks every config's output against torch's (rel err < 1e-2, bf16), and keeps
the fastest passing config. GB/s = weight bytes / time; % HBM is against 4.27 TB/s (the measured D2D copy rate
of the baseline doc; the copy rate is re-measured here and recorded too).

--producer-cycles C (in context): x is written instead by a one-program PDL kernel that spins C SM clocks first
(`gemv_pdl_chain_h200.produce`: the latency-bound kernel before a projection in a decode step), that kernel alone
is subtracted, and the sweep adds "whole-slice" configs (K / split_k == block_k, so the "regs" prefetch loads each
program's whole weight slice before its PDL wait) and the "smem" kind's (`smem_configs`: weight rows copied into
shared memory before the wait). A time is then what the projection adds to the step, overlap
included: our PDL launches stream weights while the producer runs, cuBLAS starts after it. Write such a table
elsewhere (--table) and A/B it in the step before it replaces the packaged one.

Two A/B comparisons ride along (their rows are in the JSON; the reduce A/B rows also compete for the table):
- split-K reduction: the sweep runs with the default one-launch reduction (`reduce="fused"`: the last split of
  each n-tile sums the partials); the fastest split-K config of each (shape, M) is timed again with
  `reduce="launch"` (the previous second reduce kernel) and the pair is printed.
- router (shapes whose names contain "router"): the model's widening call, fp32 logits of bf16 inputs: torch
  (`torch.mm(x, w.t(), out_dtype=torch.float32)`, cuBLAS) against the GEMV with `out_dtype=torch.float32` under
  the default config and under the winning config of the bf16 sweep.

Outputs: --out/gemv_h200.json (every row + the per-(shape, M) winners), --out/gemv_h200.png (% of HBM per shape,
torch vs ours, one panel per M), and the routing table at --table (default: the packaged
tokenspeed/ops/gemv_table.json): entries["N,K"]["M"] = {"kernel": "triton", launch config, timings} when ours was
faster than torch by more than --margin (default 2%), else {"kernel": "torch", timings}. A time guard
(--budget-s) drops to the default config only if the sweep runs long, so the whole run stays under ~4 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import torch
import triton
from graph_timing import graph_us  # benchmarks/graph_timing.py (the script's own folder is on sys.path)

from tokenspeed.ops import dispatch
from tokenspeed.ops.triton import gemv as k_gemv
from tokenspeed.ops.triton.gemv import GemvConfig

HBM = 4.27e12  # bytes/s, shared/docs/h200-baseline.md
ROTATE_BYTES = 192 << 20
MAX_COPIES = 512

BASELINE_SHAPES = [  # shared/docs/h200-baseline.md, small-M projection table (K3 TP8 per-rank shapes)
    ("k3-tp8 routed-down full", 3584, 7168),
    ("k3-tp8 routed-down block", 448, 7168),
    ("k3-tp8 KDA q/k/v/g/f/b merged", 6284, 7168),
    ("k3-tp8 shared gate+up", 1536, 7168),
    ("k3-tp8 lm_head", 20480, 7168),
]
DRY_SHAPES = [("tiny a", 100, 72), ("tiny b router", 40, 160)]


def preset_shapes(presets: tuple[str, ...] = ("kimi-linear-48b-a3b", "k3-slice")) -> list[tuple[str, int, int]]:
    """(name, N, K) of every Linear of the presets (built on the meta device) and their routers; N == 1 skipped
    (the AttnRes projections are read as a query vector, never called)."""
    from tokenspeed.models.hf_config import parse_hf_config
    from tokenspeed.models.kimi.model import KimiForCausalLM
    from tokenspeed.models.layers import Linear
    from tokenspeed.models.presets import preset_hf_config

    out = []
    for preset in presets:
        model = KimiForCausalLM(parse_hf_config(preset_hf_config(preset)), device="meta")
        names: dict[tuple[int, int], set[str]] = {}
        for name, mod in model.named_modules():
            parts = [p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers")]
            if isinstance(mod, Linear):
                names.setdefault(tuple(mod.weight.shape), set()).add(".".join(parts[-2:]))
            elif name.endswith("block_sparse_moe.gate"):
                names.setdefault(tuple(mod.weight.shape), set()).add("router (fp32 in the model)")
        out += [(f"{preset}: {', '.join(sorted(v))}", n, k) for (n, k), v in names.items() if n > 1]
    return out


def all_shapes() -> list[tuple[str, int, int]]:
    """Unique (N, K) with the names of every use, ordered by weight size."""
    merged: dict[tuple[int, int], list[str]] = {}
    for name, n, k in preset_shapes() + BASELINE_SHAPES:
        merged.setdefault((n, k), []).append(name)
    return sorted([("; ".join(v), n, k) for (n, k), v in merged.items()], key=lambda s: s[1] * s[2])


def auto_split(n_blocks: int, K: int, block_k: int, programs: int, min_steps: int = 4) -> int:
    """The smallest power-of-two split-K giving >= `programs` programs, with >= min_steps BLOCK_K steps per split."""
    split = 1
    while n_blocks * split < programs and K >= 2 * split * block_k * min_steps:
        split *= 2
    return split


def wave_split(n_blocks: int, K: int, block_k: int, programs: int) -> int:
    """The largest split-K (any integer, not only a power of two) whose n_blocks x split programs fit in
    `programs` (a whole number of waves: no half-empty last wave, e.g. 36 tiles x 3 = 108 programs on 132 SMs,
    where a split of 4 puts two programs on 12 SMs); 1 when the tiles alone fill it; at most one BLOCK_K step
    per split."""
    return max(1, min(programs // max(n_blocks, 1), triton.cdiv(K, block_k)))


def whole_slice(N: int, K: int, num_sms: int) -> set[GemvConfig]:
    """Tensor-core configs whose programs each own one BLOCK_K step (split_k = K / block_k), so the "regs"
    prefetch loads a program's whole weight slice before the PDL wait; only those with at most 4 programs per SM
    (more could not be resident beside the producer). One stage: the K loop has no step left after the peeled
    one, and more stages only reserve shared memory (o_proj's 64 x 256 tiles at M = 1: 160 KB at 3 stages, 40 KB
    and 137 registers at 1; `pdl_compile_sm90.py --only whole`)."""
    out = set()
    for bn, bk, warps in ((64, 256, 4), (32, 512, 4), (64, 512, 8), (128, 256, 8), (32, 256, 4)):
        split = triton.cdiv(K, bk)
        if K % bk == 0 and triton.cdiv(N, bn) * split <= 4 * num_sms:
            out.add(GemvConfig("dot", bn, bk, split, warps, 1))
    return out


def smem_configs(M: int, N: int, K: int, elt: int, num_sms: int) -> set[GemvConfig]:
    """Configs of the "smem" kind (`gemv_smem`: whole weight rows copied into shared memory before the PDL wait)
    for M <= its MAX_BLOCK_M: one program a row tile of 2-16 rows (at most 4 for M > 2), all tiles' bytes in
    flight when they fit beside the producer; and persistent grids of 1-3 programs an SM with 1-3 buffers each,
    within an SM's shared memory (228 KB)."""
    from tokenspeed.ops.triton import gemv_smem

    if M > gemv_smem.MAX_BLOCK_M:
        return set()
    out = set()
    for bn, warps in ((2, 2), (4, 4), (8, 4), (16, 8), (8, 8), (16, 16), (8, 16)):  # more warps: a faster compute
        if M > 2 and bn > 4:  # the fp32 products of 4 rows x 8+ weight rows spill (gemv_smem_compile_sm90.py)
            continue
        wn, wk = gemv_smem.warps_split(bn, warps)
        bk = gemv_smem.VEC * 32 * wk
        if K % bk:
            continue
        for stages, per_sm in ((1, 0), (1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3)):
            if stages == 3 and bn < 8:  # K 2304: ptxas spills in the tile loop (gemv_smem_compile_sm90.py)
                continue
            smem = gemv_smem.smem_bytes(M, K, elt, bn, stages)
            if smem <= gemv_smem.SMEM_PER_PROGRAM and smem * max(per_sm, 1) <= 225 * 1024:
                out.add(GemvConfig("smem", bn, bk, 1, warps, stages, programs_per_sm=per_sm))
    return out


def sweep(M: int, N: int, K: int, elt: int, num_sms: int, wide: bool, dry: bool,
          in_context: bool = False) -> list[GemvConfig]:
    """The launch configs tried for one (M, N, K): the tile shapes that won a wide H200 sweep (tensor-core kernel;
    the CUDA-core kernel only at M <= 2, where it wins some tiny layers), each with the split-K that fills one and
    two waves of programs (>= 4 K steps per split, and for small layers >= 1 step: more, shorter programs) and the
    largest split that fits in them (`wave_split`), plus the default chooser's pick. `wide` adds more tiles, stages, waves and split depths."""
    if dry:
        return [GemvConfig("fma", 16, 32, 1, 4, 1), GemvConfig("fma", 8, 64, 3, 4, 1), GemvConfig("dot", 32, 32, 2, 4, 1),
                k_gemv.default_config(M, N, K, elt, num_sms)]
    dot = [(64, 128, 4, 4), (128, 128, 4, 3), (64, 64, 4, 6), (128, 256, 8, 3), (64, 256, 4, 3), (32, 128, 4, 4)]
    # long contiguous row chunks (4-8 KB a row per step, 8 warps): what a plain streaming read needs to approach the
    # HBM rate in context (benchmarks/read_floor_h200.py)
    fma = [(4, 512, 4, 3), (8, 512, 4, 2), (4, 2048, 8, 1), (8, 1024, 8, 2)] if M <= 2 else []
    if N >= 8192:
        dot.append((256, 64, 8, 3))
    waves, depths = (1, 2), (4,)
    if wide:
        dot += [(128, 64, 4, 5), (32, 64, 4, 6), (64, 128, 4, 6), (128, 128, 8, 4), (16, 128, 4, 4), (32, 256, 4, 3),
                (16, 256, 4, 2), (64, 512, 4, 2)]
        fma += [(16, 256, 4, 3), (8, 256, 4, 3)]
        waves, depths = (0.5, 1, 2, 4), (1, 2, 4)
    elif N * K * elt < (32 << 20):
        depths = (1, 4)
    cfgs = {k_gemv.default_config(M, N, K, elt, num_sms)}
    if in_context and elt <= 2:
        cfgs |= whole_slice(N, K, num_sms) | smem_configs(M, N, K, elt, num_sms)
    for kind, bases in (("fma", fma), ("dot", dot)):
        if kind == "dot" and elt > 2:
            continue
        for bn, bk, warps, stages in bases:
            bk = max(bk * 2 // elt, 16) if elt > 2 else bk  # fp32: same bytes per step
            nb = triton.cdiv(N, bn)
            for w in waves:
                for d in depths:
                    cfgs.add(GemvConfig(kind, bn, bk, auto_split(nb, K, bk, int(w * num_sms), d), warps, stages))
                cfgs.add(GemvConfig(kind, bn, bk, wave_split(nb, K, bk, int(w * num_sms)), warps, stages))
    return sorted(cfgs, key=lambda c: (c.kind, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def cpu_us(call: Callable[[int], object], n_calls: int, reps: int) -> float:
    """Dry run: wall time of one eager call (the interpreter; meaningless as a speed, checks the plumbing)."""
    call(0)
    t = time.perf_counter()
    call(1)
    return (time.perf_counter() - t) * 1e6


def copy_rate(dev: str) -> float:
    """D2D copy rate (bytes read + written per second) of a 1 GiB buffer, median of 10."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * a.numel() / statistics.median(ts)


def _torch_call(x: torch.Tensor, ws: torch.Tensor, i: int) -> torch.Tensor:
    return torch.nn.functional.linear(x, ws[i % ws.shape[0]])


def _ours_call(x: torch.Tensor, ws: torch.Tensor, kw: dict, i: int) -> torch.Tensor:
    return k_gemv.gemv(x, ws[i % ws.shape[0]], **kw)


def _torch_fp32out_call(x: torch.Tensor, ws: torch.Tensor, i: int) -> torch.Tensor:
    """The router's torch path: cuBLAS with fp32 output (CPU dry run: the fp32 product)."""
    w = ws[i % ws.shape[0]]
    return torch.mm(x, w.t(), out_dtype=torch.float32) if x.is_cuda else torch.nn.functional.linear(x.float(),
                                                                                                    w.float())


def _after(prep: Callable[[], object], fn: Callable[[int], object], i: int) -> object:
    prep()
    return fn(i)


_LAUNCH_ERRORS = (RuntimeError, ValueError, AssertionError, triton.runtime.errors.OutOfResources,
                  triton.compiler.errors.CompilationError)


def bench_shape(name: str, N: int, K: int, ms: list[int], args: argparse.Namespace, timer: Callable,
                dtype: torch.dtype, dev: str, num_sms: int, t_start: float) -> list[dict]:
    """All rows of one shape: torch and every swept config for each M.

    Every timed call is preceded by the (plain, non-PDL) kernel that writes x, as in a decode step; that
    kernel's own time (a graph of it alone) is subtracted.
    """
    elt = torch.tensor([], dtype=dtype).element_size()
    wbytes = N * K * elt
    copies = 1 if args.dry_run else min(MAX_COPIES, max(2, math.ceil(ROTATE_BYTES / wbytes)))
    n_calls = copies if args.dry_run else max(copies, 10)
    gen = torch.Generator(device=dev).manual_seed(N * 131 + K)
    ws = torch.randn(copies, N, K, generator=gen, device=dev, dtype=torch.float32 if dev == "cpu" else dtype)
    ws = ws.to(dtype)
    rows = []
    for M in ms:
        src = torch.randn(M, K, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        x = src.clone()
        prep = partial(x.copy_, src)
        if args.producer_cycles:  # in context: a PDL kernel that spins, then writes x
            from gemv_pdl_chain_h200 import produce  # benchmarks/ (the script's own folder is on sys.path)

            prep = partial(produce, src, x, args.producer_cycles, dev == "cuda")
        base = {"shape": f"{N}x{K}", "names": name, "N": N, "K": K, "M": M, "weight_bytes": wbytes,
                "copies": copies, "n_calls": n_calls}
        t_prep = timer(lambda i, prep=prep: prep(), n_calls, args.reps)
        time_it = partial(_timed_row, x, ws, prep, t_prep, timer, n_calls, args.reps, base)
        rows.append({**time_it("torch", partial(_torch_call, x, ws)), "config": None, "rel_err": 0.0, "ok": True,
                     "prep_us": t_prep})
        ref = torch.nn.functional.linear(x, ws[0])
        cfgs = sweep(M, N, K, elt, num_sms, args.sweep == "wide", args.dry_run, bool(args.producer_cycles))
        if time.perf_counter() - t_start > args.budget_s:
            cfgs = [k_gemv.default_config(M, N, K, elt, num_sms)]
            base["budget_cut"] = True
        mine = [_triton_row(time_it, x, ws, ref, asdict(cfg), 1e-2 if elt == 2 else 1e-5) for cfg in cfgs]
        split_k = [r for r in mine if r["ok"] and k_gemv.effective_split(K, GemvConfig(**r["config"]))[0] > 1]
        if split_k:  # the reduce A/B: the fastest split-K config again, with the two-launch reduction
            best = min(split_k, key=lambda r: r["us"])
            twin = {**best["config"], "reduce": "launch"}
            mine.append({**_triton_row(time_it, x, ws, ref, twin, 1e-2 if elt == 2 else 1e-5),
                         "fused_us": best["us"]})
        rows += mine
        if "router" in name:
            rows += _router_rows(time_it, x, ws, mine, M, N, K, elt, num_sms)
    for r in rows:
        r["gbps"] = wbytes / (r["us"] * 1e-6) / 1e9 if r["us"] == r["us"] else math.nan
        r["pct_hbm"] = 100 * r["gbps"] * 1e9 / HBM if r["gbps"] == r["gbps"] else math.nan
    del ws
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def _timed_row(x, ws, prep, t_prep, timer, n_calls, reps, base, impl: str, fn: Callable[[int], object] | None
               ) -> dict:
    """A row timing fn (each call after the x producer, whose own time is subtracted); fn None: us = NaN."""
    us = math.nan if fn is None else timer(partial(_after, prep, fn), n_calls, reps) - t_prep
    return {**base, "impl": impl, "us": us}


def _triton_row(time_it: Callable, x: torch.Tensor, ws: torch.Tensor, ref: torch.Tensor, kw: dict, tol: float,
                impl: str = "triton", out_dtype: torch.dtype | None = None) -> dict:
    """Check the GEMV under launch config kw against ref (rel err < tol), then time it; a config that fails the
    check, or to compile or launch, gets us = NaN (recorded, not fatal)."""
    call_kw = kw if out_dtype is None else {**kw, "out_dtype": out_dtype}
    try:
        err = rel(k_gemv.gemv(x, ws[0], **call_kw), ref)
        ok = err < tol
        row = time_it(impl, partial(_ours_call, x, ws, call_kw) if ok else None)
    except _LAUNCH_ERRORS as e:
        print(f"  {ws.shape[1]}x{ws.shape[2]} M={x.shape[0]} {kw}: {type(e).__name__}: {str(e)[:200]}")
        err, ok, row = math.nan, False, time_it(impl, None)
    return {**row, "config": kw, "rel_err": err, "ok": ok}


def _router_rows(time_it: Callable, x: torch.Tensor, ws: torch.Tensor, mine: list[dict], M: int, N: int, K: int,
                 elt: int, num_sms: int) -> list[dict]:
    """The router's widening call (fp32 logits): torch's fp32-output GEMM, and the GEMV with out_dtype=fp32 under
    the default config and under the fastest config of the sweep (impl "torch-fp32out" / "triton-fp32out")."""
    ref = _torch_fp32out_call(x, ws, 0)
    rows = [{**time_it("torch-fp32out", partial(_torch_fp32out_call, x, ws)), "config": None, "rel_err": 0.0,
             "ok": True}]
    cfgs = [asdict(k_gemv.default_config(M, N, K, elt, num_sms))]
    best = min((r for r in mine if r["ok"]), key=lambda r: r["us"], default=None)
    if best is not None and best["config"] != cfgs[0]:
        cfgs.append(best["config"])
    for kw in cfgs:
        rows.append(_triton_row(time_it, x, ws, ref, kw, 1e-4, "triton-fp32out", torch.float32))
    return rows


def report_ab(rows: list[dict]) -> dict:
    """Print the two A/B comparisons (split-K reduction fused vs launch; router fp32 logits torch vs GEMV) and
    return their summary for the JSON."""
    ab = [r for r in rows if "fused_us" in r and r["ok"]]
    print(f"\nsplit-K reduction A/B (same config): {'N x K':>14} {'M':>2} | fused us | launch us | launch - fused")
    for r in ab:
        c = r["config"]
        print(f"  {c['kind']} n{c['block_n']} k{c['block_k']} s{c['split_k']:<3} {r['N']:>7}x{r['K']:<6} {r['M']:>2} | "
              f"{r['fused_us']:8.2f} | {r['us']:9.2f} | {r['us'] - r['fused_us']:+7.2f}")
    deltas = [r["us"] - r["fused_us"] for r in ab]
    out = {"reduce_ab_rows": len(ab), "reduce_ab_median_saving_us": statistics.median(deltas) if deltas else None,
           "reduce_ab_fused_faster": sum(d > 0 for d in deltas)}
    if deltas:
        print(f"  {len(ab)} rows: fused faster in {out['reduce_ab_fused_faster']}, median saving "
              f"{out['reduce_ab_median_saving_us']:.2f} us per call")
    router = {}
    for r in rows:
        if r["impl"] in ("torch-fp32out", "triton-fp32out"):
            router.setdefault((r["N"], r["K"], r["M"]), []).append(r)
    if router:
        print("\nrouter, fp32 logits of bf16 inputs: torch.mm(out_dtype=fp32) vs GEMV(out_dtype=fp32) [config]")
    for (n, k, m), grp in sorted(router.items()):
        parts = [f"{r['us']:6.2f} us " + ("torch" if r["config"] is None else
                 "[{kind} n{block_n} k{block_k} s{split_k} w{num_warps} st{num_stages} {reduce}]".format(**r["config"]))
                 for r in grp]
        print(f"  {n:>5}x{k:<5} M={m}: " + " | ".join(parts))
    return out


def winners(rows: list[dict], margin: float) -> list[dict]:
    """Per (N, K, M): torch's row, the fastest passing triton row, and the routing decision."""
    out = []
    keys = sorted({(r["N"], r["K"], r["M"]) for r in rows}, key=lambda k: (k[0] * k[1], k[2]))
    for key in keys:
        grp = [r for r in rows if (r["N"], r["K"], r["M"]) == key]
        torch_row = next(r for r in grp if r["impl"] == "torch")
        ours = [r for r in grp if r["impl"] == "triton" and r["ok"] and r["us"] == r["us"]]
        best = min(ours, key=lambda r: r["us"]) if ours else None
        use = best is not None and best["us"] < torch_row["us"] * (1 - margin)
        out.append({"N": key[0], "K": key[1], "M": key[2], "names": torch_row["names"],
                    "weight_bytes": torch_row["weight_bytes"], "torch_us": torch_row["us"],
                    "torch_pct_hbm": torch_row["pct_hbm"], "triton_us": best["us"] if best else math.nan,
                    "triton_pct_hbm": best["pct_hbm"] if best else math.nan,
                    "triton_config": best["config"] if best else None,
                    "speedup": torch_row["us"] / best["us"] if best else math.nan,
                    "kernel": "triton" if use else "torch"})
    return out


def routing_table(wins: list[dict], dtype: torch.dtype, device_name: str, margin: float) -> dict:
    entries: dict[str, dict[str, dict]] = {}
    for w in wins:
        e = {"kernel": w["kernel"]}
        if w["kernel"] == "triton":
            e.update(w["triton_config"])
        e.update(us=round(w["triton_us"], 3) if w["triton_us"] == w["triton_us"] else None,
                 torch_us=round(w["torch_us"], 3))
        entries.setdefault(f"{w['N']},{w['K']}", {})[str(w["M"])] = e
    dts = ["bfloat16", "float16"] if dtype in (torch.bfloat16, torch.float16) else [str(dtype).split(".")[-1]]
    return {
        "about": "ops.linear routing: (N,K) -> M bucket -> kernel; written by benchmarks/gemv_h200.py "
                 f"(cold L2, CUDA-graph replay; triton only when faster than torch by > {margin:.0%})",
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "measured_dtype": str(dtype).split(".")[-1],
        "dtypes": dts,
        "entries": entries,
    }


def plot(wins: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({w["M"] for w in wins})
    fig, axes = plt.subplots(len(ms), 1, figsize=(max(10, 0.45 * len(wins) / len(ms) + 4), 3.2 * len(ms)),
                             squeeze=False)
    for ax, M in zip(axes[:, 0], ms):
        ws = [w for w in wins if w["M"] == M]
        xs = range(len(ws))
        ax.bar([i - 0.2 for i in xs], [w["torch_pct_hbm"] for w in ws], 0.4, label="torch (cuBLAS)")
        ax.bar([i + 0.2 for i in xs], [w["triton_pct_hbm"] for w in ws], 0.4, label="ours (Triton GEMV)")
        ax.axhline(80, color="k", ls="--", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{w['N']}x{w['K']}\n{w['weight_bytes'] / 1e6:.1f}MB" for w in ws], fontsize=6,
                           rotation=90)
        ax.set_ylabel(f"M={M}: % of 4.27 TB/s")
        ax.set_ylim(0, 110)
        ax.legend(fontsize=7, loc="upper left")
    axes[0, 0].set_title("Small-M projections, cold L2: weight bytes / time vs HBM copy rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--table", default=None, help="routing table path (default: the packaged one; dry run: --out)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dry-run", action="store_true", help="tiny fp32 shapes, interpreter-friendly, no timing value")
    ap.add_argument("--ms", default="", help="comma list of M (default 1,2,4,8; dry run 1,5)")
    ap.add_argument("--shapes", default="", help="only shapes whose 'NxK' or names contain one of these (comma list)")
    ap.add_argument("--sweep", default="default", choices=["default", "wide"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--budget-s", type=float, default=170.0, help="after this, only the default config is timed")
    ap.add_argument("--no-table", action="store_true", help="do not write the routing table")
    ap.add_argument("--producer-cycles", type=int, default=0,
                    help="in context: x written by a PDL kernel spinning this many SM clocks (docstring); 0: a copy")
    ap.add_argument("--chain", action="store_true", help="instead of the sweep: the PDL / weight-prefetch A/B on a "
                    "decode-layer chain (benchmarks/gemv_pdl_chain_h200.py; --out, --reps, --device, --dry-run)")
    args = ap.parse_args()
    if args.device == "cpu" and not args.dry_run:
        ap.error("--device cpu needs --dry-run (the interpreter is not a speed)")
    if args.chain:
        from gemv_pdl_chain_h200 import run_chain  # benchmarks/ (the script's own folder is on sys.path)

        run_chain(Path(args.out), args.device, args.dry_run, args.reps)
        return
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    ms = [int(m) for m in (args.ms or ("1,5" if args.dry_run else "1,2,4,8")).split(",")]
    shapes = DRY_SHAPES if args.dry_run else all_shapes()
    if args.shapes:
        keys = [s.strip() for s in args.shapes.split(",") if s.strip()]
        shapes = [s for s in shapes if any(k in f"{s[1]}x{s[2]}" or k in s[0] for k in keys)]
    timer = cpu_us if dev == "cpu" else graph_us
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 132
    dev_name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (Triton interpreter)"
    copy = copy_rate(dev) if dev == "cuda" else math.nan
    print(f"{dev_name}: {num_sms} SMs, D2D copy {copy / 1e12:.2f} TB/s; {len(shapes)} shapes x M {ms}")
    rows: list[dict] = []
    for name, N, K in shapes:
        t0 = time.perf_counter()
        rows += bench_shape(name, N, K, ms, args, timer, dtype, dev, num_sms, t_start)
        print(f"  {N}x{K} done in {time.perf_counter() - t0:.1f}s ({name[:80]})", flush=True)
    wins = winners(rows, args.margin)
    print(f"\n{'N x K':>14} {'MB':>7} {'M':>2} | {'torch us':>8} {'%HBM':>5} | {'ours us':>8} {'%HBM':>5} "
          f"{'x':>5} | pick   config")
    for w in wins:
        c = w["triton_config"] or {}
        cs = f"{c.get('kind')} n{c.get('block_n')} k{c.get('block_k')} s{c.get('split_k')} w{c.get('num_warps')} " \
             f"st{c.get('num_stages')} {c.get('reduce')}" if c else "-"
        print(f"{w['N']:>7}x{w['K']:<6} {w['weight_bytes'] / 1e6:7.1f} {w['M']:>2} | {w['torch_us']:8.2f} "
              f"{w['torch_pct_hbm']:5.1f} | {w['triton_us']:8.2f} {w['triton_pct_hbm']:5.1f} {w['speedup']:5.2f} | "
              f"{w['kernel']:6} {cs}")
    big = [w for w in wins if w["weight_bytes"] >= 16e6]
    if big:
        best_pct = [max(w["torch_pct_hbm"], w["triton_pct_hbm"]) for w in big]
        print(f"\nweights >= 16 MB: routed best >= 80% HBM in {sum(p >= 80 for p in best_pct)}/{len(big)} rows; "
              f"median {statistics.median(best_pct):.1f}%")
    ab_summary = report_ab(rows)
    elapsed = time.perf_counter() - t_start
    try:
        sm_clock = torch.cuda.clock_rate() if dev == "cuda" else None  # MHz now (needs nvidia-ml-py)
    except (ImportError, RuntimeError):
        sm_clock = None
    meta = {"device": dev_name, "num_sms": num_sms, "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(dtype), "hbm_ref_Bps": HBM, "copy_rate_Bps": copy, "rotate_bytes": ROTATE_BYTES,
            "reps": args.reps, "margin": args.margin, "sweep": args.sweep, "producer_cycles": args.producer_cycles,
            "elapsed_s": elapsed,
            "dry_run": args.dry_run, "sm_clock_mhz_at_end": sm_clock, **ab_summary}
    (out / "gemv_h200.json").write_text(json.dumps({"meta": meta, "winners": wins, "rows": rows}, indent=1))
    plot(wins, out / "gemv_h200.png")
    if not args.no_table:
        table_path = Path(args.table) if args.table else (
            out / "gemv_table.json" if args.dry_run else dispatch.LINEAR_TABLE_PATH)
        table = routing_table(wins, dtype, dev_name, args.margin)
        dispatch.parse_linear_table(table)  # validate before writing
        table_path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"routing table -> {table_path}")
    print(f"wrote {out / 'gemv_h200.json'}, {out / 'gemv_h200.png'} in {elapsed:.0f}s")


if __name__ == "__main__":
    main()
