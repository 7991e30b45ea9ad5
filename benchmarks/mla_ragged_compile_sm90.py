"""Compile the ragged `mla_decode` launches (split and combine kernels, RAGGED on) for sm_90 on a host without a
GPU, with PDL on, and report each one's shared memory, registers per thread and spill stack, or its error.

    PYTHONPATH=DIR:. python benchmarks/mla_ragged_compile_sm90.py   # DIR: the Triton the GPU runs (pip --target)

Variants: Kimi-Linear's shapes (H 32, Dl 576 = 512 + 64, page 64), bf16 queries over bf16 / fp8 caches, the q /
q_rope views of the model and the concatenated query, 15 decodes + a tail and a lone tail, the default 32-row tile
and the 16-row one, max_splits 1 (no combine) and the default, and the W_UV-fused combine (`w_uv`). Uses
benchmarks/mla_compile_sm90.py's report and benchmarks/sm90_compile.py (launches caught from the wrapper with
`pdl.enabled` forced on, handed to triton.compile for GPUTarget cuda 90).
Exits non-zero when a variant fails to compile or lacks the PDL wait (a spill stack is reported, not failed).
"""

from __future__ import annotations

import sys

import torch
import triton
from mla_compile_sm90 import DECODE_KERNELS, caught, report  # benchmarks/ (the script's folder is on sys.path)
from sm90_compile import TARGET

from tokenspeed.ops.triton import mla_decode as k_dec


def ragged_variants() -> dict:
    """tag -> a thunk running the ragged `mla_decode` once on small CPU tensors of the real widths."""
    H, V, R, PAGE = 32, 512, 64, 64
    out = {}
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for q_lens, split_q, block_h, ms, uv in (([1] * 15 + [64], True, None, None, False),
                                                 ([1] * 15 + [64], False, None, None, False),
                                                 ([256], True, None, 1, False), ([1, 9], True, 16, None, False),
                                                 ([1] * 15 + [64], True, None, None, True),
                                                 ([1, 9], True, None, 1, True)):
            N, T = len(q_lens), sum(q_lens)
            cache = torch.zeros(4, PAGE, V + R, dtype=cache_dtype)
            table, lens = torch.zeros(N, 2, dtype=torch.int32), torch.full((N,), 100)
            cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
            q = torch.zeros(T, H, V + R, dtype=torch.bfloat16)
            qa, qr = (q[..., :V], q[..., V:]) if split_q else (q, None)
            kw = {"BLOCK_H": block_h} if block_h else {}
            ms = ms or k_dec.default_max_splits(N, block_h or 32, 132, block_h=block_h or 32)  # the H200 default
            tag = (f"{str(cache_dtype).split('.')[-1]:13s} N{N:<2d} maxq {max(q_lens):<4d} "
                   f"{'views' if split_q else 'full '} BH{block_h or 'def'} ms{ms}{' W_UV' if uv else ''}")
            mq = max(q_lens)
            if uv:  # the W_UV view of a kv_b_proj weight [H, 128 + 128, V]
                kw["w_uv"] = torch.zeros(H, 256, V, dtype=torch.bfloat16)[:, 128:]
            out[tag] = (lambda qa=qa, qr=qr, cache=cache, table=table, lens=lens, cu=cu, kw=kw, ms=ms, mq=mq:
                        k_dec.mla_decode(qa, cache, table, lens, 0.07, V, 0.5, q_rope=qr, cu_seqlens_q=cu, max_q=mq,
                                         max_splits=ms, **kw))
    return out


def main() -> int:
    print(f"triton {triton.__version__}, target {TARGET}", flush=True)
    failed = 0
    for tag, run in ragged_variants().items():
        failed += sum(not report(tag, 57, launch, 22) for launch in caught(k_dec, DECODE_KERNELS, run))
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
