"""Triton `ops.stacked_linear` for a few rows: G independent projections, y[g] = x[:, g] @ W[g]^T, in one PDL
launch. Used for KDA's f / g gate up-projections (G 2 column groups of the merged input projection, K 128, N 4096)
and MLA's per-head absorptions at batch 1-3 (G = heads: q_nope @ W_UK[h] with W_UK read transposed, and
o_latent @ W_UV[h]^T written straight into the o_proj input).

Why: at decode sizes `torch.bmm` (cuBLAS) is a plain launch. In the batch-1 step of kimi-linear-48b-a3b each such
bmm sat between two PDL kernels and broke the chain of programmatic dependent launches twice: it could not start
before the kernel before it had fully completed, and the kernel after it could not start its pre-wait work early.
This kernel launches as a PDL dependent like the GEMV: each program loads its first weight tile before `gdc_wait`
(weights are never written), then the input rows, and releases its dependents.

Grid (cdiv(N, BLOCK_N), G): program (j, g) owns rows n in [j * BLOCK_N, (j + 1) * BLOCK_N) of W[g] and walks the
T input rows one at a time: acc[n] = sum_k x[t, g, k] * W[g, n, k] in fp32 over BLOCK_K chunks of K, rounded to
the output dtype once (as bmm's fp32 accumulation is; the summation order differs). For T <= MAX_ROWS (the
wrapper's rule): each row is a dependent reduction, so many rows belong to cuBLAS. Strides: x [T, G, K] and out
[G, T, N] any, with a unit last one; W [G, N, K] any (contiguous along K, or along N for a transposed read).
Every output element is written. CUDA-graph safe (no host sync); T is not specialised (one variant for every row
count). Compiled code and the interpreter run the same body (PDL compiles away without Hopper).
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
MAX_K = 1024
BLOCK_N = 32


@triton.jit(do_not_specialize=["T"])
def _stacked_gemv_kernel(X, W, Out, T, N, K, stride_xt, stride_xg, stride_wg, stride_wn, stride_wk, stride_og,
                         stride_ot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                         PDL: tl.constexpr):
    pid_n, g = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + g * stride_wg + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks; the first K tile before the wait
        w_first = tl.load(w_ptrs)
    else:
        w_first = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x_base = X + g * stride_xg
    for t in range(T):
        x_row = x_base + t * stride_xt
        if EVEN:
            x = tl.load(x_row + offs_k, cache_modifier=".cg")
        else:
            x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0, cache_modifier=".cg")
        acc = tl.sum(w_first.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):  # the rest of the row (K > BLOCK_K), after the wait
            kk = k0 + offs_k
            if EVEN:
                w = tl.load(w_ptrs + k0 * stride_wk)
                xk = tl.load(x_row + kk, cache_modifier=".cg")
            else:
                w = tl.load(w_ptrs + k0 * stride_wk, mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
                xk = tl.load(x_row + kk, mask=kk < K, other=0.0, cache_modifier=".cg")
            acc += tl.sum(w.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
        out_ptrs = Out + g * stride_og + t * stride_ot + offs_n
        if EVEN:
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty))
        else:
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=offs_n < N)


def _groups(x: Tensor, weight: Tensor) -> Tensor | None:
    """x as a [T, G, K] view (a 2-D [T, G * K] input split into its column groups), or None if it is neither."""
    g, _, k = weight.shape
    if x.dim() == 2 and x.shape[1] == g * k:
        return x.unflatten(1, (g, k))
    return x if x.dim() == 3 and x.shape[1:] == (g, k) else None


def supported(x: Tensor, weight: Tensor, out: Tensor | None = None) -> bool:
    """Whether `stacked_linear` takes this kernel: x [T, G * K] or [T, G, K] with T <= MAX_ROWS (T >= 1) and unit
    last stride; weight [G, N, K] with a unit stride along N or K, K <= MAX_K; out None or [G, T, N] with unit
    last stride; one dtype."""
    xg = _groups(x, weight) if weight.dim() == 3 else None
    if xg is None or x.dtype != weight.dtype or x.stride(-1) != 1 or not 1 <= x.shape[0] <= MAX_ROWS:
        return False
    g, n, k = weight.shape
    if k > MAX_K or 1 not in (weight.stride(1), weight.stride(2)):
        return False
    return out is None or (out.shape == (g, x.shape[0], n) and out.stride(-1) == 1 and out.dtype == x.dtype)


def stacked_linear(x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """y[g, t] = x[t, g] @ weight[g]^T (x [T, G * K] or [T, G, K], weight [G, N, K]; `supported` must hold) into
    `out` ([G, T, N], any strides with a unit last one) or a new contiguous [G, T, N] tensor of x.dtype, which is
    returned. Reads x and weight, writes only y."""
    xg = _groups(x, weight)
    g, n, k = weight.shape
    t = x.shape[0]
    if out is None:
        out = torch.empty(g, t, n, dtype=x.dtype, device=x.device)
    block_k = min(next_pow2(k), 128)
    even = n % BLOCK_N == 0 and k % block_k == 0
    _stacked_gemv_kernel[(triton.cdiv(n, BLOCK_N), g)](
        xg, weight, out, t, n, k, xg.stride(0), xg.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        out.stride(0), out.stride(1), BLOCK_N=BLOCK_N, BLOCK_K=block_k, EVEN=even, num_warps=4,
        **pdl.kernel_kwargs(x.device, "gemv"))
    return out
