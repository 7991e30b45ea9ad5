"""A/B of the GEMV's PDL launch and its weight prefetch before the wait, in a chain that mimics a decode layer at
batch 1, in CUDA graphs on one H200.

    PYTHONPATH=benchmarks:. python benchmarks/gemv_pdl_chain_h200.py --out benchmarks/results
    PYTHONPATH=. python benchmarks/gemv_h200.py --chain --out benchmarks/results          # the same
    PYTHONPATH=benchmarks:. python benchmarks/gemv_pdl_chain_h200.py --device cpu --dry-run --out /tmp/chain

The chain (one decode layer's GEMVs, M = 1, bf16 weights, Kimi-Linear shapes):
    producer -> o_proj [2304 x 4096] -> router [256 x 2304], fp32 out -> in_proj [12576 x 2304]
or, with --geometry k3, h200-baseline.md's K3 shapes (the issue's GEMV targets), each reading the producer's x:
    producer -> down_tp8 [448 x 7168] -> shared_gate_up_tp8 [1536 x 7168] -> down_full [3584 x 7168]
             -> kda_in_tp8 [6284 x 7168]
The producer is a one-program Triton kernel that spins ~5 us on the SM clock (--producer-cycles) and then writes
x: the latency-bound kernel (a norm, the attention) that precedes a projection in a decode step. It follows the
PDL protocol like the engine's kernels (waits first, then releases its dependents), so with PDL on the GEMV's
programs can be resident, and prefetching, while it spins. The router and in_proj read o_proj's output.

Each measurement is a CUDA graph of --chains chains, chain i reading weight set i mod c (c sets hold >= 192 MiB,
over 3x the L2, so every GEMV streams its weights from HBM), timed as the median of --reps replays / chains.
Configs: PDL on / off (TOKENSPEED_PDL) x prefetch none / l2 / regs (without PDL "l2" compiles to "none" and
"regs" is only the peeled first K step). Per config the graph is timed for each prefix of the chain (producer
alone, + o_proj, + router, + in_proj): the per-kernel numbers are the increments, i.e. what adding that kernel
to the chain costs, overlap included. Every GEMV output of the last chain is checked against torch (rel err <
1e-2). GEMV launch configs: the routing table's where it picks the Triton GEMV, else `default_config`.
Output: --out/gemv_pdl_chain_h200.json and a table on stdout. About 20-40 s, mostly Triton compiles.
--prefetch-l2-mb changes the "l2" mode's joint prefetch cap (gemv.PREFETCH_L2_BYTES, 24 MiB) for a second run.
--configs adds rows (PDL on, "regs" prefetch) with one stage's launch config replaced, e.g.
    --configs "o_proj=dot:64:256:16:4:1;o_proj=dot:32:512:8:4:1"
(kind:block_n:block_k:split_k:num_warps:num_stages). With K / split_k == block_k a program's whole weight slice
is its first tile, which "regs" loads before the PDL wait: the entire weight stream can overlap the producer,
where the table's configs (timed after a short producer) only prefetch their first tile. Give such configs one
stage: their K loop has nothing left after the peeled step, and each stage reserves shared memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import torch
import triton
import triton.language as tl
from graph_timing import replay_ms, warm_up  # benchmarks/graph_timing.py (the script's own folder is on sys.path)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops import dispatch
from tokenspeed.ops.triton import gemv as k_gemv
from tokenspeed.ops.triton import pdl

# (name, N, K, out dtype, input: "x" or an earlier stage's name)
STAGES = [("o_proj", 2304, 4096, None, "x"), ("router", 256, 2304, torch.float32, "o_proj"),
          ("in_proj", 12576, 2304, None, "o_proj")]
# --geometry k3: h200-baseline.md's K3 shapes (the issue's GEMV targets), each reading the producer's x [1, 7168]
K3_STAGES = [("down_tp8", 448, 7168, None, "x"), ("shared_gate_up_tp8", 1536, 7168, None, "x"),
             ("down_full", 3584, 7168, None, "x"), ("kda_in_tp8", 6284, 7168, None, "x")]
DRY_STAGES = [("o_proj", 48, 64, None, "x"), ("router", 16, 48, torch.float32, "o_proj"),
              ("in_proj", 80, 48, None, "o_proj")]
ROTATE_BYTES = 192 << 20
MODES = [(p, m) for p in (True, False) for m in k_gemv.PREFETCHES]


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _producer_kernel(Src, X, n, cycles, BLOCK: tl.constexpr, SPIN: tl.constexpr, PDL: tl.constexpr):
    """One program: (PDL: wait, release dependents) spin `cycles` SM clocks, then X[:n] = Src[:n]."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if SPIN:
        start = _clock()
        now = start
        while now - start < cycles:
            now = _clock()
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(Src + offs, mask=offs < n), mask=offs < n)


