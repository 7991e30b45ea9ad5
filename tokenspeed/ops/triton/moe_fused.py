"""The routed experts at decode batch sizes in ONE launch: gate/up and down fused, split over the intermediate dim.

`moe_experts`' direct mode (T <= `ExpertsConfig.direct_max_tokens`, no alignment) runs gate_up (h = act(x W1_e^T,
x W3_e^T) -> [P, I]) and then down (h W2_e^T -> [P, D]) as two launches, each paying its ramp, its tail and its
PDL wait (kimi-linear-48b-a3b at batch 1: 85 MB at ~25 us, then 42 MB at ~13 us). Here program (c, p) owns pair p
(token p // k, expert ids[p]) and the intermediate columns [c * C, (c + 1) * C): it computes

    h_c = cast(act(cast(x W1_e[c]^T), cast(x W3_e[c]^T)), x.dtype)          ([C], as gate_up rounds h)
    part[p * NC + c] = W2_e[:, c] h_c                                       ([D], fp32, NC = cdiv(I, C))

and the combine (`moe_combine.combine_partials`) sums the NC partial rows of each pair in a fixed order, rounds the
sum to x.dtype (as down rounds each expert output), then weights and sums the pairs as before. No atomics on
values: every partial row is written by exactly one program (zeros for an id outside [0, E)), so the result is
deterministic, and it differs from the two-launch path only by the fp32 summation order of the down product
(split-K over I: NC partial sums instead of one running sum). The gate/up part is the two-launch gate_up's
computation on a C-wide N tile (same BLOCK_M-row tile with the pair at row 0, same BLOCK_K loop, same roundings).

Bytes per call (elt = x.element_size()): 3 * I * D * elt per valid pair (W1, W3 rows of the chunk; W2's chunk
columns, read as [C, BLOCK_D] tiles of rows strided by I: C * elt contiguous bytes per hidden row, the neighbouring
chunk's program, adjacent in launch order, reads the rest of each line), x rows from L2, and the partials P * NC *
D * 4 written (and read back by the combine, L2-resident: kimi at T 1, 9 * 32 * 2304 * 4 = 2.65 MB). Kimi at T 1:
C 32, a grid of 32 x 9 = 288 programs, 442 KB of weights each.

PDL (`tokenspeed.ops.triton.pdl`): the expert ids come from the launch right before (the router), so every program
waits first thing and reads nothing before; it triggers its dependents right after the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.moe_config import ExpertsConfig, fused_chunk_size
from tokenspeed.ops.triton.moe_pdl import _pdl_sync


@triton.jit
def _tanh_f32(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, y, -y)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gate_up_chunk(X, W1, W3, tok, e64, offs_n, D, DI, stride_xt,
                   stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d, beta, linear_beta,
                   BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, SITU: tl.constexpr,
                   EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """[BLOCK_M, C] fp32 tile whose row 0 is act(x[tok] W1_e[offs_n]^T, x[tok] W3_e[offs_n]^T) with gate_up's
    roundings (the GEMM outputs to x.dtype, the activation in fp32); rows > 0 are x rows masked to zero, so they
    come out 0 (silu(0) * 0, situ(0) * 0), as the padding rows of the two-launch tile. offs_n: CHUNK columns;
    those >= DI load row offs_n % DI (no load mask; the caller zeroes them)."""
    offs_k = tl.arange(0, BLOCK_K)
    mvalid = tl.arange(0, BLOCK_M) == 0
    n_ld = (offs_n % DI).to(tl.int64)
    x_ptrs = X + tok * stride_xt + tl.zeros([BLOCK_M], dtype=tl.int64)[:, None] + offs_k[None, :]
    w1_ptrs = W1 + e64 * stride_w1e + n_ld[None, :] * stride_w1i + offs_k[:, None] * stride_w1d
    w3_ptrs = W3 + e64 * stride_w3e + n_ld[None, :] * stride_w3i + offs_k[:, None] * stride_w3d
    acc1 = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
    for kk in range(tl.cdiv(D, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mvalid[:, None], other=0.0)
            b1 = tl.load(w1_ptrs)
            b3 = tl.load(w3_ptrs)
        else:
            kmask = offs_k < D - kk * BLOCK_K
            a = tl.load(x_ptrs, mask=mvalid[:, None] & kmask[None, :], other=0.0)
            b1 = tl.load(w1_ptrs, mask=kmask[:, None], other=0.0)
            b3 = tl.load(w3_ptrs, mask=kmask[:, None], other=0.0)
        acc1 = _dot(a, b1, acc1, IEEE)
        acc3 = _dot(a, b3, acc3, IEEE)
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K * stride_w1d
        w3_ptrs += BLOCK_K * stride_w3d
    # The reference rounds the gate / up GEMM outputs to x.dtype before the fp32 activation.
    g = acc1.to(X.dtype.element_ty).to(tl.float32)
    u = acc3.to(X.dtype.element_ty).to(tl.float32)
    if SITU:
        h = beta * _tanh_f32(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh_f32(u / linear_beta))
    else:
        h = g * tl.sigmoid(g) * u
    return h


@triton.jit
def _fused_direct_kernel(
    X, W1, W3, W2, Part, PairIds,
    D, DI, E, NC,
    stride_xt,
    stride_w1e, stride_w1i, stride_w1d,
    stride_w3e, stride_w3i, stride_w3d,
    stride_w2e, stride_w2d, stride_w2i,
    beta, linear_beta,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SITU: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (c, p) (grid NC x P, the chunk fastest so one expert's chunks run side by side): partial row
    Part[p * NC + c, :D] (fp32) = W2_e[:, chunk c] h_c (see the module docstring), zeros when ids[p] is outside
    [0, E). PairIds: topk_ids flattened, [P]. PDL: waits first thing (the ids are the previous launch's output)."""
    c = tl.program_id(0)
    p = tl.program_id(1)
    _pdl_sync(PDL)
    e = tl.load(PairIds + p)
    offs_d = tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_M)
    # Every tile row points at the pair's partial row; only row 0 (the pair) is stored.
    out_ptrs = Part + (p * NC + c).to(tl.int64) * D + tl.zeros([BLOCK_M], dtype=tl.int64)[:, None] + offs_d[None, :]
    if (e < 0) | (e >= E):  # an invalid id contributes zeros: its partial rows are still written
        for d0 in range(0, D, BLOCK_D):
            tl.store(out_ptrs + d0, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
                     mask=(rows == 0)[:, None] & (offs_d < D - d0)[None, :])
        return
    e64 = e.to(tl.int64)
    offs_n = c * CHUNK + tl.arange(0, CHUNK)
    nmask = offs_n < DI
    h = _gate_up_chunk(X, W1, W3, (p // TOP_K).to(tl.int64), e64, offs_n, D, DI, stride_xt,
                       stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d, beta, linear_beta,
                       BLOCK_M, CHUNK, BLOCK_K, SITU, EVEN_K, IEEE)
    # h rounded to x.dtype where gate_up stores it; the wrapped columns of a ragged last chunk are zeroed.
    hq = tl.where(nmask[None, :], h, 0.0).to(W2.dtype.element_ty)
    w_ptrs = W2 + e64 * stride_w2e + offs_n.to(tl.int64)[:, None] * stride_w2i + offs_d[None, :] * stride_w2d
    for d0 in range(0, D, BLOCK_D):
        dmask = offs_d < D - d0
        b = tl.load(w_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)  # W2_e[d0 + offs_d, chunk]^T
        acc = _dot(hq, b, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), IEEE)
        tl.store(out_ptrs + d0, acc, mask=(rows == 0)[:, None] & dmask[None, :])
        w_ptrs += BLOCK_D * stride_w2d


