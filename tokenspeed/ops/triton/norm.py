"""RMSNorm and gated RMSNorm: one launch, a [BLOCK_R, BLOCK_D] tile of rows per program, fp32 statistics.

Rounding follows `tokenspeed.ops.reference.norm` exactly:
- `rms_norm`:       y = cast(w * cast(x * rsqrt(mean(x^2) + eps), x.dtype), x.dtype)  (gain after the downcast)
- `gated_rms_norm`: y = cast(x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate), x.dtype)  (all fp32)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton._utils import as_rows, next_pow2


@triton.jit
def _rms_norm_kernel(
    X, G, W, Y,
    R, D,
    stride_x, stride_g, stride_y,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATED: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if GATED:
        gate = tl.load(G + r64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * inv[:, None] * w[None, :] * tl.sigmoid(gate)
    else:
        normed = (x * inv[:, None]).to(Y.dtype.element_ty).to(tl.float32)
        y = w[None, :] * normed
    tl.store(Y + r64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _launch(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, out: Tensor | None) -> Tensor:
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}]; got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of x's shape and dtype")
    if x.numel() == 0:
        return out
    x2 = as_rows(x, d)
    g2 = as_rows(gate, d) if gate is not None else x2
    y2 = out.view(-1, d)
    r = x2.shape[0]
    block_d = next_pow2(d)
    # Rows per program: at most ~4K elements per tile, and enough programs to cover the SMs twice.
    block_r = max(1, min(4096 // block_d, next_pow2(triton.cdiv(r, 264))))
    block_r = min(block_r, next_pow2(r))
    num_warps = 4 if block_r * block_d <= 2048 else (8 if block_r * block_d <= 8192 else 16)
    grid = (triton.cdiv(r, block_r),)
    _rms_norm_kernel[grid](
        x2, g2, weight, y2, r, d, x2.stride(0), g2.stride(0), y2.stride(0), float(eps),
        BLOCK_R=block_r, BLOCK_D=block_d, GATED=gate is not None, num_warps=num_warps,
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
