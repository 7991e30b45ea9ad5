"""Triton `ops.stacked_linear` for a few rows: G independent projections of G adjacent column groups of one input,
y[g] = x[:, g * K : (g + 1) * K] @ W[g]^T, in one PDL launch.

Why: at decode sizes `torch.bmm` (cuBLAS) is a plain launch, so in the batch-1 step of kimi-linear-48b-a3b the KDA
gate up-projections (`fg_b_proj`, G 2, K 128, N 4096) broke the chain of programmatic dependent launches twice per
layer: the bmm could not start before the merged input projection (a Triton GEMV) had fully completed, and the
fused KDA decode after it could not start its pre-wait work (its state tile) early. This kernel launches as a PDL
dependent like the GEMV: each program loads its weight tile before `gdc_wait` (weights are never written), then
the input rows, and releases its dependents.

Grid (cdiv(N, BLOCK_N), G): program (j, g) owns rows n in [j * BLOCK_N, (j + 1) * BLOCK_N) of W[g] and walks the
T input rows one at a time: acc[n] = sum_k x[t, g * K + k] * W[g, n, k] in fp32 over BLOCK_K chunks of K, rounded
to the output dtype once (as bmm's fp32 accumulation is; the summation order differs). For T <= MAX_ROWS (the
wrapper's rule): each row is a dependent reduction, so many rows belong to cuBLAS. x: [T, G * K] with unit column
stride and any row stride (a view of the merged projection's output); W: [G, N, K] contiguous; out: [G, T, N]
contiguous, every element written. CUDA-graph safe (no host sync); T is not specialised (one variant for every
row count). Compiled code and the interpreter run the same body (PDL compiles away without Hopper).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2

MAX_ROWS = 8  # more rows: torch.bmm (the per-row reductions here are serial)
BLOCK_N = 32


@triton.jit(do_not_specialize=["T"])
def _stacked_gemv_kernel(X, W, Out, T, N, K, stride_xt, stride_wg, stride_og,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    pid_n, g = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + g * stride_wg + offs_n[:, None] * K + offs_k[None, :]
    if EVEN:  # N % BLOCK_N == 0 and K == BLOCK_K: the whole tile, unmasked, before the wait
        w_first = tl.load(w_ptrs)
    else:
        w_first = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x_base = X + g * K
    for t in range(T):
        if EVEN:
            x = tl.load(x_base + t * stride_xt + offs_k, cache_modifier=".cg")
        else:
            x = tl.load(x_base + t * stride_xt + offs_k, mask=offs_k < K, other=0.0, cache_modifier=".cg")
        acc = tl.sum(w_first.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):  # K > BLOCK_K only: the rest of the row, after the wait
            kk = k0 + offs_k
            w = tl.load(w_ptrs + k0, mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
            xk = tl.load(x_base + t * stride_xt + kk, mask=kk < K, other=0.0, cache_modifier=".cg")
            acc += tl.sum(w.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
        out_ptrs = Out + g * stride_og + t * N + offs_n
        if EVEN:
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty))
        else:
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=offs_n < N)


def supported(x: Tensor, weight: Tensor) -> bool:
    """Whether `stacked_linear` takes this kernel: 2-D x of T <= MAX_ROWS rows (T >= 1) with unit column stride,
    weight [G, N, K] contiguous with G * K == x's width, one dtype, K <= 256."""
    if x.dim() != 2 or weight.dim() != 3 or not weight.is_contiguous() or x.dtype != weight.dtype:
        return False
    g, _, k = weight.shape
    return 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == g * k and x.stride(1) == 1 and k <= 256


def stacked_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [T, G * K] (row stride free, unit column stride), weight [G, N, K] -> y [G, T, N] contiguous in x.dtype
    (`supported` must hold). Reads x and weight, writes only y."""
    g, n, k = weight.shape
    t = x.shape[0]
    out = torch.empty(g, t, n, dtype=x.dtype, device=x.device)
    block_k = min(next_pow2(k), 128)
    even = n % BLOCK_N == 0 and k == block_k
    _stacked_gemv_kernel[(triton.cdiv(n, BLOCK_N), g)](
        x, weight, out, t, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=block_k, EVEN=even, num_warps=4, **pdl.kernel_kwargs(x.device, "gemv"))
    return out
