"""The in-context floor of a kernel that reads a weight once, against our GEMV on the same weight, on one H200.

    PYTHONPATH=benchmarks:. python benchmarks/read_floor_h200.py --out benchmarks/results

Question: at M = 1, how close to 4.27 TB/s can *any* kernel that streams a 6-300 MB weight get when it runs, as
in a decode step, right after another kernel? If a plain read of the bytes already takes about what the GEMV takes,
the GEMV is at the floor and the remaining gap to the HBM rate is the latency of a dependent kernel, not the GEMV's
design.

Each measurement is a CUDA graph of --chains chains: a one-program producer spinning ~5 us under the PDL protocol
(`gemv_pdl_chain_h200.produce`), then the kernel under test on weight set i (sets rotated over > 192 MiB, so
every chain reads HBM); the kernel's cost is the increment over the producer-only graph (median of replays).
Kernels, per shape:
- gemv: the Triton GEMV with the routing table's config, PDL, its first tile prefetched before the wait ("regs");
- read-after / read-before: a plain streaming read of the weight (each of P programs sums a contiguous slice
  with 16-byte loads, BLOCK elements an iteration, and stores one fp32), P = 1 / 2 / 4 programs per SM, with the
  PDL wait before its loads (what a kernel that needs its input first can do) or after them (all its bytes in
  flight while the producer spins: the most any prefetch could give).
Shapes: h200-baseline.md's K3 projections (the issue's GEMV targets) and kimi-linear's batch-1 o_proj / in_proj.
Writes read_floor_h200.json to --out; prints a table (us and % of 4.27 TB/s).
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from gemv_pdl_chain_h200 import produce  # benchmarks/ (the script's folder is on sys.path)
from graph_timing import graph_us, write_result
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops import dispatch
from tokenspeed.ops.triton import gemv as k_gemv
from tokenspeed.ops.triton import pdl

HBM = 4.27e12
ROTATE_BYTES = 192 << 20
SHAPES = [("down_tp8", 448, 7168), ("shared_gate_up_tp8", 1536, 7168), ("down_full", 3584, 7168),
          ("kda_in_tp8", 6284, 7168), ("lm_head_tp8", 20480, 7168), ("kl_o_proj", 2304, 4096),
          ("kl_in_proj", 12576, 2304)]


@triton.jit
def _read_kernel(W, Out, numel, n_blocks, BLOCK: tl.constexpr, BEFORE: tl.constexpr, PDL: tl.constexpr):
    """Out[pid] = sum of W[pid * n_blocks * BLOCK :][: n_blocks * BLOCK] (fp32, masked at numel); PDL wait before
    the loads, or after them when BEFORE (W is never written, so reading it before the wait is allowed)."""
    pid = tl.program_id(0)
    if PDL and not BEFORE:
        gdc_wait()
        gdc_launch_dependents()
    start = pid.to(tl.int64) * n_blocks * BLOCK
    acc = tl.zeros([BLOCK // 256, 256], tl.float32)
    for i in range(n_blocks):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(W + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc += tl.reshape(x, [BLOCK // 256, 256])
    if PDL and BEFORE:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(Out + pid, tl.sum(tl.sum(acc, 1), 0))


def read(w: torch.Tensor, out: torch.Tensor, programs: int, block: int, before: bool, warps: int) -> None:
    numel = w.numel()
    n_blocks = triton.cdiv(triton.cdiv(numel, programs), block)
    _read_kernel[(programs,)](w, out, numel, n_blocks, BLOCK=block, BEFORE=before, num_warps=warps,
                              **pdl.kernel_kwargs(w.device))


def measure_shape(name: str, N: int, K: int, args, gen: torch.Generator) -> dict:
    nbytes = N * K * 2
    sets = [torch.randn(N, K, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(max(2, -(-ROTATE_BYTES // nbytes)))]
    src = torch.randn(1, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    out = torch.empty(4 * 132 * 4, device="cuda", dtype=torch.float32)
    cycles = args.producer_cycles
    base = graph_us(lambda i: produce(src, x, cycles, True), args.chains, args.reps)
    cfg = dispatch.linear_route(1, N, K, torch.bfloat16) or {}
    rows = {"gemv": graph_us(lambda i: (produce(src, x, cycles, True), k_gemv.gemv(x, sets[i % len(sets)], **cfg)),
                             args.chains, args.reps) - base}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in (1, 2, 4):
        for block, warps in ((8192, 4), (16384, 8)):
            for before in (False, True):
                label = f"read-{'before' if before else 'after'} {per_sm}/SM B{block} w{warps}"
                rows[label] = graph_us(lambda i, p=per_sm * sms, b=block, bf=before, w=warps: (
                    produce(src, x, cycles, True), read(sets[i % len(sets)], out, p, b, bf, w)),
                    args.chains, args.reps) - base
    best_after = min((v, k) for k, v in rows.items() if k.startswith("read-after"))
    best_before = min((v, k) for k, v in rows.items() if k.startswith("read-before"))
    floor = nbytes / HBM * 1e6
    res = {"name": name, "N": N, "K": K, "bytes": nbytes, "hbm_floor_us": floor, "producer_us": base, "us": rows,
           "gemv_config": cfg, "best_read_after": best_after, "best_read_before": best_before}
    print(f"{name:18s} {nbytes / 1e6:7.1f} MB floor {floor:6.2f} us | gemv {rows['gemv']:6.2f} us "
          f"({100 * floor / rows['gemv']:5.1f}%) | read after wait {best_after[0]:6.2f} ({100 * floor / best_after[0]:5.1f}%, "
          f"{best_after[1]}) | before {best_before[0]:6.2f} ({100 * floor / best_before[0]:5.1f}%, {best_before[1]})",
          flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--chains", type=int, default=12)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--producer-cycles", type=int, default=10_000, help="SM clocks the producer spins (~5 us)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args()
    os.environ.setdefault("TOKENSPEED_PDL", "1")
    gen = torch.Generator(device="cuda").manual_seed(0)
    wanted = args.shapes.split(",")
    rows = [measure_shape(n, N, K, args, gen) for n, N, K in SHAPES if n in wanted]
    write_result(os.path.join(args.out, "read_floor_h200.json"), {"rows": rows})


if __name__ == "__main__":
    main()