def fused_direct(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, pair_ids: Tensor, top_k: int, act: Activation,
                 cfg: ExpertsConfig) -> tuple[Tensor, int]:
    """(partials [P * NC, D] fp32, NC): one launch of `_fused_direct_kernel` over grid NC x P, NC = cdiv(I, C),
    C = `fused_chunk_size`. Row p * NC + c = the down product of pair p's chunk c (zeros for ids outside [0, E));
    every row is written. x: [T, D] (unit column stride); w1, w3: [E, I, D]; w2: [E, D, I]; pair_ids: topk_ids
    flattened [P] contiguous (any integer dtype). Tiles: cfg.block_m rows (half with tail_m1, as `gate_up_direct`),
    cfg.block_k1, cfg.fused_block_d, cfg.num_warps1 / num_stages1. Nothing given is mutated."""
    D = x.shape[1]
    E, DI, _ = w1.shape
    P = pair_ids.numel()
    chunk = fused_chunk_size(P, DI, cfg)
    nc = triton.cdiv(DI, chunk)
    bm = cfg.block_m // 2 if cfg.tail_m1 else cfg.block_m
    bk = cfg.block_k1
    part = torch.empty(P * nc, D, dtype=torch.float32, device=x.device)
    block_d = max(16, min(cfg.fused_block_d, triton.next_power_of_2(D)))
    _fused_direct_kernel[(nc, P)](
        x, w1, w3, w2, part, pair_ids,
        D, DI, E, nc,
        x.stride(0),
        w1.stride(0), w1.stride(1), w1.stride(2),
        w3.stride(0), w3.stride(1), w3.stride(2),
        w2.stride(0), w2.stride(1), w2.stride(2),
        float(act.beta), float(act.linear_beta),
        TOP_K=top_k, BLOCK_M=bm, CHUNK=chunk, BLOCK_K=bk, BLOCK_D=block_d,
        SITU=act.kind == "situ", EVEN_K=D % bk == 0, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps1, num_stages=cfg.num_stages1, **pdl.kernel_kwargs(x.device, "moe"),
    )
    return part, nc
