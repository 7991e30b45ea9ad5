"""Compile the MoE kernels for sm_90 on a host without a GPU, with programmatic dependent launch (PDL) on or off,
and report each one's shared memory, registers per thread and spill stack (Triton's own ptxas and cuobjdump), the
PTX facts of its PDL protocol, or its error.

    PYTHONPATH=/path/to/triton-3.6:benchmarks:. python benchmarks/moe_compile_sm90.py [--decode] [--no-pdl]
        [--only REGEX] [--sass]

Each wrapper runs on small CPU tensors with `pdl.enabled` forced to the chosen value; its kernel launches (the
router `_moe_route_kernel`, the fused alignment `_align_kernel`, the multi-program alignment's three kernels
(`_align_count_kernel`, `_align_scan_kernel`, `_align_scatter_kernel`), `_gather_x_kernel`, `_gate_up_kernel`,
`_down_kernel`, the combines `_combine_kernel` / `_combine_norm_kernel`) are caught instead of run and handed to
`triton.compile` for GPUTarget("cuda", 90, 32) with the signature and specialisations the JIT would derive
(16-divisible strides, constant 1s, descriptor block shapes); launches that compile to the same kernel are compiled
once. Default: the prefill sweep's configs (`moe_prefill_h200.GATE_UP` / `DOWN`, Kimi-Linear's D 2304, I 1024,
E 16, 1024 tokens). --decode: the decode launches of `default_config` at T = 1, 2, 4, 8, 64 (Kimi-Linear's top-8 of
256 + the folded shared expert), direct and aligned, plain, with `add=` and with the fused junction
(`residual=`), with the folded shared expert as the gate/up prefetch hint, plus the router. With PDL the PTX must
show `griddepcontrol.wait` before `griddepcontrol.launch_dependents`; gate_up's hinted W1 / W3 and the down
kernel's W2 L2 prefetch (`cp.async.bulk.prefetch.L2.global`) and its routing loads (`ld.global.cg`) before the
wait; the combine's pre-wait `.cg` loads of the residual / add; the others no global load before the wait. Use the
Triton the GPU runs (e.g. `pip install --target DIR triton==3.6.0`, then PYTHONPATH=DIR:benchmarks:.): a variant
that fails here fails there. Needs no CUDA driver.
--sass adds a hash of each kernel's SASS (equal hashes: the same machine code). Exit status 1 if anything fails.
The catching and compiling machinery is benchmarks/sm90_compile.py's.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import replace

import sm90_compile as sc
import torch
import triton

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import moe_align, moe_combine, moe_pdl, moe_route
from tokenspeed.ops.triton import moe_experts as tk

KERNELS = {tk: ("_gate_up_kernel", "_down_kernel", "_gather_x_kernel"), moe_combine: ("_combine_kernel",
           "_combine_norm_kernel"), moe_align: ("_align_kernel", "_align_count_kernel", "_align_scan_kernel",
           "_align_scatter_kernel"), moe_route: ("_moe_route_kernel",)}
KIMI = {"k": 8, "E": 256, "D": 2304, "DI": 1024}


def caught(call: Callable[[], object], pdl_on: bool) -> list[sc.Launch]:
    """The launches of call() of the `KERNELS`, with `pdl.enabled` forced to pdl_on (132 SMs assumed)."""
    return sc.catch_launches(KERNELS, call, pdl_on=pdl_on, patches=[(moe_pdl, "_sm_count", lambda device: 132)])


def experts_call(cfg: tk.ExpertsConfig | None, T: int, k: int, E: int, D: int, DI: int, add: bool = False,
                 junction: bool = False) -> Callable[[], object]:
    """moe_experts on zero bf16 CPU tensors (SiLU): plain, with `add=`, and / or with the fused junction; expert
    E - 1 is the `prefetch_expert` hint (Kimi-Linear's folded shared expert)."""
    def call():
        dt = torch.bfloat16
        x, w1, w2 = torch.zeros(T, D, dtype=dt), torch.zeros(E, DI, D, dtype=dt), torch.zeros(E, D, DI, dtype=dt)
        ids = torch.randint(0, E, (T, k))
        kw = {"add": torch.zeros(T, D, dtype=dt)} if add else {}
        if junction:
            kw.update(residual=torch.zeros(T, D, dtype=dt), norm_weight=torch.ones(D, dtype=dt), norm_eps=1e-6)
        tk.moe_experts(x, w1, w1.clone(), w2, torch.rand(T, k), ids, Activation("silu"), config=cfg,
                       prefetch_expert=E - 1, **kw)
    return call


def route_call(T: int) -> Callable[[], object]:
    """`moe_route` of T tokens' fp32 router logits over Kimi-Linear's 256 experts, the shared expert as id 256."""
    E = KIMI["E"]
    return lambda: moe_route.moe_route(torch.zeros(T, E), torch.zeros(E), KIMI["k"], shared_expert_id=E)


def compile_sm90(fn, packed: tuple, sass: bool = False) -> dict:
    """Compile one packed launch (`sc.pack_launch`): shared memory, registers, stack, TMA / wgmma use, the PTX and
    (`sass`) a hash of the SASS."""
    kernel = sc.compile_packed(fn, packed)
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, **sc.cubin_usage(kernel), "tma": "cp.async.bulk.tensor" in ptx,
            "wgmma": "wgmma.mma_async" in ptx, "sass": sc.sass_hash(kernel) if sass else None, "ptx": ptx}


