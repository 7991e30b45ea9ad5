"""Compile the MLA decode-path kernels for sm_90 on a host without a GPU, with PDL on, and report each one's shared
memory, registers per thread, spill stack and main loop (instructions, spill reloads; Triton's own ptxas and
cuobjdump), or its error.

    PYTHONPATH=DIR:. python benchmarks/mla_compile_sm90.py [--uniform-plan]   # DIR: the Triton the GPU runs

Kernels: `mla_decode`'s split and combine kernels (Kimi-Linear's shapes: H 32, Dl 576 = 512 + 64, page 64; bf16
queries over bf16 / fp8 caches; Q 1 and 4; the q / q_rope views of the model's decode; the default and the
16-row tile; N 1 and 64) and `mla_norm_store_latent`'s kernel (bf16 kv_a into bf16 / fp8 caches, kv_scale 1 and
not). The wrappers run on small CPU tensors with `pdl.enabled` forced on; their launches are caught and handed to
`triton.compile` for GPUTarget("cuda", 90, 32) with the signature and specialisations the JIT would derive
(benchmarks/sm90_compile.py). Exits non-zero when a variant fails. Needs no CUDA driver (do not set TRITON_INTERPRET).
"""

from __future__ import annotations

import sys

import torch
import triton
from sm90_compile import TARGET, Launch, catch_launches, compile_launch, cubin_usage, failure_line, loop_usage

from tokenspeed.ops.triton import mla_decode as k_dec
from tokenspeed.ops.triton import mla_prep as k_prep

DECODE_KERNELS = ("_mla_split_kernel", "_mla_combine_kernel", "_mla_combine_uv_kernel")


def caught(module, names: tuple[str, ...], run) -> list[Launch]:
    """The launches that `run()` makes of `module`'s kernels `names` (caught wherever a tokenspeed.ops.triton module
    binds them), with PDL forced on."""
    return catch_launches({module: names}, run, pdl_on=True)


def compile_sm90(launch: Launch) -> dict:
    """Compile one caught launch: shared memory, registers, stack, and whether the PTX has the PDL wait."""
    kernel = compile_launch(launch)
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, **cubin_usage(kernel), **loop_usage(kernel),
            "griddep": "griddepcontrol.wait" in ptx}


def report(tag: str, width: int, launch: Launch, name_width: int) -> bool:
    """Compile `launch` and print its line (`tag` padded to `width`); returns whether it passed (compiled, with
    the PDL wait)."""
    head = f"{tag:{width}s} {launch.fn.__name__:{name_width}s} "
    try:
        r = compile_sm90(launch)
    except Exception as e:  # noqa: BLE001 - report every variant that does not compile, then go on
        print(failure_line(head, e, 300), flush=True)
        return False
    print(f"{head}smem {r['shared']:6d} B  regs {r['regs']}  stack {r['stack']}  loop {r['loop_ins']} ins "
          f"{r['loop_reloads']} reloads  griddepcontrol {r['griddep']}", flush=True)
    return r["griddep"]


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


def ragged_variants() -> dict:
    """tag -> a thunk running the ragged `mla_decode` (query lengths 1 and 3: the ragged combine, or the W_UV
    combine's ragged form; bf16 q over bf16 / fp8 caches)."""
    H, V, R, PAGE, VH = 32, 512, 64, 64, 128
    out = {}
    w = torch.zeros(H, 128 + VH, V, dtype=torch.bfloat16)[:, 128:]
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for uv in (False, True):
            cache = torch.zeros(4, PAGE, V + R, dtype=cache_dtype)
            table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.full((2,), 100)
            q, cu = torch.zeros(4, H, V + R, dtype=torch.bfloat16), torch.tensor([0, 1, 4], dtype=torch.int32)
            tag = f"{str(cache_dtype).split('.')[-1]:13s} ragged 1+3 {'W_UV' if uv else 'plain'}"
            out[tag] = (lambda q=q, cache=cache, table=table, lens=lens, cu=cu, uv=uv:
                        k_dec.mla_decode(q[..., :V], cache, table, lens, 0.07, V, 0.5, q_rope=q[..., V:], max_splits=8,
                                         cu_seqlens_q=cu, max_q=3, w_uv=w if uv else None))
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
    """tag -> a thunk running `mla_norm_store_latent` (bf16 kv_a into a bf16 / fp8 cache; kv_scale 1 and not)."""
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
    if "--uniform-plan" in sys.argv[1:]:  # the split kernels as with mla_decode.UNIFORM_PLAN on a CUDA device
        k_dec._uniform_plan = lambda q: True
    print(f"triton {triton.__version__}, target {TARGET}", flush=True)
    failed = 0
    groups = ((k_dec, DECODE_KERNELS, decode_variants()), (k_dec, DECODE_KERNELS, uv_variants()),
              (k_dec, DECODE_KERNELS, ragged_variants()),
              (k_prep, ("_norm_store_kernel",), store_variants()),
              (k_prep, ("_norm_store_absorb_kernel",), absorb_variants()))
    for module, names, variants in groups:
        for tag, run in variants.items():
            failed += sum(not report(tag, 40, launch, 26) for launch in caught(module, names, run))
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
