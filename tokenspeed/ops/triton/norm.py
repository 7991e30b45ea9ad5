"""RMSNorm, gated RMSNorm and residual add + RMSNorm: one launch, a [BLOCK_R, BLOCK_D] tile of rows per program,
fp32 statistics.

Rounding follows `tokenspeed.ops.reference.norm` exactly:
- `rms_norm`:       y = cast(w * cast(x * rsqrt(mean(x^2) + eps), x.dtype), x.dtype)  (gain after the downcast)
- `gated_rms_norm`: y = cast(x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate), x.dtype)  (all fp32)
- `add_rms_norm`:   s = cast(residual + x, x.dtype) (stored), then `rms_norm` of s, by the same code path and tile
                    choice as `rms_norm` itself: the normed output equals `rms_norm(residual + x)` of this module
                    (one launch instead of an add kernel and a norm kernel).

PDL (`tokenspeed.ops.triton.pdl`): every input is an activation written by the kernel just before (x, the gate,
the residual), so a program waits first thing (`gdc_wait`) and then lets its dependents launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import as_rows, next_pow2


@triton.jit(do_not_specialize=["R"])  # per-step counts: no recompile per value
def _rms_norm_kernel(
    X, G, W, Y, Res, S,
    R, D,
    stride_x, stride_g, stride_y, stride_res, stride_s,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # x / gate / residual come from the previous kernel: wait for it, then release our dependents
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if RESIDUAL:  # s = residual + x rounded to the activation dtype (torch's `+`), stored; the norm reads s
        res = tl.load(Res + r64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + r64[:, None] * stride_s + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if GATED:
        gate = tl.load(G + r64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * inv[:, None] * w[None, :] * tl.sigmoid(gate)
    else:
        normed = (x * inv[:, None]).to(Y.dtype.element_ty).to(tl.float32)
        y = w[None, :] * normed
    tl.store(Y + r64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _output(x: Tensor, out: Tensor | None, name: str) -> Tensor:
    """`out`, checked (contiguous, x's shape and dtype), or a new tensor like x."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor of x's shape and dtype")
    return out


def _launch(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, out: Tensor | None,
            residual: Tensor | None = None, summed: Tensor | None = None) -> Tensor:
    """One launch over the rows of x; with `residual`, x is first replaced by cast(residual + x) (written to
    `summed`, a contiguous tensor of x's shape and dtype). Returns out."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}]; got {tuple(weight.shape)}")
    out = _output(x, out, "out")
    if x.numel() == 0:
        return out
    x2 = as_rows(x, d)
    g2 = as_rows(gate, d) if gate is not None else x2
    res2 = as_rows(residual, d) if residual is not None else x2
    s2 = summed.view(-1, d) if summed is not None else x2
    y2 = out.view(-1, d)
    r = x2.shape[0]
    block_d = next_pow2(d)
    # Rows per program: at most ~4K elements per tile, and enough programs to cover the SMs twice.
    block_r = max(1, min(4096 // block_d, next_pow2(triton.cdiv(r, 264))))
    block_r = min(block_r, next_pow2(r))
    num_warps = 4 if block_r * block_d <= 2048 else (8 if block_r * block_d <= 8192 else 16)
    grid = (triton.cdiv(r, block_r),)
    _rms_norm_kernel[grid](
        x2, g2, weight, y2, res2, s2, r, d, x2.stride(0), g2.stride(0), y2.stride(0), res2.stride(0), s2.stride(0),
        float(eps), BLOCK_R=block_r, BLOCK_D=block_d, GATED=gate is not None, RESIDUAL=residual is not None,
        num_warps=num_warps, **pdl.kernel_kwargs(x.device, "norm"),
    )
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, out: Tensor | None = None) -> Tensor:
    """Triton `ops.rms_norm` (same contract): x [..., D] -> x.dtype (written into `out` if given)."""
    return _launch(x, None, weight, eps, out)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, *, out: Tensor | None = None) -> Tensor:
    """Triton `ops.gated_rms_norm` (same contract): RMSNorm(x) * w * sigmoid(gate), fp32 inside -> x.dtype."""
    if gate.shape != x.shape:
        raise ValueError(f"gate must match x {tuple(x.shape)}; got {tuple(gate.shape)}")
    return _launch(x, gate, weight, eps, out)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, out: Tensor | None = None,
                 summed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Triton `ops.add_rms_norm` (same contract): x, residual [..., D] of one shape and dtype -> (normed, summed),
    summed = cast(residual + x), normed = rms_norm(summed); written into `out` / `summed` (contiguous, x's shape
    and dtype) if given, else new tensors. `summed` may be `residual` itself (in place: each element is read before
    it is written, by the same program) when nothing else needs the old residual; x and residual are otherwise
    only read."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}; got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    summed = _output(x, summed, "summed")
    return _launch(x, None, weight, eps, out, residual, summed), summed


@triton.jit(do_not_specialize=["R"])  # token counts: no recompile per value
def _l2_normalize_kernel(X, Y, R, stride_x, eps, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows r of X [R, D] (row stride stride_x): Y[r] = cast(x * rsqrt(sum(x^2) + eps)), fp32 inside."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    r64 = rows.to(tl.int64)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]
    tl.store(Y + r64[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x [..., D] -> x / sqrt(sum(x^2, -1) + eps) in x.dtype (fp32 inside, one rounding), a new contiguous tensor:
    `ops.l2_normalize` rounded to the input dtype, as fla's `l2norm_fwd` rounds it. One launch; its compiled
    variant depends on D and the dtypes only (fla's kernel autotunes per cdiv(rows, 65536), which made a serving
    engine compile 25 variants mid-request at each new prefill size)."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2 = as_rows(x, d)
    block_d = next_pow2(d)
    block_r = max(1, 2048 // block_d)
    _l2_normalize_kernel[(triton.cdiv(x2.shape[0], block_r),)](
        x2, out, x2.shape[0], x2.stride(0), float(eps), D=d, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out
