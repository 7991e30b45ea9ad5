"""Triton `ops.stacked_linear` for a few rows: G independent projections, y[g] = x[:, g] @ W[g]^T, in one PDL
launch. Used for KDA's f / g gate up-projections (G 2 column groups of the merged input projection, K 128, N 4096)
and MLA's per-head absorptions at batch 1-3 (G = heads: q_nope @ W_UK[h] with W_UK read transposed, and
o_latent @ W_UV[h]^T written straight into the o_proj input).

Why: at decode sizes `torch.bmm` (cuBLAS) is a plain launch. In the batch-1 step of kimi-linear-48b-a3b each such
bmm sat between two PDL kernels and broke the chain of programmatic dependent launches twice: it could not start
before the kernel before it had fully completed, and the kernel after it could not start its pre-wait work early.
This kernel launches as a PDL dependent like the GEMV: each program loads its first weight tile before `gdc_wait`
(weights are never written), then the input rows, and releases its dependents.

Grid (cdiv(N, BLOCK_N), G): program (j, g) owns rows n in [j * BLOCK_N, (j + 1) * BLOCK_N) of W[g] and all T
input rows as one [BLOCK_T = MAX_ROWS, BLOCK_K] tile (rows past T masked: neither read nor written): acc[t, n] =
sum_k x[t, g, k] * W[g, n, k] on the tensor cores (`tl.dot`, fp32 accumulation; IEEE for fp32 inputs) over
BLOCK_K chunks of K, rounded to the output dtype once (as bmm's fp32 accumulation is; the summation order
differs). T <= MAX_ROWS is the wrapper's rule. Strides: x [T, G, K] and out
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

MAX_ROWS = 16  # one row tile (BLOCK_T); more rows: torch.bmm
MAX_K = 1024
BLOCK_N = 32


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc [BLOCK_T, BLOCK_N] += x [BLOCK_T, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T (fp32 inputs: IEEE, no TF32)."""
    if IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit(do_not_specialize=["T"])
def _stacked_gemv_kernel(X, W, Out, T, N, K, stride_xt, stride_xg, stride_wg, stride_wn, stride_wk, stride_og,
                         stride_ot, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pid_n, g = tl.program_id(0), tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + g * stride_wg + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no weight masks; the first K tile before the wait
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rows = offs_t < T  # rows past T are neither read nor written
    x_ptrs = X + g * stride_xg + offs_t[:, None] * stride_xt + offs_k[None, :]
    if EVEN:
        x = tl.load(x_ptrs, mask=rows[:, None], other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(x_ptrs, mask=rows[:, None] & (offs_k[None, :] < K), other=0.0, cache_modifier=".cg")
    acc = _dot(x, w, tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32), IEEE)
    for k0 in range(BLOCK_K, K, BLOCK_K):  # the rest of K (K > BLOCK_K), after the wait
        kk = k0 + offs_k
        if EVEN:
            w = tl.load(w_ptrs + k0 * stride_wk)
            x = tl.load(x_ptrs + k0, mask=rows[:, None], other=0.0, cache_modifier=".cg")
        else:
            w = tl.load(w_ptrs + k0 * stride_wk, mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
            x = tl.load(x_ptrs + k0, mask=rows[:, None] & (kk[None, :] < K), other=0.0, cache_modifier=".cg")
        acc = _dot(x, w, acc, IEEE)
    out_ptrs = Out + g * stride_og + offs_t[:, None] * stride_ot + offs_n[None, :]
    if EVEN:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=rows[:, None])
    else:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=rows[:, None] & (offs_n[None, :] < N))


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
    block_k = max(min(next_pow2(k), 128), 16)  # tl.dot needs K tiles of >= 16
    even = n % BLOCK_N == 0 and k % block_k == 0
    _stacked_gemv_kernel[(triton.cdiv(n, BLOCK_N), g)](
        xg, weight, out, t, n, k, xg.stride(0), xg.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        out.stride(0), out.stride(1), BLOCK_T=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=block_k, EVEN=even,
        IEEE=x.dtype == torch.float32, num_warps=4, **pdl.kernel_kwargs(x.device, "gemv"))
    return out
