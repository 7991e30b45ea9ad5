"""Gated activations (SiLU / SiTU of a gate and an up operand) in one launch, fp32 inside, one rounding.

Same function as `tokenspeed.ops.reference.activation.gated_activation` (issue 8): the reference runs five torch
kernels per call (gate.float(), up.float(), the activation, the product, the cast back); this reads gate and up
once, in place (they may be the two strided halves of the merged gate_up projection), and writes [..., I] in the
gate's dtype:
- silu: y = cast(g / (1 + exp(-g)) * u, dtype)
- situ: y = cast((beta * tanh(g / beta) * sigmoid(g)) * (lin * tanh(u / lin)), dtype)
with g, u the fp32 values of the inputs, evaluated in the reference's order (left to right) and rounded once.
Divisions are IEEE (`tl.div_rn`); exp is Triton's (hardware ex2 on CUDA) and tanh an fp32 formula (odd Taylor
polynomial below |x| = 0.5, (1 - e^-2|x|) / (1 + e^-2|x|) above: within a few ulp everywhere, no cancellation near
0), so fp32 results agree with torch to a few ulp, not bitwise; 16-bit outputs can differ by one ulp where the fp32
value sits on a rounding boundary.

Grid: (cdiv(R, BLOCK_R), cdiv(I, BLOCK_I)), one [BLOCK_R, BLOCK_I] tile per program (~2K elements), columns fastest.
PDL (`tokenspeed.ops.triton.pdl`): gate and up are the previous kernel's output, so a program waits first thing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import as_rows, next_pow2

KINDS = ("silu", "situ")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_I = 1024  # columns per program
TILE = 2048  # elements per program (BLOCK_R * BLOCK_I), when the rows allow it


@triton.jit
def _tanh_f32(x):
    """tanh in fp32 without the cancellation of (1 - t) / (1 + t) near 0 (relative error a few ulp)."""
    ax = tl.abs(x)
    x2 = tl.minimum(x * x, 0.25)  # the polynomial is used below |x| = 0.5 only (clamped: no overflow elsewhere)
    # odd Taylor series through x^15; the first omitted term is < 1.1e-8 relative at |x| = 0.5
    p = -929569.0 / 638512875.0
    p = p * x2 + 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = x + x * x2 * p
    t = tl.exp(-2.0 * ax)
    big = tl.div_rn(1.0 - t, 1.0 + t)
    big = tl.where(x >= 0, big, -big)
    return tl.where(ax < 0.5, small, big)


@triton.jit(do_not_specialize=["R"])  # per-step counts: no recompile per value
def _gated_activation_kernel(
    G, U, Y,
    R, I,
    stride_g, stride_u, stride_y,
    up_offset,
    beta, linear_beta,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    SITU: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[r, c] = act(G[r, c], U[r, up_offset + c]) for r < R, c < I (fp32 inside, one rounding to Y's dtype)."""
    if PDL:  # gate / up come from the previous kernel: wait for it, then release our dependents
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < R)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(G + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * stride_u + up_offset + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if SITU:
        sig = tl.div_rn(1.0, 1.0 + tl.exp(-g))
        y = (beta * _tanh_f32(tl.div_rn(g, beta)) * sig) * (linear_beta * _tanh_f32(tl.div_rn(u, linear_beta)))
    else:
        y = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _check_act(act: Activation) -> None:
    if act.kind not in KINDS:
        raise ValueError(f"unknown gated activation {act.kind!r}; supported: 'silu', 'situ'")


def _out(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}")
    return out


def _launch(g2: Tensor, u2: Tensor, up_offset: int, y2: Tensor, act: Activation) -> None:
    """Launch over the [R, I] row views g2 (gate), u2 (up, columns from up_offset) into y2 (all unit column
    stride)."""
    r, i = y2.shape
    block_i = min(MAX_BLOCK_I, next_pow2(i))
    block_r = min(max(1, TILE // block_i), next_pow2(r))
    grid = (triton.cdiv(r, block_r), triton.cdiv(i, block_i))
    _gated_activation_kernel[grid](
        g2, u2, y2, r, i, g2.stride(0), u2.stride(0), y2.stride(0), up_offset,
        float(act.beta), float(act.linear_beta),
        BLOCK_R=block_r, BLOCK_I=block_i, SITU=act.kind == "situ", num_warps=4,
        **pdl.kernel_kwargs(y2.device, "act"),
    )


def gated_activation(gate: Tensor, up: Tensor, act: Activation, *, out: Tensor | None = None) -> Tensor:
    """Triton `ops.gated_activation` (same contract): gate, up [..., I] of one shape (any strides; a unit last
    stride is read in place, e.g. the halves of `gate_up.chunk(2, -1)`) -> [..., I] in gate.dtype, written into
    `out` (contiguous) if given. Nothing else is mutated."""
    _check_act(act)
    if up.shape != gate.shape:
        raise ValueError(f"gate and up must have one shape; got {tuple(gate.shape)}, {tuple(up.shape)}")
    y = _out(gate.shape, gate.dtype, gate.device, out)
    if y.numel() == 0:
        return y
    i = gate.shape[-1]
    _launch(as_rows(gate, i), as_rows(up, i), 0, y.view(-1, i), act)
    return y


def gated_activation_merged(gate_up: Tensor, act: Activation, *, out: Tensor | None = None) -> Tensor:
    """Triton `ops.gated_activation_merged` (same contract): gate_up [..., 2I] (gate = the first I columns,
    up = the last I) -> [..., I] in gate_up.dtype, written into `out` (contiguous) if given. Both halves are read
    in place (no chunk views). Nothing else is mutated."""
    _check_act(act)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up's last dim must be even (gate ; up); got {two_i}")
    i = two_i // 2
    y = _out((*gate_up.shape[:-1], i), gate_up.dtype, gate_up.device, out)
    if y.numel() == 0:
        return y
    gu = as_rows(gate_up, two_i)
    _launch(gu, gu, i, y.view(-1, i), act)
    return y
