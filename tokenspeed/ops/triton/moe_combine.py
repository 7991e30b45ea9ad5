"""The routed experts' combine (the last launch of `moe_experts`), plain or with the FFN junction fused in.

`combine` (grid T x cdiv(D, 1024)): out[t] = cast(sum_j w[t, j] * buf[t * k + j]) in fp32, then with `add`
cast(out[t] + add[t]) (the reference's two roundings).

`combine_add_rms_norm` (grid T: one program per token row over the full width D, the whole row in one
[1, next_pow2(D)] tile): the same f[t] (add included), then the pre-norm residual junction of the layer after it,
computed exactly as `tokenspeed.ops.triton.norm.add_rms_norm(f, residual, norm_weight, eps)` computes it: s =
cast(residual + f) (stored: the new residual stream), normed = cast(w * cast(s * rsqrt(mean(s^2) + eps))). Same
expressions, same one-row tile and warp count as that kernel picks for up to 264 rows (so the same reduction
order), and f is rounded to the model dtype before the add exactly as the unfused pair stores it: bit for bit
`moe_experts` followed by `add_rms_norm`, one launch instead of two.

PDL (`tokenspeed.ops.triton.pdl`, the reasoning in `tokenspeed.ops.triton.moe_pdl`): both kernels read before
their wait only what `moe_experts` was given (`add`, the residual, the norm weight): produced before the op's first
launch, so at least gate_up and down launches back. The per-pair buffer (down's output) and the routing weights
are read after the wait. Called on its own, a combine whose `add` or residual was written by the launch right
before it must not take the PDL path (`moe_experts` never does that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2
from tokenspeed.ops.triton.moe_pdl import _load_pre_wait, _pdl_sync


@triton.jit
def _combine_kernel(Buf, TopkW, Out, Add, D, stride_add, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_ADD: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum_j w[t, j] * buf[t * k + j] in fp32, cast to out.dtype (grid T x cdiv(D, BLOCK_D)); with HAS_ADD
    then cast(out[t] + add[t]) in fp32 (the reference's two roundings: the routed sum, then the add). PDL: add is
    read before the wait (see the module docstring), buf and the weights after it."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    if HAS_ADD:
        a = _load_pre_wait(Add + t * stride_add + offs, PDL, mask=m, other=0.0)
    _pdl_sync(PDL)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(TopkW + t * TOP_K + j)
        acc += w * tl.load(Buf + (t * TOP_K + j) * D + offs, mask=m, other=0.0).to(tl.float32)
    y = acc.to(Out.dtype.element_ty)
    if HAS_ADD:
        y = (y.to(tl.float32) + a.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + t * D + offs, y, mask=m)


@triton.jit(do_not_specialize=["R"])  # per-step counts: no recompile per value
def _combine_norm_kernel(Buf, TopkW, Add, Res, W, Y, S, R, D, stride_add, stride_res, eps,
                         TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Row t = program_id(0) of R rows, as one [1, BLOCK_D] tile (BLOCK_D >= D): f = the combine of
    `_combine_kernel` (add included) rounded to Y's dtype, then `tokenspeed.ops.triton.norm`'s residual-add norm
    with BLOCK_R = 1, expression for expression: S[t] = cast(Res[t] + f), Y[t] = cast(W * cast(S[t] * inv)).
    PDL: Res, W and Add are read before the wait, buf and the routing weights after it."""
    pid = tl.program_id(0)
    rows = pid + tl.arange(0, 1)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    res = _load_pre_wait(Res + r64[:, None] * stride_res + cols[None, :], PDL, mask=mask, other=0.0)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_ADD:
        a = _load_pre_wait(Add + r64[:, None] * stride_add + cols[None, :], PDL, mask=mask, other=0.0)
    _pdl_sync(PDL)
    t = pid.to(tl.int64)
    acc = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(TopkW + t * TOP_K + j)
        acc += wj * tl.load(Buf + (t * TOP_K + j) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    f = acc.to(S.dtype.element_ty)  # the FFN output as the unfused combine stores it
    if HAS_ADD:
        f = (f.to(tl.float32) + a.to(tl.float32)).to(S.dtype.element_ty)
    # From here on `_rms_norm_kernel` with RESIDUAL (x = f) and BLOCK_R = 1, unchanged.
    x = (res.to(tl.float32) + f.to(tl.float32)).to(S.dtype.element_ty)
    tl.store(S + r64[:, None] * D + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    normed = (x * inv[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    y = w[None, :] * normed
    tl.store(Y + r64[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _unit_cols(t: Tensor | None) -> Tensor | None:
    """t with unit column stride (a copy only when it has none)."""
    return t if t is None or t.stride(1) == 1 else t.contiguous()


def combine(buf: Tensor, topk_weights: Tensor, top_k: int, dtype: torch.dtype, add: Tensor | None = None) -> Tensor:
    """out [T, D] (dtype), out[t] = cast(sum_j w[t, j] * buf[t * k + j]) in fp32, then with `add` ([T, D], dtype)
    cast(out[t] + add[t]). buf: the per-pair buffer [P, D] of `down` / `down_direct`; topk_weights: fp32 [P]
    contiguous. Reads P * D * elt (+ T * D * elt with add), writes T * D * elt. PDL: see the module docstring."""
    P, D = buf.shape
    T = P // top_k
    out = torch.empty(T, D, dtype=dtype, device=buf.device)
    block_d = min(1024, triton.next_power_of_2(D))
    add = _unit_cols(add)
    _combine_kernel[(T, triton.cdiv(D, block_d))](
        buf, topk_weights, out, out if add is None else add, D, 0 if add is None else add.stride(0),
        TOP_K=top_k, BLOCK_D=block_d, HAS_ADD=add is not None, num_warps=4, **pdl.kernel_kwargs(buf.device, "moe"))
    return out


def norm_num_warps(block_d: int) -> int:
    """The warps `tokenspeed.ops.triton.norm` gives a one-row tile of block_d columns (kept equal to its choice,
    so the fused junction reduces each row in the same order on the GPU)."""
    return 4 if block_d <= 2048 else (8 if block_d <= 8192 else 16)


def combine_add_rms_norm(buf: Tensor, topk_weights: Tensor, top_k: int, residual: Tensor, norm_weight: Tensor,
                         norm_eps: float, add: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(normed, summed), both new [T, D] tensors in residual.dtype: f = `combine(buf, topk_weights, top_k,
    residual.dtype, add)`, summed = cast(residual + f), normed = rms_norm(summed, norm_weight, norm_eps) (the
    rounding of `add_rms_norm`), in one launch of one program per row. residual: [T, D] (unit column stride,
    else copied); norm_weight: [D]; add as in `combine`. Only reads residual, add and the weights. Reads P * D *
    elt + 2 (3 with add) * T * D * elt, writes 2 * T * D * elt."""
    P, D = buf.shape
    T = P // top_k
    dtype = residual.dtype
    normed = torch.empty(T, D, dtype=dtype, device=buf.device)
    summed = torch.empty(T, D, dtype=dtype, device=buf.device)
    residual, add = _unit_cols(residual), _unit_cols(add)
    block_d = next_pow2(D)
    _combine_norm_kernel[(T,)](
        buf, topk_weights, summed if add is None else add, residual, norm_weight, normed, summed, T, D,
        0 if add is None else add.stride(0), residual.stride(0), float(norm_eps),
        TOP_K=top_k, BLOCK_D=block_d, HAS_ADD=add is not None, num_warps=norm_num_warps(block_d),
        **pdl.kernel_kwargs(buf.device, "moe"))
    return normed, summed
