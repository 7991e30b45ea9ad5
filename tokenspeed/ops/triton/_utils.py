"""Small helpers shared by the Triton wrappers."""

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
