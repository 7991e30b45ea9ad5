"""Compile the MLA decode-path kernels for sm_90 on a host without a GPU, with PDL on, and report each one's shared
memory, registers per thread and spill stack (Triton's own ptxas and cuobjdump), or its error.

    PYTHONPATH=DIR:. python benchmarks/mla_compile_sm90.py      # DIR: the Triton the GPU runs (pip --target)

Kernels: `mla_decode`'s split and combine kernels (Kimi-Linear's shapes: H 32, Dl 576 = 512 + 64, page 64; bf16
queries over bf16 / fp8 caches; Q 1 and 4; the q / q_rope views of the model's decode; the default and the
16-row tile; N 1 and 64) and `mla_norm_store_latent`'s kernel (bf16 kv_a into bf16 / fp8 caches, kv_scale 1 and
not). The wrappers run on small CPU tensors with `pdl.enabled` forced on; their launches are caught and handed to
`triton.compile` for GPUTarget("cuda", 90, 32) with the signature and specialisations the JIT would derive.
Exits non-zero when a variant fails. Needs no CUDA driver (do not set TRITON_INTERPRET).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from tokenspeed.ops.triton import mla_decode as k_dec
from tokenspeed.ops.triton import mla_prep as k_prep
from tokenspeed.ops.triton import pdl

TARGET = GPUTarget("cuda", 90, 32)


class _Catch:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kw)` records the call."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.fn, args, kw))


def caught(module, names: tuple[str, ...], run) -> list:
    """The (kernel, args, kwargs) that `run()` launches of `module`'s kernels `names`, with PDL forced on. A kernel
    is caught in every loaded tokenspeed.ops.triton module that binds it (a re-exported kernel, e.g. mla_decode's
    `_mla_combine_uv_kernel`, launches from the module that defines it)."""
    calls: list = []
    kernels = {n: getattr(module, n) for n in names}
    homes = [m for key, m in list(sys.modules.items()) if key.startswith("tokenspeed.ops.triton") and m is not None]
    saved = [(m, n, f) for m in homes for n, f in kernels.items() if vars(m).get(n) is f]
    saved_pdl = pdl.enabled, pdl.launch_kwargs
    pdl.enabled = lambda device, family="": True
    pdl.launch_kwargs = lambda device, family="": {"launch_pdl": True}
    for m, n, f in saved:
        setattr(m, n, _Catch(f, calls))
    try:
        run()
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
        pdl.enabled, pdl.launch_kwargs = saved_pdl
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
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "stack": int(stack.group(1)) if stack else None, "griddep": "griddepcontrol.wait" in ptx}


def decode_variants() -> dict:
    """tag -> a thunk running `mla_decode` once (bf16 q; the cache dtype, Q, N and the query form vary)."""
    H, V, R, PAGE = 32, 512, 64, 64
    out = {}
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for N, Q, split_q, block_h in ((1, 1, True, None), (1, 1, False, None), (64, 1, True, None),
                                       (4, 4, True, None), (1, 1, True, 16)):
            cache = torch.zeros(4, PAGE, V + R, dtype=cache_dtype)
            table, lens = torch.zeros(N, 2, dtype=torch.int32), torch.full((N,), 100)
            q = torch.zeros(N, Q, H, V + R, dtype=torch.bfloat16)
            qa, qr = (q[..., :V], q[..., V:]) if split_q else (q, None)
            kw = {"BLOCK_H": block_h} if block_h else {}
            tag = (f"{str(cache_dtype).split('.')[-1]:13s} N{N:<2d} Q{Q} {'views' if split_q else 'full '} "
                   f"BH{block_h or 'def'}")
            out[tag] = (lambda qa=qa, qr=qr, cache=cache, table=table, lens=lens, kw=kw:
                        k_dec.mla_decode(qa, cache, table, lens, 0.07, V, 0.5, q_rope=qr, max_splits=8, **kw))
    return out


def uv_variants() -> dict:
    """tag -> a thunk running `mla_decode` with the W_UV product fused into the combine (bf16 q over bf16 / fp8
    caches; N1 Q1 the batch-1 decode, N4 Q4 verify, N64 Q1; the balanced and the uniform plan)."""
    H, V, R, PAGE, VH = 32, 512, 64, 64, 128
    out = {}
    w = torch.zeros(H, 128 + VH, V, dtype=torch.bfloat16)[:, 128:]  # the W_UV view of kv_b_proj's weight
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for N, Q, balanced, ms in ((1, 1, True, 8), (1, 1, True, 1), (4, 4, True, 8), (64, 1, False, 2)):
            cache = torch.zeros(4, PAGE, V + R, dtype=cache_dtype)
            table, lens = torch.zeros(N, 2, dtype=torch.int32), torch.full((N,), 100)
            q = torch.zeros(N, Q, H, V + R, dtype=torch.bfloat16)
            tag = f"{str(cache_dtype).split('.')[-1]:13s} N{N:<2d} Q{Q} W_UV {'bal' if balanced else 'uni'} ms{ms}"
            out[tag] = (lambda q=q, cache=cache, table=table, lens=lens, balanced=balanced, ms=ms:
                        k_dec.mla_decode(q[..., :V], cache, table, lens, 0.07, V, 0.5, q_rope=q[..., V:], max_splits=ms,
                                         balanced=balanced, w_uv=w))
    return out


def absorb_variants() -> dict:
    """tag -> a thunk running `mla_norm_store_absorb` (the store + the W_UK absorption in one launch)."""
    H, NOPE, V = 32, 128, 128
    out = {}
    w_uk = torch.zeros(H, NOPE + V, 512, dtype=torch.bfloat16)[:, :NOPE]
    for cache_dtype, kv_scale in ((torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.25)):
        for T in (1, 64):
            kv_a = torch.zeros(T, 576, dtype=torch.bfloat16)
            q = torch.zeros(T, H, NOPE + 64, dtype=torch.bfloat16)
            cache = torch.zeros(4, 64, 576, dtype=cache_dtype)
            w, slots = torch.zeros(512, dtype=torch.bfloat16), torch.zeros(T, dtype=torch.int64)
            tag = f"{str(cache_dtype).split('.')[-1]:13s} T{T} absorb kv_scale {kv_scale}"
            out[tag] = (lambda kv_a=kv_a, q=q, cache=cache, w=w, slots=slots, kv_scale=kv_scale:
                        k_prep.mla_norm_store_absorb(kv_a[:, :512], kv_a[:, 512:], w, 1e-6, cache, slots, kv_scale,
                                                     q[..., :NOPE], w_uk))
    return out


def store_variants() -> dict:
    out = {}
    for cache_dtype, kv_scale in ((torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.25), (torch.float8_e4m3fn, 1.0)):
        for T in (1, 8):
            kv_a = torch.zeros(T, 576, dtype=torch.bfloat16)
            cache = torch.zeros(4, 64, 576, dtype=cache_dtype)
            w, slots = torch.zeros(512, dtype=torch.bfloat16), torch.zeros(T, dtype=torch.int64)
            tag = f"{str(cache_dtype).split('.')[-1]:13s} T{T} kv_scale {kv_scale}"
            out[tag] = (lambda kv_a=kv_a, cache=cache, w=w, slots=slots, kv_scale=kv_scale:
                        k_prep.mla_norm_store_latent(kv_a[:, :512], kv_a[:, 512:], w, 1e-6, cache, slots, kv_scale))
    return out


def main() -> int:
    print(f"triton {triton.__version__}, target {TARGET}", flush=True)
    failed = 0
    dec_names = ("_mla_split_kernel", "_mla_combine_kernel", "_mla_combine_uv_kernel")
    groups = ((k_dec, dec_names, decode_variants()), (k_dec, dec_names, uv_variants()),
              (k_prep, ("_norm_store_kernel",), store_variants()),
              (k_prep, ("_norm_store_absorb_kernel",), absorb_variants()))
    for module, names, variants in groups:
        for tag, run in variants.items():
            for fn, args, kw in caught(module, names, run):
                try:
                    r = compile_sm90(fn, args, kw)
                    print(f"{tag:40s} {fn.__name__:26s} smem {r['shared']:6d} B  regs {r['regs']}  stack "
                          f"{r['stack']}  griddepcontrol {r['griddep']}", flush=True)
                    failed += not r["griddep"]
                except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
                    failed += 1
                    print(f"{tag:40s} {fn.__name__:26s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
