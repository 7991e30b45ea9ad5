"""Small helpers shared by the Triton wrappers, and the jit L2 bulk prefetch the GEMV and MoE kernels share.

Specialisation policy: Triton compiles a kernel variant per distinct specialisation of its integer and pointer
arguments (an int equal to 1 becomes a constant, an int or address divisible by 16 gets an alignment hint). An
argument that counts rows, tokens, pairs or sequences of a step changes from step to step in serving, so each
new value class would compile a variant (seconds on an H200) in the middle of a request. Such arguments are in the
kernel's `do_not_specialize` list; strides and model sizes stay specialised. Constexprs chosen from the step's
shape (tiles, bucketed block sizes) are kept to a few classes, which the engine's start-up warm-up compiles
(`tokenspeed.executor.warm_up`; `benchmarks/compile_stalls.py` checks what a step still compiles)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def as_rows(x: Tensor, d: int) -> Tensor:
    """`x` [..., d] as a 2-D [R, d] view with unit column stride (a copy only when no such view exists)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, d)
    except RuntimeError:
        return x.reshape(-1, d)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def is_interpreting(x: Tensor) -> bool:
    return x.device.type != "cuda"


def check_same_device(*tensors: Tensor | None) -> torch.device:
    devs = {t.device for t in tensors if t is not None}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devs))}")
    return devs.pop()


@triton.jit
def l2_prefetch_bulk(ptrs, nbytes):
    """`cp.async.bulk.prefetch.L2.global` of `nbytes` (int32, a multiple of 16; 0 issues nothing) from each address
    of `ptrs` (16-byte aligned: the caller's guarantee), elementwise (sm_90 inline PTX: compiled code only, not the
    interpreter). A hint: fire and forget, no registers held, nothing waited for, no effect on any result; it moves
    no data into the SM, so it is correct before a PDL wait whatever wrote the memory. An address held by several
    threads is prefetched by each (merged in L2)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
