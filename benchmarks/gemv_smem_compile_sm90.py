"""Compile the "smem" GEMV kernel (`tokenspeed.ops.triton.gemv_smem`, Gluon) for sm_90 on a host without a GPU
and check what can be checked there: shared memory within a block's 227 KB, no spill reloads in its tile loop,
and the PTX order of its PDL protocol (the weight's `cp.async` copies before `griddepcontrol.wait`, the first
`ld.global`, x's, after it, `launch_dependents` after the wait).

    PYTHONPATH=/path/to/triton-3.6:benchmarks:. python benchmarks/gemv_smem_compile_sm90.py [--only REGEX]

Variants: every launch config `gemv_h200.smem_configs` sweeps for kimi-linear's batch-1 projections (K 2304 and
4096) at M 1, 2 and 4 and for K3's TP8 shapes (K 7168) at M 1 (N and the grid are run-time values: they do not
change the build). Use the Triton the GPU runs (`pip install --target DIR triton==3.6.0`). Prints one line a
variant, then "<n> failed"; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import re
import sys

import triton
from gemv_h200 import smem_configs
from sm90_compile import TARGET, TRIGGER, WAIT, cubin_usage, loop_usage, report_builds

from tokenspeed.ops.triton import gemv_smem

# (N, K, Ms): one shape per K the models use; K3's 7168 at M 1 only (its M 2 / 4 builds add minutes, no new code)
SHAPES = ((2304, 4096, (1, 2, 4)), (12576, 2304, (1, 2, 4)), (3584, 7168, (1,)))


def compile_variant(K: int, M: int, block_n: int, block_k: int, num_warps: int, stages: int) -> dict:
    """Build the kernel for sm_90 and return its shared memory, registers, stack and the PTX positions of the
    first cp.async, the PDL wait / trigger and the first ld.global."""
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gemv_smem._gemv_smem_kernel
    wn, wk = gemv_smem.warps_split(block_n, num_warps)
    consts = {"K": K, "BLOCK_M": triton.next_power_of_2(M), "BLOCK_N": block_n, "BLOCK_K": block_k,
              "STAGES": stages, "WN": wn, "WK": wk, "DELAY": 0, "PDL": True}
    sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i64",
           "stride_wn": "i64", "n_tiles": "i32", **dict.fromkeys(consts, "constexpr")}
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in ("X", "W", "Y", "stride_xm", "stride_wn")}
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    kernel = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=TARGET,
                            options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, **cubin_usage(kernel), **loop_usage(kernel),
            "copy": ptx.find("cp.async.cg"), "wait": ptx.find(WAIT), "trigger": ptx.find(TRIGGER),
            "load": ptx.find("ld.global")}


def problems(r: dict) -> list[str]:
    """What is wrong with a compiled variant (empty: nothing)."""
    out = []
    if r["shared"] > gemv_smem.SMEM_PER_PROGRAM:
        out.append(f"shared {r['shared']} > {gemv_smem.SMEM_PER_PROGRAM}")
    if r["loop_reloads"]:
        out.append(f"{r['loop_reloads']} spill reloads in the tile loop")
    if not 0 <= r["copy"] < r["wait"] < r["trigger"] < r["load"]:
        out.append("PTX order is not cp.async < wait < launch_dependents < ld.global")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="regex on the variant name")
    args = ap.parse_args()
    variants = {}
    for N, K, ms in SHAPES:
        for M in ms:
            for c in smem_configs(M, N, K, 2, 132):
                name = f"K{K} M{triton.next_power_of_2(M)} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"
                variants[name] = (K, M, c.block_n, c.block_k, c.num_warps, c.num_stages)
    names = [n for n in sorted(variants) if not args.only or re.search(args.only, n)]
    return report_builds({n: variants[n] for n in names}, compile_variant, problems, _usage)


def _usage(r: dict) -> str:
    return (f"shared {r['shared']} regs {r['regs']} stack {r['stack']} loop {r['loop_ins']} ins "
            f"{r['loop_reloads']} reloads")

if __name__ == "__main__":
    sys.exit(main())
