"""The low-rank gates' up projections of the fused KDA decode kernel (`kda_decode_kernel`, LOW_RANK_F /
LOW_RANK_G): a head's rows of a contiguous [H * D, RANK] up weight held in registers in up to 4 chunks of RC
columns (loaded before the PDL wait: a constant weight), and the product with one low-rank input row after it,
in fp32 and rounded once to the io dtype as the GEMV that it replaces stores it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _up_weight(W, h, D: tl.constexpr, lanes, lmask, RANK: tl.constexpr, C: tl.constexpr, RC: tl.constexpr):
    """Columns C*RC .. (C+1)*RC - 1 of rows h * D + lanes of a contiguous [H * D, RANK] low-rank up weight,
    [len(lanes), RC] in its dtype (rows off `lmask` and columns past RANK read 0): loaded before the PDL wait and
    held in registers (a constant weight), a chunk at a time so the fp32 products of one chunk are live at once."""
    rr = C * RC + tl.arange(0, RC)
    rows = (h * D + lanes).to(tl.int64)
    return tl.load(W + rows[:, None] * RANK + rr[None, :], mask=lmask[:, None] & (rr < RANK)[None, :], other=0.0)


@triton.jit
def _up_chunk(A, row_off, w, seq_len, RANK: tl.constexpr, C: tl.constexpr, RC: tl.constexpr):
    """w @ A[row, C*RC : (C+1)*RC] in fp32 (A's row at element offset row_off, read only when seq_len > 0)."""
    rr = C * RC + tl.arange(0, RC)
    a = tl.load(A + row_off + rr, mask=(rr < RANK) & ((rr * 0 + seq_len) > 0), other=0.0).to(tl.float32)
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1)


@triton.jit
def _up_apply(A, row_off, w0, w1, w2, w3, seq_len, RANK: tl.constexpr, RC: tl.constexpr, NCH: tl.constexpr):
    """cast(W @ A[row]) [len(lanes)] fp32 holding the io-rounded value (the GEMV's one rounding; its summation order
    may differ) from the NCH <= 4 weight chunks w0.. of `_up_weight` (the unused ones are placeholders)."""
    acc = _up_chunk(A, row_off, w0, seq_len, RANK, 0, RC)
    if NCH > 1:
        acc += _up_chunk(A, row_off, w1, seq_len, RANK, 1, RC)
    if NCH > 2:
        acc += _up_chunk(A, row_off, w2, seq_len, RANK, 2, RC)
    if NCH > 3:
        acc += _up_chunk(A, row_off, w3, seq_len, RANK, 3, RC)
    return acc.to(A.dtype.element_ty).to(tl.float32)


@triton.jit
def _up_weights(W, h, D: tl.constexpr, lanes, lmask, RANK: tl.constexpr, RC: tl.constexpr, NCH: tl.constexpr):
    """The NCH chunks of `_up_weight` (placeholders repeat chunk 0)."""
    w0 = _up_weight(W, h, D, lanes, lmask, RANK, 0, RC)
    w1, w2, w3 = w0, w0, w0
    if NCH > 1:
        w1 = _up_weight(W, h, D, lanes, lmask, RANK, 1, RC)
    if NCH > 2:
        w2 = _up_weight(W, h, D, lanes, lmask, RANK, 2, RC)
    if NCH > 3:
        w3 = _up_weight(W, h, D, lanes, lmask, RANK, 3, RC)
    return w0, w1, w2, w3


@triton.jit
def _store_gate(GA, stride_ga, wg0, wg1, wg2, wg3, G, stride_gt, stride_gh, t, h, lanes, lmask, RANK: tl.constexpr,
                RC: tl.constexpr, NCH: tl.constexpr):
    """LOW_RANK_G: token t's output-norm gate of `lanes` of head h (from GA[t] and the up-weight chunks held in
    registers) into the scratch G [T, H, D] that the norm epilogue reads back."""
    g = _up_apply(GA, t * stride_ga, wg0, wg1, wg2, wg3, t * 0 + 1, RANK, RC, NCH)
    tl.store(G + t * stride_gt + h * stride_gh + lanes, g.to(G.dtype.element_ty), mask=lmask)
