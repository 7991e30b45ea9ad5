"""The low-rank gate up-projections folded into the fused KDA decode kernel (`kda_decode_kernel.py`).

Kimi Linear's KDA layer computes its decay-gate logits f and its output-gate logits g from rank-R inputs, as one
`StackedLinear` bmm: f = f_a @ f_b^T and g = g_a @ g_b^T, each [T, H * D] in the model dtype from f_a / g_a
[T, R] (column views of the merged input projection) and f_b / g_b [H * D, R]. At batch 1 that bmm is a ~3 us
latency-bound launch; folded into `kda_decode` (`f_a=`, `f_b_weight=`, `g_a=`, `g_b_weight=`) each program
computes the rows it needs, row r of f or g = sum_j a[t, j] * W[r, j] in fp32, then rounds it to the io dtype,
exactly as the bmm writes its output (so the fold equals the composition up to the fp32 summation order, i.e.
within one rounding of the io dtype where the two sums round differently).

Jit helpers (used by `_kda_decode_kernel`) and the host-side argument check.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def lowrank_rows(a_row, W, rows, lanes, R: tl.constexpr, BR: tl.constexpr, BJ: tl.constexpr, EVEN: tl.constexpr,
                 OUT_TY: tl.constexpr):
    """round(W[rows, :R] @ a_row[:R], OUT_TY) as fp32 [len(rows)], for one token's low-rank input a_row (unit
    stride) and a row-major [*, R] weight W: the products summed in fp32 (BJ columns at a time, BJ a power of two
    <= BR = next_pow2(R)) and rounded once to OUT_TY, as the bmm writes its output. Rows outside `lanes` and the
    padded columns read 0 (so those rows give 0). EVEN (every row real and R == BR): unmasked loads. Only one
    [len(rows), BJ] weight block is live at a time (a whole [128, 128] tile does not fit next to the state)."""
    acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for j0 in tl.static_range(0, BR, BJ):
        j = j0 + tl.arange(0, BJ)
        p = W + rows[:, None] * R + j[None, :]
        if EVEN:
            w = tl.load(p)
            a = tl.load(a_row + j)
        else:
            w = tl.load(p, mask=lanes[:, None] & (j < R)[None, :], other=0.0)
            a = tl.load(a_row + j, mask=j < R, other=0.0)
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
    return acc.to(OUT_TY).to(tl.float32)


def check_lowrank(name: str, a: Tensor | None, w: Tensor | None, T: int, H: int, D: int) -> Tensor | None:
    """Validate one folded gate's arguments of `kda_decode`: `a` [T, R] with unit column stride (any row stride:
    a column view of the merged projection) and `w` [H * D, R] contiguous, both floating point. Returns the rank R,
    or None when neither is given. Raises ValueError when only one is given or on a bad shape / stride."""
    if a is None and w is None:
        return None
    if a is None or w is None:
        raise ValueError(f"{name}: the low-rank input and its weight go together")
    if w.dim() != 2 or w.shape[0] != H * D or not w.is_contiguous() or not w.is_floating_point():
        raise ValueError(f"{name}: the weight must be a contiguous float [{H * D}, R]; got {tuple(w.shape)}")
    R = w.shape[1]
    if a.dim() != 2 or a.shape != (T, R) or a.stride(1) != 1 or not a.is_floating_point():
        raise ValueError(f"{name}: the low-rank input must be a float [{T}, {R}] with unit column stride; got "
                         f"{tuple(a.shape)}")
    return R


def lowrank_aligned(w: Tensor) -> bool:
    """Whether every row of weight `w` starts 16-byte aligned and spans a multiple of 16 bytes (the bulk L2
    prefetch of its rows before the PDL wait)."""
    return w.data_ptr() % 16 == 0 and (w.shape[1] * w.element_size()) % 16 == 0
