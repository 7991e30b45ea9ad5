"""Small helpers shared by the Triton wrappers.

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
