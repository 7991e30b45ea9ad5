"""Block AttnRes depth mix (+ the following RMSNorm) in one launch.

For each token row t, candidates v_0..v_n (n snapshots from `blocks`, then `partial`):
    z_i = (query . v_i) * rsqrt(mean(v_i^2) + eps);  alpha = softmax(z);  mix = cast(sum_i alpha_i v_i)
and, fused, y = rms_norm(mix, norm_weight, norm_eps) with the reference rounding (mix rounded to the activation
dtype first, the gain after the downcast).

Three schedules of the same math (`tokenspeed.ops.reference.attn_res` is the ground truth):
- "split" (a handful of rows, decode): each row is split over SPLIT programs, each holding a [BLOCK_N, DS] slice
  of all candidates in registers. They exchange partial logit sums (and then partial sums of squares of the mix,
  for the norm) through a small workspace and a per-row arrival counter that they spin on, so every byte is read
  once and the whole GPU takes part. Only used when all T * SPLIT programs fit on the GPU at once (one per SM),
  so the spin barrier cannot wait on a program that is not running. Not runnable in the CPU interpreter.
- "tile" (tens of rows, verify / small batches): one program per row walks D in chunks of all candidates at once
  ([BLOCK_N, CHUNK] tiles: every candidate's loads in flight together), first for the logits, then again for the
  weighted sum (the second read hits L2), writes the mix, and normalises it in a third pass over its own row.
- "online" (many rows, prefill): one program per row, one full-width row per candidate, online softmax; every
  candidate byte is read once from memory.

PDL (`tokenspeed.ops.triton.pdl`): every schedule waits first thing (the snapshots and the partial sum are
activations) and releases its dependents right after. Why the "split" schedule's spin barrier still cannot
deadlock when it is launched as a programmatic dependent (kernel N after N-1, followed by N+1):
- N's programs may become resident while N-1's programs still hold SMs, so some of N's programs can be
  resident and others not yet. But none spins before its `gdc_wait` returns, i.e. before N-1 has completed
  and released every SM it held. N-1 does complete: N launches only once every program of N-1 has triggered
  (or exited), so all of them are already resident and past their own wait, and none waits on N.
- N+1 cannot take SMs that N's missing programs need: N+1 is launched only once every program of N has executed
  `gdc_launch_dependents` or exited, and a program that is not resident has done neither.
- So once N-1 exits, only N's programs (and kernels of other streams, unsupported as before) occupy the GPU;
  T * SPLIT <= SM count and one program fits on an empty SM, so every program becomes resident and the spin ends.
The counters are touched only after the wait, so a later launch sees the previous launch's counters back at 0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2

SPLIT_SLICE = 1024  # columns per program in the "split" schedule
# TOKENSPEED_ATTN_RES_SPLIT=0 keeps "auto" off the spin-barrier schedule (a safety switch).
SPLIT_ENABLED = os.environ.get("TOKENSPEED_ATTN_RES_SPLIT", "1") != "0"

_WORKSPACE: dict = {}
_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def _workspace(device: torch.device, floats: int, counters: int) -> tuple[Tensor, Tensor]:
    """Cached fp32 scratch and zeroed int32 counters (the kernel leaves the counters at zero)."""
    ws, cnt = _WORKSPACE.get(device, (None, None))
    if ws is None or ws.numel() < floats or cnt.numel() < counters:
        ws = torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(counters, 1024), dtype=torch.int32, device=device)
        _WORKSPACE[device] = (ws, cnt)
    return ws, cnt


def choose_schedule(T: int, D: int, n: int, device: torch.device) -> str:
    """The schedule "auto" picks for T rows of width D with n snapshots: "split" while every program fits on the
    GPU at once, else "online" (on H200 "tile" lost to "online" at every row count measured; it stays available)."""
    if SPLIT_ENABLED and device.type == "cuda" and T * triton.cdiv(D, SPLIT_SLICE) <= _num_sms(device) and n < 16:
        return "split"
    return "online"


@triton.jit
def _spin_barrier(C, expected):
    """All programs of a row arrive at C; return once `expected` have (release / acquire at GPU scope)."""
    tl.debug_barrier()
    tl.atomic_add(C, 1, sem="release")
    seen = tl.atomic_add(C, 0, sem="acquire")
    while seen < expected:
        seen = tl.atomic_add(C, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["n"])  # per-step counts: no recompile per value
def _attn_res_split_kernel(
    Bk, P, Q, NW, Y, WS, CNT,
    n, D,
    stride_bn, stride_bt, stride_p, stride_y,
    eps, norm_eps,
    SPLIT: tl.constexpr,
    SPLIT_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # before any load and before the spin barrier (see the module docstring: no deadlock)
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    t64 = (pid // SPLIT).to(tl.int64)
    s = pid % SPLIT
    cand = tl.arange(0, BLOCK_N)
    cols = s * DS + tl.arange(0, DS)
    cmask = cols < D
    is_blk = cand < n
    is_par = cand == n
    vb = tl.load(Bk + cand.to(tl.int64)[:, None] * stride_bn + t64 * stride_bt + cols[None, :],
                 mask=is_blk[:, None] & cmask[None, :], other=0.0)
    vp = tl.load(P + t64 * stride_p + cols, mask=cmask, other=0.0)
    v = tl.where(is_par[:, None], vp.to(tl.float32)[None, :], vb.to(tl.float32))
    q = tl.load(Q + cols, mask=cmask, other=0.0).to(tl.float32)
    # Workspace of this row: dot [SPLIT, BLOCK_N], ssq [SPLIT, BLOCK_N], mix ssq [SPLIT_P2].
    ws = WS + t64 * (2 * SPLIT * BLOCK_N + SPLIT_P2)
    tl.store(ws + s * BLOCK_N + cand, tl.sum(v * q[None, :], axis=1))
    tl.store(ws + (SPLIT + s) * BLOCK_N + cand, tl.sum(v * v, axis=1))
    cnt = CNT + t64 * 3
    _spin_barrier(cnt, SPLIT)
    sp = tl.arange(0, SPLIT_P2)
    pm = (sp < SPLIT)[:, None] & (cand >= 0)[None, :]
    dot = tl.sum(tl.load(ws + sp[:, None] * BLOCK_N + cand[None, :], mask=pm, other=0.0, volatile=True), axis=0)
    ssq = tl.sum(tl.load(ws + (SPLIT + sp[:, None]) * BLOCK_N + cand[None, :], mask=pm, other=0.0,
                         volatile=True), axis=0)
    z = tl.where(cand <= n, dot * tl.rsqrt(ssq / D + eps), -float("inf"))
    e = tl.exp(z - tl.max(z, axis=0))
    alpha = e / tl.sum(e, axis=0)
    mix = tl.sum(alpha[:, None] * v, axis=0).to(Y.dtype.element_ty)
    if HAS_NORM:
        mf = mix.to(tl.float32)
        tl.store(ws + 2 * SPLIT * BLOCK_N + s, tl.sum(mf * mf, axis=0))
        _spin_barrier(cnt + 1, SPLIT)
        tot = tl.sum(tl.load(ws + 2 * SPLIT * BLOCK_N + sp, mask=sp < SPLIT, other=0.0, volatile=True), axis=0)
        normed = (mf * tl.rsqrt(tot / D + norm_eps)).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
        mix = (w * normed).to(Y.dtype.element_ty)
    tl.store(Y + t64 * stride_y + cols, mix, mask=cmask)
    # The last program of the row through both barriers puts the row's counters back to zero for the next launch.
    done = tl.atomic_add(cnt + 2, 1, sem="acq_rel")
    if done == SPLIT - 1:
        tl.atomic_xchg(cnt, 0)
        tl.atomic_xchg(cnt + 1, 0)
        tl.atomic_xchg(cnt + 2, 0)


@triton.jit
def _norm_row_inplace(Y, t64, stride_y, NW, D, norm_eps, BLOCK_D: tl.constexpr):
    """Row t of Y (already the rounded mix) -> rms_norm(row) in place (reference rounding)."""
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    m = tl.load(Y + t64 * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(m * m, axis=0) / D + norm_eps)
    normed = (m * inv).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(Y + t64 * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["n"])  # per-step counts: no recompile per value
def _attn_res_online_kernel(
    Bk, P, Q, NW, Y,
    n, D,
    stride_bn, stride_bt, stride_p, stride_y,
    eps, norm_eps,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t64 = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    q = tl.load(Q + cols, mask=cmask, other=0.0).to(tl.float32)
    # The partial sum starts the online softmax (it is always a candidate); the order does not change the math.
    v = tl.load(P + t64 * stride_p + cols, mask=cmask, other=0.0).to(tl.float32)
    m_run = tl.sum(v * q, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    l_run = m_run * 0.0 + 1.0
    acc = v
    for i in range(n):
        v = tl.load(Bk + i * stride_bn + t64 * stride_bt + cols, mask=cmask, other=0.0).to(tl.float32)
        z = tl.sum(v * q, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
        m_new = tl.maximum(m_run, z)
        a = tl.exp(m_run - m_new)
        p = tl.exp(z - m_new)
        acc = acc * a + p * v
        l_run = l_run * a + p
        m_run = m_new
    mix = (acc / l_run).to(Y.dtype.element_ty)
    if HAS_NORM:
        mf = mix.to(tl.float32)
        inv = tl.rsqrt(tl.sum(mf * mf, axis=0) / D + norm_eps)
        normed = (mf * inv).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
        mix = (w * normed).to(Y.dtype.element_ty)
    tl.store(Y + t64 * stride_y + cols, mix, mask=cmask)


@triton.jit(do_not_specialize=["n"])  # per-step counts: no recompile per value
def _attn_res_tile_kernel(
    Bk, P, Q, NW, Y,
    n, D,
    stride_bn, stride_bt, stride_p, stride_y,
    eps, norm_eps,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t64 = tl.program_id(0).to(tl.int64)
    cand = tl.arange(0, BLOCK_N)
    is_blk = cand < n
    is_par = cand == n
    # Candidate i < n comes from blocks[i], candidate n from partial; rows past n are masked off.
    blk_off = cand.to(tl.int64) * stride_bn + t64 * stride_bt
    dot = tl.zeros([BLOCK_N], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(0, D, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        cmask = cols < D
        vb = tl.load(Bk + blk_off[:, None] + cols[None, :], mask=is_blk[:, None] & cmask[None, :], other=0.0)
        vp = tl.load(P + t64 * stride_p + cols, mask=cmask, other=0.0)
        v = tl.where(is_par[:, None], vp.to(tl.float32)[None, :], vb.to(tl.float32))
        q = tl.load(Q + cols, mask=cmask, other=0.0).to(tl.float32)
        dot += tl.sum(v * q[None, :], axis=1)
        ssq += tl.sum(v * v, axis=1)
    valid = cand <= n
    z = tl.where(valid, dot * tl.rsqrt(ssq / D + eps), -float("inf"))
    e = tl.exp(z - tl.max(z, axis=0))
    alpha = e / tl.sum(e, axis=0)
    for c0 in range(0, D, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        cmask = cols < D
        vb = tl.load(Bk + blk_off[:, None] + cols[None, :], mask=is_blk[:, None] & cmask[None, :], other=0.0)
        vp = tl.load(P + t64 * stride_p + cols, mask=cmask, other=0.0)
        v = tl.where(is_par[:, None], vp.to(tl.float32)[None, :], vb.to(tl.float32))
        mix = tl.sum(alpha[:, None] * v, axis=0)
        tl.store(Y + t64 * stride_y + cols, mix.to(Y.dtype.element_ty), mask=cmask)
    if HAS_NORM:
        tl.debug_barrier()
        _norm_row_inplace(Y, t64, stride_y, NW, D, norm_eps, BLOCK_D)


def _launch(blocks: Tensor, partial: Tensor, query: Tensor, eps: float, norm_weight: Tensor | None,
            norm_eps: float, schedule: str = "auto", out: Tensor | None = None) -> Tensor:
    if partial.dim() != 2:
        raise ValueError(f"partial must be [T, D]; got {tuple(partial.shape)}")
    T, D = partial.shape
    n = blocks.shape[0]
    if blocks.shape[1:] != (T, D):
        raise ValueError(f"blocks must be [n, {T}, {D}]; got {tuple(blocks.shape)}")
    if out is None:
        out = torch.empty(T, D, dtype=partial.dtype, device=partial.device)
    elif out.shape != (T, D) or out.dtype != partial.dtype or out.stride(1) != 1:
        raise ValueError("out must be [T, D] in partial's dtype with unit column stride")
    if T == 0:
        return out
    if partial.stride(1) != 1:
        partial = partial.contiguous()
    if n and blocks.stride(2) != 1:
        blocks = blocks.contiguous()
    if blocks.dtype != partial.dtype:
        blocks = blocks.to(partial.dtype)
    bk = blocks if n else partial  # a valid pointer when there are no snapshots (never read)
    sbn, sbt = (blocks.stride(0), blocks.stride(1)) if n else (0, 0)
    has_norm = norm_weight is not None
    nw = norm_weight if has_norm else query
    block_d = next_pow2(D)
    split = triton.cdiv(D, SPLIT_SLICE)
    if schedule == "auto":
        schedule = choose_schedule(T, D, n, partial.device)
    common = (bk, partial, query, nw, out, n, D, sbn, sbt, partial.stride(0), out.stride(0), float(eps),
              float(norm_eps))
    launch = pdl.kernel_kwargs(partial.device, "attn_res")
    if schedule == "split":
        if T * split > _num_sms(partial.device):
            raise ValueError(f"split schedule needs T * {split} <= {_num_sms(partial.device)} programs")
        block_n = next_pow2(n + 1)
        split_p2 = next_pow2(split)
        ws, cnt = _workspace(partial.device, T * (2 * split * block_n + split_p2), 3 * T)
        _attn_res_split_kernel[(T * split,)](*common[:5], ws, cnt, *common[5:], SPLIT=split, SPLIT_P2=split_p2,
                                             BLOCK_N=block_n, DS=SPLIT_SLICE, HAS_NORM=has_norm, num_warps=8,
                                             **launch)
    elif schedule == "tile":
        block_n = next_pow2(n + 1)
        chunk = max(64, min(block_d, 4096 // block_n))
        _attn_res_tile_kernel[(T,)](*common, BLOCK_N=block_n, CHUNK=chunk, BLOCK_D=block_d, HAS_NORM=has_norm,
                                    num_warps=8, **launch)
    elif schedule == "online":
        _attn_res_online_kernel[(T,)](*common, BLOCK_D=block_d, HAS_NORM=has_norm,
                                      num_warps=4 if block_d <= 2048 else (8 if block_d <= 8192 else 16), **launch)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return out


def attn_res_mix(blocks: Tensor, partial: Tensor, query: Tensor, eps: float, *, schedule: str = "auto",
                 out: Tensor | None = None) -> Tensor:
    """Triton `ops.attn_res_mix` (same contract; with no snapshots it returns `partial` itself)."""
    if blocks.shape[0] == 0 and out is None:
        return partial
    return _launch(blocks, partial, query, eps, None, 0.0, schedule, out)


def attn_res_mix_rms_norm(blocks: Tensor, partial: Tensor, query: Tensor, eps: float, norm_weight: Tensor,
                          norm_eps: float, *, schedule: str = "auto", out: Tensor | None = None) -> Tensor:
    """Triton `ops.attn_res_mix_rms_norm`: the mix with the sublayer's input RMSNorm fused (one launch)."""
    return _launch(blocks, partial, query, eps, norm_weight, norm_eps, schedule, out)
