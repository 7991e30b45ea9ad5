"""Compile the PDL variants of the decode kernels for sm_90 on a host without a GPU and check their machine code:
GEMV (every prefetch mode, both kinds, split-K fused and two-launch, a whole weight slice per program at 1 and 3
stages), RMSNorm (plain, gated, residual), gated
activation, causal conv1d (conv + state kernels), AttnRes mix (split, tile and online schedules), the stacked
GEMV (KDA's gate up-projections), and the
spinning producer of benchmarks/gemv_pdl_chain_h200.py.

    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/pdl_compile_sm90.py [--only REGEX] [--ptx DIR]

Each wrapper is called on small CPU tensors with `pdl.enabled` forced True; its kernel launches are caught
instead of run and handed to `triton.compile` for GPUTarget("cuda", 90, 32) with the signature and
specialisations the JIT would derive (benchmarks/sm90_compile.py). Per kernel it prints registers and spill bytes
(ptxas -v on the PTX), shared memory, and the PTX checks: `griddepcontrol.wait` present and
`griddepcontrol.launch_dependents` after it; for the GEMV's "l2" mode the `cp.async.bulk.prefetch.L2.global`
before the wait, for "regs" a global load of W before the wait; and whether the K loop was software-pipelined
(`cp.async` copies, dot kernels). Exit status 1 if any variant fails to compile or a check fails. Needs no CUDA
driver; use the Triton the GPU runs (3.6).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

import gemv_pdl_chain_h200 as chain  # the A/B chain's spinning producer (this script's folder is on sys.path)
import sm90_compile as sc
import torch
import triton

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import activation, attn_res, conv, gemv, norm, stacked_gemv


def caught(module, names: tuple[str, ...], call: Callable[[], object]) -> list[sc.Launch]:
    """The kernel launches that call() makes through module.<names>, with PDL forced on."""
    return sc.catch_launches({module: names}, call, pdl_on=True)


def compile_sm90(launch: sc.Launch) -> dict:
    """Compile one caught launch; returns its PTX, shared memory, and the registers and spill bytes of `ptxas -v`
    run on the PTX (the other scripts read cuobjdump's STACK instead, a frame size, not spill traffic)."""
    kernel = sc.compile_launch(launch)
    ptx = kernel.asm["ptx"]
    return {"ptx": ptx, "shared": kernel.metadata.shared, **sc.ptxas_usage(ptx)}


def ptx_checks(ptx: str, prefetch: str | None, pipelined: bool) -> list[str]:
    """The PTX facts a PDL variant must show; returns the failed ones."""
    bad = [] if sc.wait_then_trigger(ptx) else ["griddepcontrol.wait, then launch_dependents"]
    wait, pf = ptx.find(sc.WAIT), ptx.find(sc.L2_BULK_PREFETCH)
    if prefetch == "l2" and not 0 <= pf < wait:
        bad.append("cp.async.bulk.prefetch.L2.global before the wait")
    if prefetch != "l2" and pf >= 0:
        bad.append("no L2 prefetch outside mode l2")
    if prefetch == "regs" and not sc.loads_before_wait(ptx):
        bad.append("a global load (the first W tile) before the wait")
    if prefetch in ("none", "l2") and sc.loads_before_wait(ptx):
        bad.append("no global load before the wait")
    if pipelined and "cp.async.commit_group" not in ptx:
        bad.append("K loop pipelined (cp.async)")
    return bad


def gemv_variants() -> list[tuple[str, Callable[[], object], str | None, bool]]:
    """(tag, call, prefetch mode, K loop expected pipelined) for the decode shapes of kimi-linear at batch 1."""
    bf = torch.bfloat16
    shapes = [("o_proj", 1, 2304, 4096, bf, {}), ("router_fp32out", 1, 256, 2304, bf, {"out_dtype": torch.float32}),
              ("in_proj", 1, 12576, 2304, bf, {}), ("odd_K", 3, 100, 72, bf, {"block_k": 32}),  # K % 16: no cp.async
              ("fma", 2, 448, 7168, bf, {"kind": "fma", "block_n": 8, "block_k": 512, "num_stages": 2}),
              ("fp32", 4, 256, 2304, torch.float32, {}),
              ("launch_reduce", 1, 256, 2304, bf, {"reduce": "launch", "split_k": 8}),
              ("router_table", 1, 256, 2304, bf, {"kind": "fma", "block_n": 4, "block_k": 512, "split_k": 4,
                                                  "out_dtype": torch.float32})]
    whole = {"kind": "dot", "block_n": 64, "block_k": 256, "split_k": 16, "num_warps": 4}  # K / split == block_k
    # the whole weight slice loaded before the wait ("regs" only): 1 stage as gemv_h200.whole_slice uses, and 3
    # for the shared memory the pipeliner would reserve for a loop with no step left
    shapes += [("o_proj_whole_s1", 1, 2304, 4096, bf, {**whole, "num_stages": 1}),
               ("o_proj_whole_s3", 1, 2304, 4096, bf, {**whole, "num_stages": 3})]
    out = []
    for tag, M, N, K, dt, kw in shapes:
        x, w = torch.zeros(M, K, dtype=dt), torch.zeros(N, K, dtype=dt)
        for mode in ("regs",) if "whole" in tag else gemv.PREFETCHES:
            cfg = gemv.resolve_config(M, N, K, dt.itemsize, x.device, **{k: v for k, v in kw.items()
                                                                          if k != "out_dtype"})
            # a K not 16-aligned gives 2-byte loads, and a whole slice leaves no loop step: no cp.async
            pipelined = cfg.kind == "dot" and K % 16 == 0 and "whole" not in tag
            out.append((f"gemv {tag} {mode}", lambda x=x, w=w, kw=kw, mode=mode: gemv.gemv(x, w, prefetch=mode, **kw),
                        mode, pipelined))
    return out


def other_variants() -> list[tuple[str, object, Callable[[], object]]]:
    """(tag, module, call) of the other PDL wrappers, at decode shapes."""
    bf, d = torch.bfloat16, 2304
    x, w = torch.zeros(1, d, dtype=bf), torch.ones(d, dtype=bf)
    gu = torch.zeros(1, 2048, dtype=bf)
    cx, cw, cs = torch.zeros(1, 4096, dtype=bf), torch.zeros(4096, 4, dtype=bf), torch.zeros(8, 4096, 3, dtype=bf)
    si, cu = torch.zeros(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    blocks, part, q = torch.zeros(5, 1, d, dtype=bf), torch.zeros(1, d, dtype=bf), torch.zeros(d, dtype=bf)
    attn_res._NUM_SMS[torch.device("cpu")] = 132  # the split schedule's residency check
    src = torch.zeros(1, 4096, dtype=bf)
    fa, fw = torch.zeros(1, 12576, dtype=bf)[:, 12288:12544], torch.zeros(2, 4096, 128, dtype=bf)  # KDA's f_a | g_a
    q, kv_b = torch.zeros(1, 32, 192, dtype=bf), torch.zeros(32, 256, 512, dtype=bf)  # kimi-linear's MLA at batch 1
    o_lat, o = torch.zeros(1, 32, 512, dtype=bf), torch.zeros(1, 32, 128, dtype=bf)
    return [
        ("chain producer", chain, lambda: chain.produce(src, src.clone(), 10_000, True)),
        ("norm rms", norm, lambda: norm.rms_norm(x, w, 1e-6)),
        ("norm gated", norm, lambda: norm.gated_rms_norm(x, x, w, 1e-6)),
        ("norm add", norm, lambda: norm.add_rms_norm(x, x.clone(), w, 1e-6)),
        ("activation silu", activation, lambda: activation.gated_activation_merged(gu, Activation("silu"))),
        ("conv", conv, lambda: conv.causal_conv1d(cx, cw, cs, si, cu)),
        ("stacked_gemv fg_b", stacked_gemv, lambda: stacked_gemv.stacked_linear(fa, fw)),
        ("stacked_gemv mla w_uk", stacked_gemv, lambda: stacked_gemv.stacked_linear(q[..., :128], kv_b[:, :128].mT)),
        ("stacked_gemv mla w_uv", stacked_gemv, lambda: stacked_gemv.stacked_linear(o_lat, kv_b[:, 128:], o.mT)),
        *[(f"attn_res {s}", attn_res, lambda s=s: attn_res.attn_res_mix_rms_norm(blocks, part, q, 1e-6, w, 1e-6,
                                                                                  schedule=s))
          for s in ("split", "tile", "online")],
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="regex of variant tags")
    ap.add_argument("--ptx", default="", help="write each kernel's PTX into this folder")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target {sc.TARGET}", flush=True)
    jobs = [(tag, caught(gemv, ("_gemv_dot_kernel", "_gemv_fma_kernel", "_splitk_reduce_kernel"), call), mode, piped)
            for tag, call, mode, piped in gemv_variants() if re.search(args.only, tag)]
    jobs += [(tag, caught(mod, tuple(n for n in dir(mod) if n.endswith("_kernel")), call), None, False)
             for tag, mod, call in other_variants() if re.search(args.only, tag)]
    failed = 0
    for tag, launches, mode, piped in jobs:
        for launch in launches:
            name = launch.fn.__name__
            try:
                r = compile_sm90(launch)
            except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
                failed += 1
                print(sc.failure_line(f"{tag:28s} {name:24s} ", e, 400), flush=True)
                continue
            gemv_main = name.startswith("_gemv_")
            bad = ptx_checks(r["ptx"], mode if gemv_main else None, piped and gemv_main)
            bad += ["no spills"] if r["spill_bytes"] else []
            failed += bool(bad)
            if args.ptx:
                Path(args.ptx).mkdir(parents=True, exist_ok=True)
                (Path(args.ptx) / f"{tag.replace(' ', '_')}.{name}.ptx").write_text(r["ptx"])
            print(f"{tag:28s} {name:24s} regs {r['regs']:>3}  spill {r['spill_bytes']:>4} B  smem {r['shared']:>6} B"
                  f"  {'ok' if not bad else 'CHECK FAILED: ' + '; '.join(bad)}", flush=True)
    print(f"{failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
