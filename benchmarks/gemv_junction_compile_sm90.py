"""Compile the fused junction GEMV (`tokenspeed.ops.triton.gemv_junction`) for sm_90 on a host without a GPU, with
PDL on or off, and report its shared memory, registers, spill stack and whether the weight tiles go through the
tensor cores (wgmma) and asynchronous copies, or its error.

    PYTHONPATH=/path/to/triton-3.6:benchmarks:. python benchmarks/gemv_junction_compile_sm90.py [--no-pdl]

Launches caught (not run) from `junction_gemv` on zero bf16 CPU tensors at kimi-linear-48b-a3b's shapes (D 2304,
top 8 + 1, in_proj 12576 and q / kv_a 6720 rows with the packaged table's tiles) for T = 1, 2, 3, 4 and both
LOOKAHEAD settings. With PDL the PTX must show griddepcontrol.wait before launch_dependents and the first weight
tile's load before the wait. Exit status 1 if anything fails (a spill counts as a failure).
"""

from __future__ import annotations

import argparse
import sys

import sm90_compile as sc
import torch
import triton
from moe_compile_sm90 import compile_sm90

from tokenspeed.ops import dispatch
from tokenspeed.ops.triton import gemv_junction

D, K_PAIRS = 2304, 9


def call(T: int, N: int, lookahead: int):
    def run():
        bf = torch.bfloat16
        cfg = gemv_junction.junction_config(T, N, D, dispatch.linear_route(T, N, D, bf))
        gemv_junction.junction_gemv(torch.zeros(T * K_PAIRS, D, dtype=bf), torch.zeros(T * K_PAIRS), K_PAIRS,
                                    torch.zeros(T, D, dtype=bf), torch.ones(D, dtype=bf), 1e-6,
                                    torch.zeros(N, D, dtype=bf), torch.empty(T, D, dtype=bf), lookahead=lookahead,
                                    **cfg)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-pdl", action="store_true")
    args = ap.parse_args()
    pdl_on = not args.no_pdl
    print(f"triton {triton.__version__}, target {sc.TARGET}, PDL {pdl_on}", flush=True)
    failed = 0
    for N in (12576, 6720):
        for T in (1, 2, 3, 4):
            for la in (1, 0):
                for fn, grid, a, kw in sc.catch_launches({gemv_junction: ("_gemv_junction_kernel",)},
                                                         call(T, N, la), pdl_on=pdl_on):
                    tag = (f"N{N} T{T} la{la} grid {grid[0]} BN {kw['BLOCK_N']} BK {kw['BLOCK_K']} "
                           f"w{kw['num_warps']} s{kw['num_stages']}")
                    try:
                        r = compile_sm90(fn, sc.pack_launch(fn, a, kw))
                    except Exception as e:  # noqa: BLE001 - report every variant that does not compile
                        failed += 1
                        print(sc.failure_line(tag + "  ", e, 400), flush=True)
                        continue
                    bad = ["no spills"] if r["stack"] else []
                    if pdl_on and not sc.wait_then_trigger(r["ptx"]):
                        bad.append("griddepcontrol.wait, then launch_dependents")
                    if pdl_on and not sc.loads_before_wait(r["ptx"]):
                        bad.append("the first weight tile loaded before the wait")
                    asyncs = r["ptx"].count("cp.async.cg") + r["ptx"].count("cp.async.ca")
                    failed += bool(bad)
                    print(f"{tag}  smem {r['shared']} B  regs {r['regs']}  stack {r['stack']}  wgmma {r['wgmma']}"
                          f"  cp.async {asyncs}" + ("  ok" if not bad else "  CHECK FAILED: " + "; ".join(bad)),
                          flush=True)
    print(f"{failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
