"""A MoE layer's FFN junction fused into the next layer's first projection (decode sizes, M <= 4 rows).

The unfused chain at the end of a hidden-space MoE layer is down (the per-pair buffer) -> `combine_add_rms_norm`
(f = cast(sum_j w_j * buf_j), summed = cast(residual + f), normed = rms_norm(summed)) -> the next layer's input
projection y = normed @ W^T (KDA's merged in_proj, MLA's merged q / kv_a). At batch 1 the middle launch moves
~50 KB and costs ~3 us, most of it launch and dependency latency. `junction_gemv` folds it into the projection:

    y[m] = inv[m] * (W @ cast(norm_weight * summed[m]))    inv[m] = rsqrt(mean(summed[m]^2) + eps)

RMSNorm is a per-row scale, so it commutes with the product: every program builds its x tiles from the buffer
and the residual as it walks K (one [M, BLOCK_K] tile of summed per step, from L2: the buffer was just written),
accumulates the row's sum of squares beside the product, and scales its fp32 accumulator by inv once, at the end.
The programs of the first column tile (pid_n == 0) store summed, the new residual stream, with the combine's
exact expressions and roundings (bit for bit `combine_add_rms_norm`'s summed). y differs from the unfused
rms_norm -> GEMV only by rounding: one bf16 rounding of norm_weight * summed instead of two (summed * inv, then
the gain), and the fp32 summation orders; the tests bound it by the bf16 tolerance.

One program owns BLOCK_N rows of W and the whole K range (no split-K: each program needs the full row's sum of
squares). It runs the tensor-core GEMV's loop (`gemv._gemv_dot_kernel`: W tile [BLOCK_N, BLOCK_K] @ x^T with x
padded to 16 rows; here the BLOCK_MC = next_pow2(M) computed rows repeated to 16 by a broadcast, so the buffer is
read once per row, not once per padded row). LOOKAHEAD = 1 loads the next step's summed tile before the current
step's product (the buffer's L2 round trip hidden behind a weight tile); 0 leaves the order to the compiler.

PDL (`tokenspeed.ops.triton.pdl`): the first weight tile is read before the wait ("regs", weights are never
written by a kernel); the buffer, the routing weights and the residual only after it (the residual was written
by the layer's `moe_gate`, three launches back, but nothing is gained by reading it early).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.gemv import _load_tile, _mma

MAX_M = 4
DOT_M = 16  # rows of x the MMA takes (the tensor-core GEMV's padding)


@triton.jit
def _summed_tile(Buf, TopkW, Res, rows, k0, offs_k, K, stride_buf, stride_res,
                 TOP_K: tl.constexpr, EVEN_K: tl.constexpr):
    """summed [BLOCK_MC, BLOCK_K] in Res's dtype for columns k0 + offs_k: cast(res + cast(sum_j w_j * buf_j)),
    the expressions of `moe_combine._combine_norm_kernel` in its order (columns >= K are 0 unless EVEN_K)."""
    cols = k0 + offs_k
    if EVEN_K:
        res = tl.load(Res + rows[:, None] * stride_res + cols[None, :])
    else:
        res = tl.load(Res + rows[:, None] * stride_res + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    f = tl.zeros([rows.shape[0], offs_k.shape[0]], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(TopkW + rows * TOP_K + j)
        ptrs = Buf + (rows * TOP_K + j)[:, None] * stride_buf + cols[None, :]
        if EVEN_K:
            b = tl.load(ptrs)
        else:
            b = tl.load(ptrs, mask=(cols < K)[None, :], other=0.0)
        f += wj[:, None] * b.to(tl.float32)
    f = f.to(Res.dtype.element_ty)  # the FFN output as the unfused combine rounds it
    return (res.to(tl.float32) + f.to(tl.float32)).to(Res.dtype.element_ty)


@triton.jit
def _junction_step(acc, ss, w, s, NormW, S, offs_mc, store_rows, k0, offs_k, K,
                   BLOCK_M: tl.constexpr, BLOCK_MC: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """One K step: store the summed tile s's first store_rows rows (M, or 0 for no store), add its squares to ss [BLOCK_MC] and
    acc [BLOCK_N, BLOCK_M] += w @ cast(norm_weight * s)^T, s's rows repeated to BLOCK_M."""
    cols = k0 + offs_k
    kmask = cols < K
    tl.store(S + offs_mc[:, None] * K + cols[None, :], s, mask=(offs_mc[:, None] < store_rows) & kmask[None, :])
    sf = s.to(tl.float32)
    ss += tl.sum(sf * sf, axis=1)
    if EVEN_K:
        nw = tl.load(NormW + cols).to(tl.float32)
    else:
        nw = tl.load(NormW + cols, mask=kmask, other=0.0).to(tl.float32)
    xc = (nw[None, :] * sf).to(s.dtype)
    x = tl.reshape(tl.broadcast_to(xc[None, :, :], [BLOCK_M // BLOCK_MC, BLOCK_MC, offs_k.shape[0]]),
                   [BLOCK_M, offs_k.shape[0]])
    return _mma(w, x, acc, IEEE), ss


@triton.jit(do_not_specialize_on_alignment=["M"])
def _gemv_junction_kernel(
    Buf, TopkW, Res, NormW, W, Y, S,
    M, N, K, eps, stride_buf, stride_res, stride_wn,
    TOP_K: tl.constexpr,
    BLOCK_MC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_mc = tl.arange(0, BLOCK_MC)
    rows = tl.minimum(offs_mc, M - 1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w = _load_tile(w_ptrs, 0, offs_k, K, EVEN_K)  # the first weight tile, before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    store_rows = tl.where(pid_n == 0, M, 0)  # the first column tile stores summed
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_MC], dtype=tl.float32)
    s = _summed_tile(Buf, TopkW, Res, rows, 0, offs_k, K, stride_buf, stride_res, TOP_K, EVEN_K)
    if LOOKAHEAD:
        s_next = _summed_tile(Buf, TopkW, Res, rows, tl.minimum(BLOCK_K, K - 1), offs_k, K, stride_buf,
                              stride_res, TOP_K, False)
    acc, ss = _junction_step(acc, ss, w, s, NormW, S, offs_mc, store_rows, 0, offs_k, K, BLOCK_M, BLOCK_MC,
                             EVEN_K, IEEE)
    for k0 in range(BLOCK_K, K, BLOCK_K):  # the rest, software-pipelined on the weight tiles
        w_ptrs += BLOCK_K
        w = _load_tile(w_ptrs, k0, offs_k, K, EVEN_K)
        if LOOKAHEAD:
            s = s_next
            s_next = _summed_tile(Buf, TopkW, Res, rows, tl.minimum(k0 + BLOCK_K, K - 1), offs_k, K, stride_buf,
                                  stride_res, TOP_K, False)
        else:
            s = _summed_tile(Buf, TopkW, Res, rows, k0, offs_k, K, stride_buf, stride_res, TOP_K, EVEN_K)
        acc, ss = _junction_step(acc, ss, w, s, NormW, S, offs_mc, store_rows, k0, offs_k, K, BLOCK_M, BLOCK_MC,
                                 EVEN_K, IEEE)
    inv = tl.rsqrt(ss / K + eps)
    inv = tl.reshape(tl.broadcast_to(inv[None, :], [BLOCK_M // BLOCK_MC, BLOCK_MC]), [BLOCK_M])
    y = acc * inv[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    tl.store(Y + offs_m[None, :] * N + offs_n[:, None], y.to(Y.dtype.element_ty), mask=mask)


def unusable_reason(buf: Tensor, topk_weights: Tensor, top_k: int, residual: Tensor, norm_weight: Tensor,
                    weight: Tensor) -> str | None:
    """None when `junction_gemv` takes these tensors, else why not (host-only: shapes, dtypes, strides)."""
    T, D = residual.shape if residual.dim() == 2 else (0, 0)
    if residual.dim() != 2 or not 1 <= T <= MAX_M:
        return f"residual must be [T, D] with 1 <= T <= {MAX_M}"
    if buf.dim() != 2 or buf.shape != (T * top_k, D) or buf.stride(1) != 1 or residual.stride(1) != 1:
        return "buf must be [T * top_k, D] and residual [T, D], both with unit column stride"
    if weight.dim() != 2 or weight.shape[1] != D or weight.stride(1) != 1 or weight.shape[0] == 0:
        return "weight must be [N, D] row-major"
    if not (residual.dtype == buf.dtype == weight.dtype) or residual.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return "buf, residual and weight must share a bf16 / fp16 / fp32 dtype"
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous() or topk_weights.numel() != T * top_k:
        return "topk_weights must be T * top_k contiguous fp32 values"
    if norm_weight.shape != (D,) or not norm_weight.is_contiguous():
        return "norm_weight must be a contiguous [D]"
    if len({t.device for t in (buf, topk_weights, residual, norm_weight, weight)}) != 1:
        return "all tensors must be on one device"
    return None


def junction_config(M: int, N: int, K: int, route: dict | None) -> dict[str, int]:
    """Tiles for the fused launch: the routing table's tensor-core GEMV entry for (M, N, K) where it has one
    (route: `ops.dispatch.linear_route`'s dict), its split-K folded into narrower column tiles (the same number
    of programs, each over the whole K); else [64 x 128] tiles, 4 warps, 4 stages (the GEMV's default)."""
    if route and route.get("kind") == "dot":
        split = max(1, int(route.get("split_k", 1)))
        return {"block_n": max(16, int(route["block_n"]) // split), "block_k": int(route["block_k"]),
                "num_warps": int(route["num_warps"]), "num_stages": int(route["num_stages"])}
    return {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}


def junction_gemv(buf: Tensor, topk_weights: Tensor, top_k: int, residual: Tensor, norm_weight: Tensor, eps: float,
                  weight: Tensor, summed: Tensor, *, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                  num_stages: int = 4, lookahead: int = 1) -> Tensor:
    """y [T, N] = rms_norm(summed, norm_weight, eps) @ weight^T with summed = cast(residual + cast(sum_j
    topk_weights[t * k + j] * buf[t * k + j])) written into `summed` ([T, D] contiguous, residual's dtype; bit for
    bit `combine_add_rms_norm`'s). buf [T * k, D] (the experts' per-pair buffer), topk_weights fp32 [T * k],
    residual [T, D], norm_weight [D], weight [N, D]; 1 <= T <= MAX_M. y is a new contiguous tensor in weight's
    dtype, equal to the unfused rms_norm -> linear up to rounding (see the module docstring). Mutates `summed`
    only. ValueError where `unusable_reason` says why."""
    why = unusable_reason(buf, topk_weights, top_k, residual, norm_weight, weight)
    if why is not None:
        raise ValueError(f"junction_gemv: {why}")
    T, D = residual.shape
    if summed.shape != (T, D) or summed.dtype != residual.dtype or not summed.is_contiguous():
        raise ValueError(f"summed must be a contiguous [{T}, {D}] {residual.dtype} tensor")
    N = weight.shape[0]
    y = torch.empty(T, N, dtype=weight.dtype, device=weight.device)
    pdl_on = pdl.enabled(weight.device, "gemv")
    block_mc = triton.next_power_of_2(T)
    _gemv_junction_kernel[(triton.cdiv(N, block_n),)](
        buf, topk_weights, residual, norm_weight, weight, y, summed, T, N, D, float(eps), buf.stride(0),
        residual.stride(0), weight.stride(0), TOP_K=top_k, BLOCK_MC=block_mc, BLOCK_M=max(DOT_M, block_mc),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=D % block_k == 0, IEEE=weight.dtype == torch.float32,
        LOOKAHEAD=int(lookahead), PDL=pdl_on, num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl_on else {}))
    return y
