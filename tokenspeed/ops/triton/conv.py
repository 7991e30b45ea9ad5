"""Causal depthwise conv1d over a flat variable-length batch with a carried per-slot state, in two launches.

Same function and rounding as `tokenspeed.ops.reference.conv.causal_conv1d` (its docstring is the contract):
for channel c and position i of sequence n (token t = cu_seqlens[n] + i)::

    y[t, c] = cast(act(sum_j weight[c, j] * x_{i-(W-1)+j}[c]), x.dtype)      (all in fp32)

where x_p is row cu_seqlens[n] + p of x for p >= 0 and column (W-1) + p of conv_state[state_indices[n]] for p < 0.

Launches (grids from shapes only; no host synchronisation, so the call can be captured in a CUDA graph):

1. `_conv_kernel`, grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C)): BLOCK_T consecutive tokens x BLOCK_C channels
   per program, walked in order, UNROLL (2) tokens per step whose rows are loaded together (more bytes in
   flight). Each x row is read from memory once: the W-1 previous inputs are carried in registers from token to
   token and re-read (from x, or from the slot's old state for positions < 0) only at the program's first token
   and at the first W-1 tokens of a sequence. The program's first sequence comes from a binary search over
   cu_seqlens (ceil(log2 N) scalar loads); later ones by stepping through cu_seqlens (zero-length ones skipped).
   Loads along C are contiguous (x row stride arbitrary). (A [BLOCK_T, BLOCK_C] tile with W row-shifted loads
   of x was 1.4x slower on an H200: the shifted loads went to L2 rather than L1.)
2. `_state_kernel`, grid (N, cdiv(C, BLOCK_C)), after the first on the same stream (so the conv reads the OLD
   state): conv_state[slot, :, j] = x_{len-(W-1)+j} for j < W-1, from x or from the old state (shifted) when the
   sequence has fewer than W-1 new tokens. Every column is read into registers before any is written.

PDL (`tokenspeed.ops.triton.pdl`): both kernels wait first thing (x, cu_seqlens and state_indices come from the
kernels or copies just before). The state kernel is a programmatic dependent of the conv kernel: its wait returns
only once the conv kernel has completed, so the conv still reads every OLD state column before one is replaced.

Beyond the reference: a slot `state_indices[n] < 0` (a CUDA-graph padding row) means "no state": its history
reads as zeros and nothing is stored. cu_seqlens is NOT validated here (that needs a host sync): it must be
[N + 1], non-decreasing, from 0 to T. Slots >= 0 must be distinct and < S.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2

_ACTIVATIONS = ("silu", None)
MAX_WIDTH = 4


@triton.jit
def _sequence_of(CU, t, N, n_iter):
    """For token t (a scalar, 0 <= t < cu[N]): the n with cu[n] <= t < cu[n + 1], by bisection over cu [N + 1].

    Keeps cu[lo] <= t < cu[hi]; n_iter >= ceil(log2 N) steps; once hi - lo == 1 a step changes nothing.
    Zero-length sequences repeat a boundary, and the search lands on the last one, the non-empty sequence."""
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + N
    for _ in range(n_iter):
        mid = (lo + hi) // 2
        go_right = tl.load(CU + mid) <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _tap_weight(Wt, c, cmask, stride_wc, stride_ww, j):
    """weight[c, j] as fp32 ([BLOCK_C])."""
    return tl.load(Wt + c * stride_wc + j * stride_ww, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def _input_at(X, srow, stride_xt, stride_sw, t, i, k, c, lim_x, lim_s, W: tl.constexpr):
    """fp32 input of channels c at position i - k of the sequence (token t - k): x row t - k when i - k >= 0, else
    old state column (W-1) + (i - k) through `srow` (the slot's [BLOCK_C] channel pointers). Channels >= lim_x
    (resp. lim_s) are not read; exactly one of the two loads is live, the other adds 0."""
    p = i - k
    xv = tl.load(X + (t - k).to(tl.int64) * stride_xt + c, mask=c < tl.where(p >= 0, lim_x, 0), other=0.0)
    sv = tl.load(srow + (p + (W - 1)) * stride_sw, mask=c < tl.where(p < 0, lim_s, 0), other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _seq_advance(CU, SI, t, n, bos, nxt, slot, N):
    """Move (n, bos = cu[n], nxt = cu[n+1], slot = state_indices[n]) forward to the sequence holding token t,
    skipping zero-length ones (never past n = N - 1)."""
    while (t >= nxt) & (n < N - 1):
        n += 1
        bos = nxt
        nxt = tl.load(CU + n + 1).to(tl.int32)
        slot = tl.load(SI + n).to(tl.int64)
    return n, bos, nxt, slot


@triton.jit
def _conv_step(X, CS, Y, T, C, stride_xt, stride_ss, stride_sc, stride_sw, stride_yt, t, rebuild, xt, h1, h2, h3,
               bos, slot, c, w0, w1, w2, w3, G, stride_yg, W: tl.constexpr, SILU: tl.constexpr):
    """Output row t from its input row xt and the window (h1, h2, h3) = inputs at positions i-1, i-2, i-3; the
    window is re-read (x / old state) first when `rebuild` or i < W-1. Returns the window for token t + 1.
    Channel c is stored at Y + t * stride_yt + (c // G) * stride_yg + c % G (G = C: a plain [T, C] row)."""
    i = t - bos
    lim = tl.where(t < T, C, 0)
    if rebuild | (i < W - 1):
        srow = CS + tl.maximum(slot, 0) * stride_ss + c * stride_sc
        lim_s = tl.where(slot >= 0, lim, 0)
        if W > 1:
            h1 = _input_at(X, srow, stride_xt, stride_sw, t, i, 1, c, lim, lim_s, W)
        if W > 2:
            h2 = _input_at(X, srow, stride_xt, stride_sw, t, i, 2, c, lim, lim_s, W)
        if W > 3:
            h3 = _input_at(X, srow, stride_xt, stride_sw, t, i, 3, c, lim, lim_s, W)
    acc = w0 * h3 + w1 * h2 + w2 * h1 + w3 * xt
    if SILU:
        acc = acc * tl.sigmoid(acc)
    grp = c // G
    y_ptr = Y + t.to(tl.int64) * stride_yt + grp.to(tl.int64) * stride_yg + (c - grp * G)
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=c < lim)
    return xt, h1, h2


@triton.jit
def _load_row(X, t, T, C, stride_xt, c):
    """fp32 x[t, c] ([BLOCK_C]); zeros past T or C."""
    return tl.load(X + t.to(tl.int64) * stride_xt + c, mask=c < tl.where(t < T, C, 0), other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["T", "N", "n_iter"])  # per-step counts: no recompile per value
def _conv_kernel(
    X, Wt, CS, SI, CU, Y,
    T, C, N, n_iter,
    stride_xt, stride_wc, stride_ww, stride_ss, stride_sc, stride_sw, stride_yt, G, stride_yg,
    W: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_T consecutive tokens x BLOCK_C channels per program, UNROLL (1 or 2) tokens per step: their rows
    are loaded together, then consumed in order. Each x row is loaded once; the W-1 previous inputs ride along in
    registers (h1 = position i-1, h2 = i-2, h3 = i-3), rebuilt at the program's first token and at the first
    W-1 tokens of each sequence."""
    if PDL:  # x and the index tensors come from the kernels before: wait, then release our dependents
        gdc_wait()
        gdc_launch_dependents()
    t0 = tl.program_id(0) * BLOCK_T
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    w3 = _tap_weight(Wt, c, cmask, stride_wc, stride_ww, W - 1)  # w3 multiplies the current token
    w2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    w1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    w0 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if W > 1:
        w2 = _tap_weight(Wt, c, cmask, stride_wc, stride_ww, W - 2)
    if W > 2:
        w1 = _tap_weight(Wt, c, cmask, stride_wc, stride_ww, W - 3)
    if W > 3:
        w0 = _tap_weight(Wt, c, cmask, stride_wc, stride_ww, W - 4)
    n = _sequence_of(CU, tl.minimum(t0, T - 1), N, n_iter)
    bos = tl.load(CU + n).to(tl.int32)
    nxt = tl.load(CU + n + 1).to(tl.int32)
    slot = tl.load(SI + n).to(tl.int64)
    h1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    h2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    h3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for k in range(0, BLOCK_T, UNROLL):
        t = t0 + k
        xa = _load_row(X, t, T, C, stride_xt, c)
        if UNROLL > 1:
            xb = _load_row(X, t + 1, T, C, stride_xt, c)
        n, bos, nxt, slot = _seq_advance(CU, SI, t, n, bos, nxt, slot, N)
        h1, h2, h3 = _conv_step(X, CS, Y, T, C, stride_xt, stride_ss, stride_sc, stride_sw, stride_yt, t, k == 0,
                                xa, h1, h2, h3, bos, slot, c, w0, w1, w2, w3, G, stride_yg, W, SILU)
        if UNROLL > 1:
            n, bos, nxt, slot = _seq_advance(CU, SI, t + 1, n, bos, nxt, slot, N)
            h1, h2, h3 = _conv_step(X, CS, Y, T, C, stride_xt, stride_ss, stride_sc, stride_sw, stride_yt, t + 1,
                                    False, xb, h1, h2, h3, bos, slot, c, w0, w1, w2, w3, G, stride_yg, W,
                                    SILU)


@triton.jit
def _new_state_column(X, row, stride_xt, stride_sw, bos, length, j, c, lim, W: tl.constexpr):
    """New state column j of channels c (fp32): the input at position p = length - (W-1) + j, i.e. x row bos + p
    when p >= 0, else old state column (W-1) + p = length + j of `row` (a later column than j). Channels >= lim
    are not read (masks are `c < limit` with scalar limits: the interpreter mishandles vector & scalar bools)."""
    p = length - (W - 1) + j
    xv = tl.load(X + (bos + p) * stride_xt + c, mask=c < tl.where(p >= 0, lim, 0), other=0.0).to(tl.float32)
    sv = tl.load(row + (length + j) * stride_sw, mask=c < tl.where(p < 0, lim, 0), other=0.0).to(tl.float32)
    return tl.where(p >= 0, xv, sv)


@triton.jit
def _state_kernel(
    X, CS, SI, CU,
    C,
    stride_xt, stride_ss, stride_sc, stride_sw,
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Sequence n = program 0, BLOCK_C channels: conv_state[state_indices[n], c, :] <- the last W-1 inputs of
    [old state, new tokens] (2 <= W <= 4); nothing for an empty sequence or a slot < 0."""
    if PDL:  # after the conv kernel has completed (it reads the old state that this kernel replaces)
        gdc_wait()
        gdc_launch_dependents()
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    bos = tl.load(CU + n).to(tl.int64)
    length = tl.load(CU + n + 1).to(tl.int64) - bos
    slot = tl.load(SI + n).to(tl.int64)
    lim = tl.where((length > 0) & (slot >= 0), C, 0)  # channels to update: none for empty / padding rows
    row = CS + tl.where(slot >= 0, slot, 0) * stride_ss + c * stride_sc
    # All old columns are read before the first store (W - 1 <= 3 columns, one variable each).
    v0 = _new_state_column(X, row, stride_xt, stride_sw, bos, length, 0, c, lim, W)
    if W > 2:
        v1 = _new_state_column(X, row, stride_xt, stride_sw, bos, length, 1, c, lim, W)
    if W > 3:
        v2 = _new_state_column(X, row, stride_xt, stride_sw, bos, length, 2, c, lim, W)
    ty = CS.dtype.element_ty
    m = c < lim
    tl.store(row, v0.to(ty), mask=m)
    if W > 2:
        tl.store(row + stride_sw, v1.to(ty), mask=m)
    if W > 3:
        tl.store(row + 2 * stride_sw, v2.to(ty), mask=m)


def _check_shapes(x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor, cu_seqlens: Tensor,
                  activation: str | None, out: Tensor | None) -> None:
    """Host-side shape / layout checks only (never reads device memory); raises ValueError."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {_ACTIVATIONS}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with unit column stride; got {tuple(x.shape)} strides {x.stride()}")
    T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, W) or not 1 <= W <= MAX_WIDTH or conv_state.dim() != 3 \
            or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"weight must be [C={C}, W<={MAX_WIDTH}] and conv_state [S, C, W-1]; "
                         f"got {tuple(weight.shape)} and {tuple(conv_state.shape)}")
    N = state_indices.numel()
    if state_indices.dim() != 1 or cu_seqlens.shape != (N + 1,) or (N == 0 and T > 0):
        raise ValueError(f"state_indices must be [N] and cu_seqlens [N+1]; got {tuple(state_indices.shape)} "
                         f"and {tuple(cu_seqlens.shape)} for T={T}")
    if out is not None:
        grouped = out.dim() == 3 and out.shape[0] == T and out.shape[1] * out.shape[2] == C
        if not (grouped or out.shape == (T, C)) or out.dtype != x.dtype or (T > 0 and out.stride(-1) != 1):
            raise ValueError(f"out must be [T, C] or [T, G, C // G] in x.dtype with unit last stride; got "
                             f"{tuple(out.shape)} {out.dtype}")


def _conv_config(T: int, C: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps, UNROLL) of the conv kernel. 32 x 512 with 4 warps (4 bf16 per thread per
    row) and 2 rows per step was the fastest of a sweep at T = 8192, C = 12288 on an H200 (benchmarks/conv_h200.py
    --sweep)."""
    block_t = min(32, next_pow2(T))
    return block_t, min(512, next_pow2(C)), 4, min(2, block_t)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    activation: str | None = "silu",
    *,
    out: Tensor | None = None,
) -> Tensor:
    """Triton `ops.causal_conv1d`: same contract and rounding as the reference, no host synchronisation.

    Args:
        x: ``[T, C]`` new tokens of all sequences, unit column stride, any row stride (a column slice of a wider
            projection is read in place); bf16 / fp16 / fp32.
        weight: ``[C, W]``, ``1 <= W <= 4``, any strides and float dtype (read as fp32).
        conv_state: ``[S, C, W-1]`` pool, any strides, float dtype; slot s holds the W-1 pre-conv inputs before
            a sequence's first new token (column W-2 most recent).
        state_indices: ``[N]`` int32/int64 slot per sequence; slots >= 0 distinct; a slot < 0 means no state
            (zero history, nothing stored).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets, non-decreasing from 0 to T (not checked).
        activation: ``"silu"`` or ``None``.
        out: optional output in x.dtype, written in place and returned: ``[T, C]`` with unit column stride, or
            ``[T, G, C // G]`` with unit last stride and any other strides (e.g. a ``[G, T, C // G]`` buffer
            permuted, so that each of the G channel groups comes out contiguous).

    Returns:
        ``y`` ``[T, C]`` in x.dtype (fp32 accumulation, SiLU in fp32, one rounding), or ``out`` when given.

    Mutates:
        ``conv_state[state_indices[n]]`` for each sequence with >= 1 token and slot >= 0: the last W-1 inputs of
        [old state, new tokens], in conv_state.dtype. Other slots and zero-length sequences are untouched.
    """
    _check_shapes(x, weight, conv_state, state_indices, cu_seqlens, activation, out)
    T, C = x.shape
    W = weight.shape[1]
    N = state_indices.numel()
    y = torch.empty(T, C, dtype=x.dtype, device=x.device) if out is None else out
    group, stride_yg = (y.shape[2], y.stride(1)) if y.dim() == 3 else (max(C, 1), 0)
    if T == 0 or C == 0:
        return y
    block_t, block_c, num_warps, unroll = _conv_config(T, C)
    grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
    _conv_kernel[grid](
        x, weight, conv_state, state_indices, cu_seqlens, y,
        T, C, N, max(N - 1, 0).bit_length(),
        x.stride(0), weight.stride(0), weight.stride(1), *conv_state.stride(), y.stride(0), group, stride_yg,
        W=W, SILU=activation == "silu", BLOCK_T=block_t, BLOCK_C=block_c, UNROLL=unroll, num_warps=num_warps,
        **pdl.kernel_kwargs(x.device, "conv"),
    )
    if W > 1:
        state_block_c = min(1024, next_pow2(C))
        _state_kernel[(N, triton.cdiv(C, state_block_c))](
            x, conv_state, state_indices, cu_seqlens, C,
            x.stride(0), *conv_state.stride(),
            W=W, BLOCK_C=state_block_c, num_warps=4, **pdl.kernel_kwargs(x.device, "conv"),
        )
    return y