def produce(src: torch.Tensor, x: torch.Tensor, cycles: int, spin: bool) -> None:
    """x <- src after ~cycles SM clocks, one program, launched under the PDL protocol."""
    _producer_kernel[(1,)](src, x, x.numel(), cycles, BLOCK=triton.next_power_of_2(x.numel()), SPIN=spin,
                           num_warps=4, **pdl.kernel_kwargs(x.device))


def stage_configs(stages: list, dtype: torch.dtype) -> dict[str, dict]:
    """Launch config per stage: the routing table's Triton entry at M = 1, else {} (`default_config`)."""
    return {name: dispatch.linear_route(1, N, K, dtype) or {} for name, N, K, _, _ in stages}


def make_chain(stages: list, weights: list[dict], src: torch.Tensor, x: torch.Tensor, cfgs: dict, prefetch: str,
               cycles: int, spin: bool) -> Callable[[int, int], dict]:
    """chain(i, k): the producer, then the first k stages on weight set i mod len(weights); returns the outputs."""

    def chain(i: int, k: int) -> dict:
        produce(src, x, cycles, spin)
        outs = {"x": x}
        ws = weights[i % len(weights)]
        for name, _, _, out_dtype, inp in stages[:k]:
            outs[name] = k_gemv.gemv(outs[inp], ws[name], out_dtype=out_dtype, prefetch=prefetch, **cfgs[name])
        return outs

    return chain


def time_chain(chain: Callable[[int, int], dict], k: int, n: int, reps: int, dev: str) -> tuple[float, dict]:
    """(us per chain of the first k stages, the outputs of chain n - 1): graph replays on CUDA, eager wall time on
    the CPU (plumbing only)."""
    if dev == "cpu":
        t0 = time.perf_counter()
        outs = [chain(i, k) for i in range(n)][-1]
        return (time.perf_counter() - t0) * 1e6 / n, outs
    warm_up(lambda: [chain(i, k) for i in range(n)])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [chain(i, k) for i in range(n)][-1]
    ms = replay_ms(graph, reps, warmup=2)
    torch.cuda.synchronize()
    return ms * 1e3 / n, outs


