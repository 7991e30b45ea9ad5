"""Compile the Gluon KDA decode (`tokenspeed.ops.triton.kda_decode_gluon`) for sm_90 on a host without a GPU and
check what can be checked there: shared memory within a block's 227 KB, no stack (spills), and the PTX order
of its PDL protocol (the state's `cp.async` copies before `griddepcontrol.wait`, `launch_dependents` after it, and
the projections' loads after that).

    PYTHONPATH=/path/to/triton-3.6:benchmarks:. python benchmarks/kda_gluon_compile_sm90.py [--only REGEX]

Variants: every (block_v, buffers, warps) of `VARIANTS` for head dim 128, with and without the norm epilogue and
the lower-bound gate, and those of `LOW_RANK_VARIANTS` with the low-rank gates' up projections in the kernel (H,
strides and the slot count are run-time values). Use the Triton the GPU runs (`pip
install --target DIR triton==3.6.0`). Prints one line a variant, then "<n> failed"; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import re
import sys

import triton
from sm90_compile import TARGET, TRIGGER, WAIT, cubin_usage, report_builds

from tokenspeed.ops.triton import kda_decode_gluon

D = 128
# (block_v, buffers, warps): the whole head in shared memory (64 KB) and rings of 16 / 32 KB
VARIANTS = ((16, 8, 4), (8, 16, 4), (32, 4, 4), (8, 8, 4), (16, 4, 4), (8, 4, 4), (32, 2, 4), (16, 2, 4))
# with the low-rank gate inputs (one token per sequence at few pairs: the whole head, or half of it, in buffers)
LOW_RANK_VARIANTS = ((32, 4, 4), (16, 8, 4), (32, 2, 4))


def compile_variant(block_v: int, buffers: int, num_warps: int, norm: bool, lower_bound: bool,
                    low_rank: str = "") -> dict:
    """Build the kernel for sm_90 and return its shared memory, registers, stack and the PTX positions of the
    first cp.async, the PDL wait / trigger and the first ld.global after the wait. low_rank: "f" (K3: f's up
    projection in the kernel), "fg" (Kimi Linear: f's and the norm gate's), "" (none), at rank 128."""
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = kda_decode_gluon._kda_decode_gluon_kernel
    consts = {"H": 32, "D": D, "BV": block_v, "NBUF": buffers, "HAS_LB": lower_bound, "NORM": norm, "PDL": True,
              "NW": num_warps, "LOW_RANK_F": "f" in low_rank, "LOW_RANK_G": "g" in low_rank, "RANK": 128}
    ptrs = {"QKV": "*bf16", "F": "*bf16", "Bt": "*bf16", "CW": "*fp32", "CS": "*bf16", "A_log": "*fp32",
            "DT": "*fp32", "S": "*fp32", "SLOTS": "*i32", "CU": "*i32", "O": "*bf16", "G": "*bf16", "NWT": "*fp32",
            "FB": "*bf16", "GA": "*bf16", "GB": "*bf16"}
    ints = ("stride_qkv", "stride_ft", "stride_fh", "stride_bt", "stride_bh", "stride_css", "stride_csc",
            "stride_csw", "stride_ss", "stride_gt", "stride_gh", "stride_ga")
    div16_extra = ("stride_ga",)
    sig = {**ptrs, **dict.fromkeys(ints, "i64"), **dict.fromkeys(("lower_bound", "scale", "norm_eps"), "fp32"),
           **dict.fromkeys(consts, "constexpr")}
    sig = {name: sig[name] for name in fn.arg_names}
    div16 = [*ptrs, "stride_qkv", "stride_ft", "stride_css", "stride_ss", "stride_gt", *div16_extra]
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    for k in ("stride_fh", "stride_gh"):  # = D: 16-divisible too
        attrs[(fn.arg_names.index(k),)] = [["tt.divisibility", 16]]
    kernel = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=TARGET,
                            options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    wait = ptx.find(WAIT)
    return {"shared": kernel.metadata.shared, **cubin_usage(kernel), "copy": ptx.find("cp.async.cg"),
            "wait": wait, "trigger": ptx.find(TRIGGER), "load_after": ptx.find("ld.global", wait)}


def problems(r: dict) -> list[str]:
    """What is wrong with a compiled variant (empty: nothing)."""
    out = []
    if r["shared"] > kda_decode_gluon.SMEM_PER_PROGRAM:
        out.append(f"shared {r['shared']} > {kda_decode_gluon.SMEM_PER_PROGRAM}")
    if r["stack"]:
        out.append(f"{r['stack']} B of stack (spills)")
    if not 0 <= r["copy"] < r["wait"] < r["trigger"] < r["load_after"]:
        out.append("PTX order is not cp.async < wait < launch_dependents < ld.global")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="regex on the variant name")
    args = ap.parse_args()
    variants = {}
    for bv, nb, w in VARIANTS:
        for norm in (True, False):
            for lb in (True, False):
                variants[f"bv{bv} buf{nb} w{w}{' norm' if norm else ''}{' lb' if lb else ''}"] = (bv, nb, w, norm, lb)
    for bv, nb, w in LOW_RANK_VARIANTS:  # Kimi Linear (f and the gate, softplus decay) and K3 (f, lower bound)
        variants[f"bv{bv} buf{nb} w{w} norm low-rank f+g"] = (bv, nb, w, True, False, "fg")
        variants[f"bv{bv} buf{nb} w{w} norm lb low-rank f"] = (bv, nb, w, True, True, "f")
    names = [n for n in variants if not args.only or re.search(args.only, n)]
    return report_builds({n: variants[n] for n in names}, compile_variant, problems, _usage)


def _usage(r: dict) -> str:
    return f"shared {r['shared']} regs {r['regs']} stack {r['stack']}"

if __name__ == "__main__":
    sys.exit(main())