def pdl_checks(name: str, ptx: str, kwargs: dict, pdl_on: bool) -> list[str]:
    """The PTX facts of the PDL protocol for this kernel; returns the failed ones."""
    wait, pf = ptx.find(sc.WAIT), ptx.find(sc.L2_BULK_PREFETCH)
    if not pdl_on:
        return ["no griddepcontrol without PDL"] if sc.has_griddepcontrol(ptx) or pf >= 0 else []
    bad = [] if sc.wait_then_trigger(ptx) else ["griddepcontrol.wait, then launch_dependents"]
    if kwargs.get("PREFETCH") and not 0 <= pf < wait:
        bad.append("the weight L2 prefetch before the wait")
    if not kwargs.get("PREFETCH") and pf >= 0:
        bad.append("no L2 prefetch unless asked")
    pre_loads = sc.loads_before_wait(ptx)
    if name == "_down_kernel":
        if not pre_loads or any(".cg" not in ld for ld in pre_loads):
            bad.append("the routing loads (expert id) before the wait, through L2 only (.cg)")
    elif name in ("_combine_kernel", "_combine_norm_kernel"):
        pre = bool(kwargs.get("HAS_ADD") or name == "_combine_norm_kernel")
        if pre != any(".cg" in ld for ld in pre_loads):
            bad.append("the residual / add loaded (.cg) before the wait" if pre else "no global load before the wait")
    elif pre_loads:
        bad.append("no global load before the wait")
    return bad


def decode_variants() -> list[tuple[str, Callable[[], object]]]:
    """(tag, call) of the decode launches: `default_config` at Kimi-Linear's shapes (k 8 + the shared expert over
    257 experts), direct and aligned, plain / add / fused junction; and the router."""
    out = []
    k, E, D, DI = KIMI["k"] + 1, KIMI["E"] + 1, KIMI["D"], KIMI["DI"]
    for T in (1, 2, 4, 8, 64):
        cfg = tk.default_config(T, k, E, D, DI)
        modes = [("aligned", replace(cfg, direct_max_tokens=0))]
        if T <= tk.DIRECT_MAX_TOKENS:
            modes[:0] = [("direct", replace(cfg, direct_max_tokens=T))]
        for mode, c in modes:
            out += [(f"T{T}_{mode}", experts_call(c, T, k, E, D, DI)),
                    (f"T{T}_{mode}_add", experts_call(c, T, k, E, D, DI, add=True)),
                    (f"T{T}_{mode}_junction", experts_call(c, T, k, E, D, DI, junction=True)),
                    (f"T{T}_{mode}_add_junction", experts_call(c, T, k, E, D, DI, add=True, junction=True))]
        out.append((f"T{T}_route", route_call(T)))
    return out


def prefill_variants() -> list[tuple[str, Callable[[], object]]]:
    """(tag, call) of the prefill sweep's gate_up / down configs (moe_prefill_h200) at 1024 tokens, E 16."""
    from moe_prefill_h200 import DOWN, GATE_UP

    return [(tag, experts_call(cfg, 1024, 8, 16, 2304, 1024)) for tag, cfg in [*GATE_UP.items(), *DOWN.items()]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="regex of variant names")
    ap.add_argument("--decode", action="store_true", help="the decode launches (direct and aligned), not prefill")
    ap.add_argument("--no-pdl", action="store_true", help="compile without PDL (the interpreter's kernels)")
    ap.add_argument("--sass", action="store_true", help="print a hash of each kernel's SASS")
    args = ap.parse_args()
    pdl_on = not args.no_pdl
    print(f"triton {triton.__version__}, target {sc.TARGET}, PDL {pdl_on}", flush=True)
    seen: dict = {}
    failed = 0
    for tag, call in decode_variants() if args.decode else prefill_variants():
        if args.only and not re.search(args.only, tag):
            continue
        for fn, _, a, kw in caught(call, pdl_on):
            packed = sc.pack_launch(fn, a, kw)
            key = (fn.__name__, repr(packed[1:]))
            if key in seen:
                print(f"{tag:28s} {fn.__name__:21s} = {seen[key]}", flush=True)
                continue
            seen[key] = tag
            try:
                r = compile_sm90(fn, packed, args.sass)
            except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
                failed += 1
                print(sc.failure_line(f"{tag:28s} {fn.__name__:21s} ", e, 300), flush=True)
                continue
            bad = pdl_checks(fn.__name__, r["ptx"], kw, pdl_on) + (["no spills"] if r["stack"] else [])
            failed += bool(bad)
            print(f"{tag:28s} {fn.__name__:21s} smem {r['shared']:6d} B  regs {r['regs']}  stack {r['stack']}"
                  f"  tma {r['tma']}  wgmma {r['wgmma']}" + (f"  sass {r['sass']}" if args.sass else "")
                  + ("  ok" if not bad else "  CHECK FAILED: " + "; ".join(bad)), flush=True)
    print(f"{failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