def check(stages: list, outs: dict, ws: dict) -> dict[str, float]:
    """Relative error of each stage's output against torch in fp32 (inputs: the chain's own)."""
    errs = {}
    for name, _, _, _, inp in stages:
        if name in outs:
            ref = outs[inp].float() @ ws[name].float().t()
            errs[name] = ((outs[name].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return errs


def compiled_prefetch(stage: tuple, w: torch.Tensor, cfg: dict, prefetch: str, pdl_on: bool) -> str:
    """The PREFETCH mode the GEMV compiles for this stage ("l2" falls back to "none" without PDL)."""
    _, N, K, _, _ = stage
    full = k_gemv.resolve_config(1, N, K, w.element_size(), w.device, **{**cfg, "prefetch": prefetch})
    split, _ = k_gemv.effective_split(K, full)
    return k_gemv.prefetch_plan(full, w, triton.cdiv(N, full.block_n), split, pdl_on, k_gemv._num_sms(w.device))[0]


def run_config(stages, weights, src, x, cfgs, on: bool, prefetch: str, args, dev: str) -> dict:
    """Time every prefix of the chain under one (PDL, prefetch) config; returns its JSON row."""
    saved = os.environ.get("TOKENSPEED_PDL")
    os.environ["TOKENSPEED_PDL"] = "1" if on else "0"
    try:
        chain = make_chain(stages, weights, src, x, cfgs, prefetch, args.producer_cycles, dev == "cuda")
        prefix_us, errs = [], {}
        for k in range(len(stages) + 1):
            us, outs = time_chain(chain, k, args.chains, args.reps, dev)
            prefix_us.append(us)
            errs = check(stages, outs, weights[(args.chains - 1) % len(weights)])
    finally:
        if saved is None:
            os.environ.pop("TOKENSPEED_PDL", None)
        else:
            os.environ["TOKENSPEED_PDL"] = saved
    names = ["producer"] + [s[0] for s in stages]
    per_kernel = {names[0]: prefix_us[0], **{names[k]: prefix_us[k] - prefix_us[k - 1] for k in range(1, len(names))}}
    plans = {s[0]: compiled_prefetch(s, weights[0][s[0]], cfgs[s[0]], prefetch, on and dev == "cuda")
             for s in stages}
    ok = all(e < 1e-2 for e in errs.values())
    return {"pdl": on, "prefetch": prefetch, "compiled_prefetch": plans, "chain_us": prefix_us[-1],
            "prefix_us": prefix_us, "per_kernel_us": per_kernel, "rel_err": errs, "ok": ok}


def parse_configs(spec: str, stages: list) -> list[tuple[str, dict]]:
    """--configs "stage=kind:block_n:block_k:split_k:num_warps:num_stages;..." -> [(stage, gemv config kwargs)]."""
    out = []
    names = {s[0] for s in stages}
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        stage, _, cfg = item.partition("=")
        fields = cfg.split(":")
        if stage not in names or len(fields) != 6:
            raise ValueError(f"--configs entries are STAGE=kind:block_n:block_k:split_k:num_warps:num_stages with "
                             f"STAGE in {sorted(names)}; got {item!r}")
        kind, *ints = fields
        bn, bk, split, warps, stages_ = (int(v) for v in ints)
        out.append((stage, {"kind": kind, "block_n": bn, "block_k": bk, "split_k": split, "num_warps": warps,
                            "num_stages": stages_}))
    return out


def report(rows: list[dict], names: list[str]) -> None:
    print(f"\n{'pdl':>3} {'prefetch':>8} | " + " | ".join(f"{n:>9}" for n in names) + f" | {'chain us':>8} | vs base")
    base = next(r["chain_us"] for r in rows if r["pdl"] and r["prefetch"] == "none")
    for r in rows:
        cells = " | ".join(f"{r['per_kernel_us'][n]:9.2f}" for n in names)
        tag = f"  [{r['override']}]" if r.get("override") else ""
        print(f"{'on' if r['pdl'] else 'off':>3} {r['prefetch']:>8} | {cells} | {r['chain_us']:8.2f} | "
              f"{r['chain_us'] - base:+6.2f}{tag}" + ("" if r["ok"] else "  CHECK FAILED " + str(r["rel_err"])))
    print("(per kernel: the increment of the chain's time when that kernel is added; base: PDL on, prefetch none)")


def best_in_chain(rows: list[dict], stages: list, dtype: torch.dtype) -> dict:
    """Per stage, the smallest increment over the PDL rows (the stage's in-chain cost) and its weight bytes over
    that time as a fraction of 4.27 TB/s; printed."""
    best = {}
    for name, N, K, _, _ in stages:
        r = min((r for r in rows if r["pdl"] and r["ok"]), key=lambda r: r["per_kernel_us"][name], default=None)
        if r is None:
            continue
        us = r["per_kernel_us"][name]
        frac = N * K * dtype.itemsize / (us * 1e-6) / 4.27e12 if us > 0 else float("inf")
        best[name] = {"us": us, "fraction_of_hbm": frac, "row": r.get("override") or r["prefetch"]}
        print(f"best in chain {name:>18} [{N} x {K}]: {us:7.2f} us = {100 * frac:5.1f}% of 4.27 TB/s "
              f"({best[name]['row']})")
    return best


def run_chain(out: Path, dev: str, dry: bool, reps: int, chains: int = 12, producer_cycles: int = 10_000,
              configs: str = "", geometry: str = "kimi-linear") -> dict:
    """Run every (PDL, prefetch) config, print the table, write out/gemv_pdl_chain_h200.json; returns it."""
    args = argparse.Namespace(reps=reps, chains=chains, producer_cycles=producer_cycles)
    t0 = time.perf_counter()
    stages = DRY_STAGES if dry else K3_STAGES if geometry == "k3" else STAGES
    dtype = torch.float32 if dry else torch.bfloat16
    chain_bytes = sum(N * K for _, N, K, _, _ in stages) * dtype.itemsize
    copies = 1 if dry else max(2, -(-ROTATE_BYTES // chain_bytes))
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [{name: (torch.randn(N, K, generator=gen, device=dev) / K ** 0.5).to(dtype)
                for name, N, K, _, _ in stages} for _ in range(copies)]
    src = torch.randn(1, stages[0][2], generator=gen, device=dev).to(dtype)
    x = torch.empty_like(src)
    cfgs = stage_configs(stages, dtype)
    rows = [run_config(stages, weights, src, x, cfgs, on, m, args, dev) for on, m in MODES]
    for stage, cfg in parse_configs(configs, stages):
        label = f"{stage}=" + ":".join(str(cfg[k]) for k in ("kind", "block_n", "block_k", "split_k", "num_warps",
                                                             "num_stages"))
        try:
            row = run_config(stages, weights, src, x, {**cfgs, stage: cfg}, True, "regs", args, dev)
        except Exception as e:  # noqa: BLE001 - a config that does not build or run is reported, the rest go on
            print(f"{label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row["override"] = label
        rows.append(row)
    names = ["producer"] + [s[0] for s in stages]
    report(rows, names)
    best = best_in_chain(rows, stages, dtype)
    meta = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (Triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "commit": os.environ.get("BENCH_COMMIT", "unknown"),
            "date": time.strftime("%Y-%m-%d"), "dtype": str(dtype), "M": 1, "geometry": geometry,
            "stages": [{"name": n, "N": N, "K": K, "out_dtype": str(o or dtype), "input": i, "config": cfgs[n]}
                       for n, N, K, o, i in stages],
            "weight_sets": copies, "chain_weight_bytes": chain_bytes, "chains_per_graph": chains, "reps": reps,
            "producer_cycles": producer_cycles, "prefetch_l2_bytes": k_gemv.PREFETCH_L2_BYTES,
            "elapsed_s": time.perf_counter() - t0, "dry_run": dry,
            "median_chain_us": statistics.median(r["chain_us"] for r in rows), "best_in_chain": best}
    result = {"meta": meta, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_pdl_chain_h200.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'gemv_pdl_chain_h200.json'} in {meta['elapsed_s']:.0f}s")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dry-run", action="store_true", help="tiny fp32 shapes, interpreter-friendly, no timing value")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chains", type=int, default=12, help="chains per graph")
    ap.add_argument("--producer-cycles", type=int, default=10_000, help="SM clocks the producer spins (~5 us)")
    ap.add_argument("--geometry", default="kimi-linear", choices=["kimi-linear", "k3"],
                    help="kimi-linear: o_proj -> router -> in_proj; k3: h200-baseline.md's K3 shapes, all reading x")
    ap.add_argument("--configs", default="", help="extra rows: STAGE=kind:block_n:block_k:split_k:warps:stages;...")
    ap.add_argument("--prefetch-l2-mb", type=float, default=None,
                    help="override gemv.PREFETCH_L2_BYTES (the resident programs' joint L2 prefetch cap), in MiB")
    args = ap.parse_args()
    if args.device == "cpu" and not args.dry_run:
        ap.error("--device cpu needs --dry-run (the interpreter is not a speed)")
    if args.prefetch_l2_mb is not None:
        k_gemv.PREFETCH_L2_BYTES = int(args.prefetch_l2_mb * (1 << 20))
    run_chain(Path(args.out), args.device, args.dry_run, args.reps, args.chains, args.producer_cycles, args.configs,
              args.geometry)


if __name__ == "__main__":
    main()
