"""Compile the fused MoE gate kernel (`tokenspeed.ops.triton.moe_gate`) for sm_90 on a host without a GPU, with
programmatic dependent launch (PDL) on or off, and report its shared memory, registers per thread and spill stack
(Triton's own ptxas and cuobjdump), the PTX facts of its PDL protocol, or its error.

    PYTHONPATH=/path/to/triton-3.6:benchmarks:. python benchmarks/moe_gate_compile_sm90.py [--no-pdl]
        [--only REGEX] [--sass]

The wrapper runs on small CPU tensors at Kimi-Linear's shapes (bf16, hidden 2304, 256 experts, top-8 plus the
folded shared expert as id 256, the correction bias) for T = 1, 2, 3, 4, 8, 16 (default configuration; then a
few other `GateConfig`s) with `pdl.enabled` forced to the chosen value; its launch is caught instead of run and
handed to `triton.compile` for GPUTarget("cuda", 90, 32) with the signature and specialisations the JIT derives
(benchmarks/sm90_compile.py, and `moe_compile_sm90.compile_sm90`). With PDL the PTX must show
`griddepcontrol.wait` before `griddepcontrol.launch_dependents`, the router-weight loads before the wait and the
counter's atomic after it. Then the benchmark routing kernel (`moe_route.simulate_uniform_routing`, no PDL: no
griddepcontrol) at 1 and 64 rows. Use the Triton the GPU runs (e.g. `pip install --target DIR triton==3.6.0`). Exit
status 1 if anything fails (a spill counts as a failure).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

import sm90_compile as sc
import torch
import triton
from moe_compile_sm90 import compile_sm90

from tokenspeed.ops.triton import moe_gate, moe_route

KIMI = {"k": 8, "E": 256, "K": 2304}
TOKENS = (1, 2, 3, 4, 8, 16)


def caught(call: Callable[[], object], pdl_on: bool) -> list[sc.Launch]:
    """The launches (fn, grid, args, kwargs) of call(), with `pdl.enabled` forced to pdl_on."""
    return sc.catch_launches({moe_gate: ("_moe_gate_kernel",)}, call, pdl_on=pdl_on)


def gate_call(T: int, shared: bool = True, bias: bool = True, config: moe_gate.GateConfig | None = None
              ) -> Callable[[], object]:
    """`moe_gate` on zero bf16 CPU tensors at Kimi-Linear's shapes."""
    def call():
        dt, K, E = torch.bfloat16, KIMI["K"], KIMI["E"]
        a = torch.zeros(T, K, dtype=dt)
        moe_gate.moe_gate(a, a.clone(), torch.ones(K, dtype=dt), 1e-6, torch.zeros(E, K, dtype=dt),
                          torch.zeros(E) if bias else None, KIMI["k"], routed_scaling_factor=2.446,
                          shared_expert_id=E if shared else None, config=config)
    return call


def pdl_checks(ptx: str, pdl_on: bool) -> list[str]:
    """The PTX facts of the PDL protocol; returns the failed ones."""
    if not pdl_on:
        return ["no griddepcontrol without PDL"] if sc.has_griddepcontrol(ptx) else []
    bad = [] if sc.wait_then_trigger(ptx) else ["griddepcontrol.wait, then launch_dependents"]
    if not sc.loads_before_wait(ptx):
        bad.append("the router weight loaded before the wait")
    if not 0 <= ptx.find(sc.WAIT) < ptx.find("atom."):
        bad.append("the counter's atomic after the wait")
    return bad


def variants() -> list[tuple[str, Callable[[], object]]]:
    """(tag, call): the default configuration at each of `TOKENS`, then other `GateConfig`s."""
    out = [(f"T{T}", gate_call(T)) for T in TOKENS]
    out += [("T1_nobias_noshared", gate_call(1, shared=False, bias=False))]
    # other launch configurations (the default's alternatives for timing on the GPU)
    for T, n, t, w in ((1, 1, 1, 4), (1, 2, 1, 4), (1, 4, 1, 4), (1, 4, 1, 8), (4, 2, 4, 8), (16, 1, 4, 8),
                       (16, 4, 2, 8)):
        out.append((f"T{T}_n{n}_t{t}_w{w}", gate_call(T, config=moe_gate.GateConfig(n, t, w))))
    return out


def simulate_launches() -> list[tuple[str, sc.Launch]]:
    """The benchmark routing kernel (`moe_route.simulate_uniform_routing`, launched without PDL) at Kimi-Linear's
    routing (k 8 of 256 plus the shared column) for 1 and 64 rows."""
    out = []
    for T in (1, 64):
        def call(T=T):
            moe_route.simulate_uniform_routing(torch.zeros(T, KIMI["k"] + 1), torch.zeros(T, KIMI["k"] + 1,
                                               dtype=torch.int64), KIMI["k"], KIMI["E"], salt=7)
        out += [(f"simulate_T{T}", launch) for launch in sc.catch_launches(
            {moe_route: ("_simulate_routing_kernel",)}, call)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="regex of variant names")
    ap.add_argument("--no-pdl", action="store_true", help="compile without PDL (the interpreter's kernels)")
    ap.add_argument("--sass", action="store_true", help="print a hash of each kernel's SASS")
    args = ap.parse_args()
    pdl_on = not args.no_pdl
    print(f"triton {triton.__version__}, target {sc.TARGET}, PDL {pdl_on}", flush=True)
    failed = 0
    for tag, call in variants():
        if args.only and not re.search(args.only, tag):
            continue
        for fn, grid, a, kw in caught(call, pdl_on):
            cfg = f"grid {grid[0]} BLOCK_T {kw['BLOCK_T']} BLOCK_N {kw['BLOCK_N']} warps {kw['num_warps']}"
            try:
                r = compile_sm90(fn, sc.pack_launch(fn, a, kw), args.sass)
            except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
                failed += 1
                print(sc.failure_line(f"{tag:20s} {cfg}  ", e, 300), flush=True)
                continue
            bad = pdl_checks(r["ptx"], pdl_on) + (["no spills"] if r["stack"] else [])
            failed += bool(bad)
            print(f"{tag:20s} {cfg}  smem {r['shared']:6d} B  regs {r['regs']}  stack {r['stack']}"
                  + (f"  sass {r['sass']}" if args.sass else "")
                  + ("  ok" if not bad else "  CHECK FAILED: " + "; ".join(bad)), flush=True)
    for tag, (fn, grid, a, kw) in simulate_launches():
        if args.only and not re.search(args.only, tag):
            continue
        try:
            r = compile_sm90(fn, sc.pack_launch(fn, a, kw), args.sass)
        except Exception as e:  # noqa: BLE001 - report it, then go on
            failed += 1
            print(sc.failure_line(f"{tag:20s} ", e, 300), flush=True)
            continue
        bad = (["no griddepcontrol (launched without PDL)"] if sc.has_griddepcontrol(r["ptx"]) else []) \
            + (["no spills"] if r["stack"] else [])
        failed += bool(bad)
        print(f"{tag:20s} grid {grid[0]}  regs {r['regs']}  stack {r['stack']}"
              + ("  ok" if not bad else "  CHECK FAILED: " + "; ".join(bad)), flush=True)
    print(f"{failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
