"""Compile every routed-expert kernel variant of the prefill sweep for sm_90 on a host without a GPU, and report
each one's shared memory, registers per thread and spill stack (Triton's own ptxas and cuobjdump), or its error.

    PYTHONPATH=benchmarks:. python benchmarks/moe_compile_sm90.py [--only REGEX] [--decode] [--sass]

It runs `moe_experts` on small CPU tensors with each config of `moe_prefill_h200.GATE_UP` / `DOWN`, catches the
kernel launches instead of running them, and hands each (kernel, arguments) to `triton.compile` for
GPUTarget("cuda", 90, 32) with the signature and specialisations the JIT would derive (16-divisible strides,
constant 1s, descriptor block shapes). The shapes are Kimi-Linear's D 2304, I 1024 (E 16, 1024 tokens), so the
EVEN_K choices match both prefill geometries. Use the Triton the GPU runs (e.g. `pip install --target DIR
triton==3.6.0`, then PYTHONPATH=DIR:benchmarks:.): a variant that fails here fails there. Needs no CUDA driver.
--decode compiles instead the decode launches of `default_config` at T = 1, 2, 4, 8 (Kimi-Linear's top-8 of 256),
each in the direct mode (`direct_max_tokens`, no alignment launch) and in the aligned one; --sass adds a hash of
each kernel's SASS (equal hashes: the same machine code).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import replace

import torch
import triton
from moe_prefill_h200 import DOWN, GATE_UP
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import moe_experts as tk

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = ("_gate_up_kernel", "_down_kernel", "_gather_x_kernel", "_combine_kernel", "_align_kernel")


class _Catch:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kw)` records the call."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.fn, args, kw))


def launches(cfg: tk.ExpertsConfig, T: int = 1024, k: int = 8, E: int = 16, D: int = 2304, DI: int = 1024) -> list:
    """The (kernel, args, kwargs) that moe_experts launches for this config (bf16, SiLU; torch alignment)."""
    calls: list = []
    saved = {n: getattr(tk, n) for n in KERNELS}
    for n, f in saved.items():
        setattr(tk, n, _Catch(f, calls))
    try:
        dt = torch.bfloat16
        x, w1, w2 = torch.zeros(T, D, dtype=dt), torch.zeros(E, DI, D, dtype=dt), torch.zeros(E, D, DI, dtype=dt)
        ids = torch.randint(0, E, (T, k))
        tk.moe_experts(x, w1, w1.clone(), w2, torch.rand(T, k), ids, Activation("silu"), config=cfg)
    finally:
        for n, f in saved.items():
            setattr(tk, n, f)
    return calls


def compile_sm90(fn, args, kwargs) -> dict:
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    ptx = kernel.asm["ptx"]
    sass = "\n".join(line for line in sass.splitlines() if not line.lstrip().startswith(("code for", "Fatbin")))
    return {"shared": kernel.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "stack": int(stack.group(1)) if stack else None, "tma": "cp.async.bulk.tensor" in ptx,
            "wgmma": "wgmma.mma_async" in ptx, "sass": hashlib.sha1(sass.encode()).hexdigest()[:12]}


def decode_variants() -> list[tuple[str, tk.ExpertsConfig, int]]:
    """(tag, config, T) of the decode launches: `default_config` at Kimi-Linear's shapes, direct and aligned."""
    out = []
    for T in (1, 2, 4, 8):
        cfg = tk.default_config(T, 8, 256, 2304, 1024)
        out += [(f"decode_T{T}_direct", replace(cfg, direct_max_tokens=T), T),
                (f"decode_T{T}_aligned", replace(cfg, direct_max_tokens=0), T)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="regex of variant names")
    ap.add_argument("--decode", action="store_true", help="the decode launches (direct and aligned), not prefill")
    ap.add_argument("--sass", action="store_true", help="print a hash of each kernel's SASS")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target {TARGET}", flush=True)
    if args.decode:
        variants = [(tag, cfg, T, ("_gate_up_kernel", "_down_kernel")) for tag, cfg, T in decode_variants()]
    else:
        variants = [(tag, cfg, 1024, ("_gate_up_kernel", "_gather_x_kernel") if tag.startswith("g")
                     else ("_down_kernel",)) for tag, cfg in [*GATE_UP.items(), *DOWN.items()]]
    failed = 0
    for tag, cfg, T, want in variants:
        if args.only and not re.search(args.only, tag):
            continue
        for fn, a, kw in launches(cfg, T=T):
            if fn.__name__ not in want:
                continue
            try:
                r = compile_sm90(fn, a, kw)
                print(f"{tag:28s} {fn.__name__:17s} smem {r['shared']:6d} B  regs {r['regs']}  stack {r['stack']}"
                      f"  tma {r['tma']}  wgmma {r['wgmma']}" + (f"  sass {r['sass']}" if args.sass else ""),
                      flush=True)
            except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
                failed += 1
                print(f"{tag:28s} {fn.__name__:17s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"{failed} failed", flush=True)


if __name__ == "__main__":
    main()
