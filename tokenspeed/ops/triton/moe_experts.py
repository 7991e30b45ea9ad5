"""Routed experts (fused MoE): sort the (token, slot) pairs by expert, then two grouped-GEMM launches.

Same contract as `tokenspeed.ops.reference.moe.moe_experts`:

    out_t = cast(sum_j w_tj * cast(W2_e act(W1_e x_t, W3_e x_t), x.dtype), x.dtype),   e = topk_ids[t, j]

x: [T, D]; w1, w3: [E, I, D] (gate, up; I is `DI` in the code); w2: [E, D, I] (all x.dtype); topk_weights: [T, k]
fp32; topk_ids: [T, k] int64. Ids outside [0, E) contribute nothing. Rounding follows the reference: the gate and
up GEMMs accumulate in fp32 and are rounded to x.dtype (as the reference's `x @ w.t()` is), the activation is fp32
and rounded to x.dtype, the down GEMM accumulates in fp32 and is rounded to x.dtype, the routing weight and the sum
over the k slots are fp32, and the sum is rounded to x.dtype. fp32 inputs use IEEE fp32 dots (no TF32).

Alignment (`tokenspeed/ops/triton/moe_align.py`, no host synchronisation): the P = T*k pairs are bucketed by
expert and each bucket's run padded to a multiple of BLOCK_M, giving `sorted_pair_ids` [max_blocks * BLOCK_M]
(the pair of each padded row, P for padding) and `block_expert` [max_blocks] (-1 for unused blocks at the end).

Direct mode (T <= `ExpertsConfig.direct_max_tokens`; `default_config` sets DIRECT_MAX_TOKENS = 4 with its decode
tiles): no alignment launch at all. Block p is pair p (P blocks); kernels 1 and 2 read its expert topk_ids.flatten()[p]
themselves, and its one valid row is pair p: the tile's other rows are masked to zero exactly as the padding rows
of an aligned block holding one pair, so with the same tiles (and K loop) every output element equals the aligned
path's bit for bit. h is [P, I] (row p = pair p); the per-pair buffer and the combine are unchanged; an id outside
[0, E) skips kernel 1 and stores a zero row in kernel 2 (as the invalid bucket does). The price: pairs that share
an expert read its weights once each instead of sharing one block (never at T = 1: a token's k ids are distinct).
Uniform routing at E 256, k 8 expects T*k - E*(1 - (1 - k/E)^T) extra expert reads: 0.25 at T = 2, 1.5 at T = 4,
6.6 at T = 8, each 14.2 MB (~3 us from HBM, but duplicate blocks are at most P programs apart in launch order, so
mostly L2 hits); the saving is the fused alignment's launch, 6.3 us on the H200 at T = 1, serial between the router
and kernel 1. The prefill variants (group, gather_x, TMA) do not apply; tail_m1 / tail_m2 set the tile height, as
they do for a one-pair aligned block.

Kernel 1 (grid max_blocks x cdiv(I, BLOCK_N)): for an expert block, gathers the BLOCK_M x rows (token = p // k),
accumulates the x @ W1[e]^T and x @ W3[e]^T tiles in fp32 with tl.dot over D, applies SiLU or SiTU and writes
the intermediate h [max_blocks * BLOCK_M, I] (x.dtype). Blocks of the invalid bucket and unused blocks exit.
Kernel 2 (grid max_blocks x cdiv(D, BLOCK_N)): h rows @ W2[e]^T in fp32, rounded to x.dtype and stored at the
pair's row of a per-pair buffer [P, D] (x.dtype); blocks of the invalid bucket store zeros, so every row of the
buffer is written (it is allocated with torch.empty). Kernel 3, the combine (`tokenspeed.ops.triton.moe_combine`,
grid T x cdiv(D, 1024)): each token's k rows times their fp32 routing weights, summed in fp32 and rounded to x.dtype
(then, with `add`, plus that row, rounded again); with `residual=` / `norm_weight=` the FFN junction after it is
fused in (one program per row: summed = cast(residual + out), normed = rms_norm(summed), bit for bit `add_rms_norm`
after the unfused op). Program id 0 (the M-block) varies fastest, so the blocks of one expert run side by side and
share each weight tile through L2.

PDL (`tokenspeed.ops.triton.pdl`; `tokenspeed.ops.triton.moe_pdl` has the reasoning): every launch here is a
programmatic dependent on Hopper. gate_up (and gather_x, the fused alignment) waits first thing (with
`prefetch_expert`, an expert every call uses, block 0's programs first L2-prefetch its W1 / W3 rows); down reads its
expert id (the router's or the alignment's output, always at least two launches back) and L2-prefetches its W2 rows
before its wait, h after it; the combine reads `add`, the residual and the norm weight before its wait, the per-pair
buffer after it. Every program waits before it exits, whatever its path.

Bytes per call (elt = x.element_size(), c_e = pairs routed to expert e, touched = experts with c_e > 0):
  weights  sum_e ceil(c_e / BLOCK_M) * 3 * I * D * elt from L2, at least touched * 3 * I * D * elt from HBM
  h        2 * (number of non-empty expert blocks) * BLOCK_M * I * elt (write + read)
  buffer   2 * P * D * elt (write + read by the combine), x gathers (L2-resident) and T * D * elt out.
Weights dominate: at Kimi-Linear-48B decode (E=256, k=8, D=2304, I=1024, bf16) one expert is 14.16 MB, so
T=1 touches 8 experts (113 MB, ~24 us at 4.8 TB/s) and T=64 about 222 on average (~3.1 GB, ~0.66 ms).

Prefill variants (`ExpertsConfig` fields, all off by default; `default_config` returns none of them, and with them
off both GEMM kernels compile to the same sm_90 SASS as before they existed). Examples below: kimi-linear-48b-a3b
(E 256, k 8, D 2304, I 1024) and k3-slice (E 64, k 16, D 3584, I 3072) at 8K tokens, bf16; L2 is 50 MB.
  group_m1 / group_m2  program order. The 2-D grid makes one pass over every M-block per N tile, so each pass
                       re-reads all A rows: kernel 2 re-reads h (kimi 151 MB, k3 805 MB: more than L2) from HBM once
                       per N tile, 9 x 151 MB = 1.36 GB next to the 1.21 GB of W2 (k3 at BN 128: 28 x 805 MB =
                       22.5 GB next to 1.41 GB), and kernel 1 re-reads the gathered x rows (P * D * elt per pass, k3
                       24 x 940 MB through L2, x itself 59 MB). A 1-D grid in groups of GROUP_M M-blocks that sweep all
                       N tiles reads each A row from HBM about once (a group's rows, e.g. 8 * 128 * 3072 * 2 = 6.3 MB,
                       stay in L2 while its N tiles run); weights stay about once (blocks of an expert are adjacent).
  gather_x             one more kernel copies x into the sorted padded rows [max_blocks * BLOCK_M, D] (padding rows
                       zero): reads the P gathered rows (T * D * elt distinct), writes (used blocks) * BLOCK_M * D *
                       elt (kimi at BM 128 ~377 MB, k3 ~950 MB: ~0.1 / 0.25 ms at 4 TB/s); kernel 1's A tiles are
                       then plain tiles (no per-row addresses; TMA-able).
  tma1 / tma2          host TMA descriptors (triton.tools.tensor_descriptor, Triton >= 3.4) for W1 / W3 over
                       [E * I, D] and W2 over [E * D, I] (B tiles [BLOCK_N, BLOCK_K], transposed for the dot), for
                       the sorted x and for h; one copy per tile instead of a 16-byte cp.async per thread (kimi's
                       64 x (2 x 256) x 64 step: 72 KB, 18 per thread) and no address registers (that kernel: 255
                       -> ~172 registers per thread, Triton 3.6 for sm_90). Tensors a descriptor cannot take
                       (non-contiguous, a row not a multiple of 16 bytes) fall back to pointer loads.
  block_m2             kernel 2 on sub-blocks of the alignment block; a sub-block that starts with padding exits.
  tail_m1 / tail_m2    a block whose second half is padding runs a BLOCK_M / 2 tile (a second compiled loop):
                       rows computed per expert ceil(c_e / (BLOCK_M / 2)) * BLOCK_M / 2 while full blocks keep the
                       larger tile (kimi, 256 +- 16 rows per expert: BM 128 computes ~1.25 x the rows, with the
                       tail ~1.125 x, as BM 64 does).
L2 -> shared-memory bytes per FLOP of one tile (each A and B tile is read from L2 by every program that uses it):
kernel 1 moves (BM + 2 BN) * BK * elt for 4 BM BN BK FLOPs, 2 BM BN / (BM + 2 BN) FLOP/B: 57 at 64 x 256, 85 at
128 x 128; kernel 2 BM BN / (BM + BN): 51 at 64 x 256, 64 at 128 x 128, 85 at 128 x 256. At 780 TFLOP/s a kernel
at 57 FLOP/B needs 13.7 TB/s of L2 bandwidth, at 85 FLOP/B 9.2 TB/s: the larger tiles are the ones that can
approach the matmul rate; the grouped order removes the A re-reads that grow with the number of N tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import check_add, check_norm
from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.moe_align import align
from tokenspeed.ops.triton.moe_combine import _unit_cols, combine, combine_add_rms_norm
from tokenspeed.ops.triton.moe_config import (  # noqa: F401 - re-exported
    DIRECT_MAX_TOKENS,
    ExpertsConfig,
    _check_config,
    default_config,
)
from tokenspeed.ops.triton.moe_pdl import (
    _load_pre_wait,
    _pdl_sync,
    _prefetch_rows_l2,
    rows_prefetch_bytes,
    w2_prefetch_bytes,
)

try:  # host-side TMA descriptors (Triton >= 3.4); without them the TMA variants fall back to pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, y, -y)


@triton.jit
def _tile_ids(num_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(M-block, N tile) of this program. GROUP_M == 0: the 2-D grid (M-block fastest, so the blocks of one expert
    run side by side per N tile). GROUP_M > 0: a 1-D grid of num_m * cdiv(N, BLOCK_N) programs in groups of GROUP_M
    M-blocks, the M-block fastest inside a group, so a group's A rows are read by every N tile while they are still
    in L2 (instead of once per pass over all blocks)."""
    if GROUP_M == 0:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        width = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // width) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_rows
        pid_n = (pid % width) // group_rows
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gate_up_rows(
    X, W1, W3, H, SortedPair, row0, e, pid_n,
    P, D, DI,
    stride_xt,
    stride_w1e, stride_w1i, stride_w1d,
    stride_w3e, stride_w3i, stride_w3d,
    beta, linear_beta,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SITU: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    A_SORTED: tl.constexpr,
    TMA: tl.constexpr,
    DIRECT: tl.constexpr = False,
):
    """h rows row0 .. row0 + BLOCK_M (expert e, N tile pid_n): both GEMMs over D, the activation, the store.
    DIRECT (pointer loads, unsorted x): row0 is the pair, tile row 0 its only valid row (the others load zeros, as
    an aligned block's padding rows do) and only h row row0 is stored."""
    if TMA:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_row = e * DI + pid_n * BLOCK_N
        if A_SORTED:
            for kk in range(tl.cdiv(D, BLOCK_K)):
                a = X.load([row0, kk * BLOCK_K])
                b1 = W1.load([w_row, kk * BLOCK_K])
                b3 = W3.load([w_row, kk * BLOCK_K])
                acc1 = _mma(a, b1.T, acc1, IEEE)
                acc3 = _mma(a, b3.T, acc3, IEEE)
        else:
            pair = tl.load(SortedPair + offs_m)
            mvalid = pair < P
            x_ptrs = X + (pair // TOP_K).to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
            for kk in range(tl.cdiv(D, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(x_ptrs, mask=mvalid[:, None], other=0.0)
                else:
                    a = tl.load(x_ptrs, mask=mvalid[:, None] & (offs_k < D - kk * BLOCK_K)[None, :], other=0.0)
                b1 = W1.load([w_row, kk * BLOCK_K])
                b3 = W3.load([w_row, kk * BLOCK_K])
                acc1 = _mma(a, b1.T, acc1, IEEE)
                acc3 = _mma(a, b3.T, acc3, IEEE)
                x_ptrs += BLOCK_K
    else:
        e64 = e.to(tl.int64)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        if A_SORTED:
            mvalid = offs_m >= 0  # every sorted row exists (padding rows hold zeros)
            src_rows = offs_m.to(tl.int64)
        elif DIRECT:
            mvalid = tl.arange(0, BLOCK_M) == 0
            src_rows = tl.zeros([BLOCK_M], dtype=tl.int64) + row0 // TOP_K  # the pair's token (rows > 0 masked)
        else:
            pair = tl.load(SortedPair + offs_m)
            mvalid = pair < P
            src_rows = (pair // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ld = (offs_n % DI).to(tl.int64)  # wrapped rows for the ragged last tile: loads need no mask
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + src_rows[:, None] * stride_xt + offs_k[None, :]
        w1_ptrs = W1 + e64 * stride_w1e + n_ld[None, :] * stride_w1i + offs_k[:, None] * stride_w1d
        w3_ptrs = W3 + e64 * stride_w3e + n_ld[None, :] * stride_w3i + offs_k[:, None] * stride_w3d
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(tl.cdiv(D, BLOCK_K)):
            if EVEN_K:
                if A_SORTED:
                    a = tl.load(x_ptrs)
                else:
                    a = tl.load(x_ptrs, mask=mvalid[:, None], other=0.0)
                b1 = tl.load(w1_ptrs)
                b3 = tl.load(w3_ptrs)
            else:
                kmask = offs_k < D - kk * BLOCK_K
                a = tl.load(x_ptrs, mask=mvalid[:, None] & kmask[None, :], other=0.0)
                b1 = tl.load(w1_ptrs, mask=kmask[:, None], other=0.0)
                b3 = tl.load(w3_ptrs, mask=kmask[:, None], other=0.0)
            acc1 = _mma(a, b1, acc1, IEEE)
            acc3 = _mma(a, b3, acc3, IEEE)
            x_ptrs += BLOCK_K
            w1_ptrs += BLOCK_K * stride_w1d
            w3_ptrs += BLOCK_K * stride_w3d
    # The reference rounds the gate / up GEMM outputs to x.dtype before the fp32 activation.
    g = acc1.to(H.dtype.element_ty).to(tl.float32)
    u = acc3.to(H.dtype.element_ty).to(tl.float32)
    if SITU:
        h = beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
    else:
        h = g * tl.sigmoid(g) * u
    rows = offs_m.to(tl.int64)
    smask = (offs_n < DI)[None, :]
    if DIRECT:
        smask = smask & (tl.arange(0, BLOCK_M) == 0)[:, None]
    tl.store(H + rows[:, None] * DI + offs_n[None, :], h.to(H.dtype.element_ty), mask=smask)


@triton.jit(do_not_specialize=["P", "num_m"])  # per-step counts: no recompile per value
def _gate_up_kernel(
    X, W1, W3, H, SortedPair, BlockExpert,
    P, D, DI, E,
    stride_xt,
    stride_w1e, stride_w1i, stride_w1d,
    stride_w3e, stride_w3i, stride_w3d,
    beta, linear_beta, num_m, XH, pf_expert, pf_bytes,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SITU: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    GROUP_M: tl.constexpr = 0,
    A_SORTED: tl.constexpr = False,
    TMA: tl.constexpr = False,
    TAIL: tl.constexpr = False,
    DIRECT: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """PDL: waits first thing (its ids come from the launch right before it); with PREFETCH the programs of M-block 0
    first L2-prefetch pf_bytes of each W1 / W3 row of expert pf_expert in their N tile (a hint: see `moe_pdl`).
    A_SORTED: X is the expert-sorted copy [num_m * BLOCK_M, D] (row r = sorted row r, padding rows zero) and
    stride_xt its row stride. TMA: W1 and W3 are descriptors over [E * DI, D] with block [BLOCK_N, BLOCK_K] (rows
    past an expert in a ragged last N tile are the next expert's or zero-filled, and masked at the store), and X
    too when A_SORTED (block [BLOCK_M, BLOCK_K]); the K tail is zero-filled by the descriptor. TAIL: a block whose
    second half is padding computes only its first BLOCK_M / 2 rows (XH: X, or the sorted copy's descriptor with
    block [BLOCK_M / 2, BLOCK_K]); the skipped rows of h stay unwritten and the down kernel never stores them.
    DIRECT (the align-free mode; GROUP_M, A_SORTED, TMA and TAIL off): program (p, n) is pair p's block, its expert
    SortedPair[p] (SortedPair is topk_ids flattened, [P]; BlockExpert is unused), H is [P, DI] and row p the only
    row written; a pair whose id is outside [0, E) exits."""
    pid_m, pid_n = _tile_ids(num_m, DI, BLOCK_N, GROUP_M)
    if PREFETCH:  # noqa: SIM102 - a compile-time branch around a runtime one
        if pid_m == 0:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _prefetch_rows_l2(W1, pf_expert, offs_n, DI, stride_w1e, stride_w1i, pf_bytes)
            _prefetch_rows_l2(W3, pf_expert, offs_n, DI, stride_w3e, stride_w3i, pf_bytes)
    _pdl_sync(PDL)
    if DIRECT:
        e = tl.load(SortedPair + pid_m)
    else:
        e = tl.load(BlockExpert + pid_m)
    if (e < 0) | (e >= E):  # unused block, or the block of invalid ids (DIRECT: the pair's id is invalid)
        return
    if DIRECT:
        _gate_up_rows(X, W1, W3, H, SortedPair, pid_m, e, pid_n, P, D, DI, stride_xt,
                      stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d, beta, linear_beta,
                      TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, SITU, EVEN_K, IEEE, False, False, True)
    elif TAIL:
        if tl.load(SortedPair + pid_m * BLOCK_M + BLOCK_M // 2) >= P:
            _gate_up_rows(XH, W1, W3, H, SortedPair, pid_m * BLOCK_M, e, pid_n, P, D, DI, stride_xt,
                          stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d, beta, linear_beta,
                          TOP_K, BLOCK_M // 2, BLOCK_N, BLOCK_K, SITU, EVEN_K, IEEE, A_SORTED, TMA)
        else:
            _gate_up_rows(X, W1, W3, H, SortedPair, pid_m * BLOCK_M, e, pid_n, P, D, DI, stride_xt,
                          stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d, beta, linear_beta,
                          TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, SITU, EVEN_K, IEEE, A_SORTED, TMA)
    else:
        _gate_up_rows(X, W1, W3, H, SortedPair, pid_m * BLOCK_M, e, pid_n, P, D, DI, stride_xt,
                      stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d, beta, linear_beta,
                      TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, SITU, EVEN_K, IEEE, A_SORTED, TMA)


@triton.jit
def _down_rows(
    H, W2, Buf, SortedPair, row0, e, pid_n,
    P, D, DI, E,
    stride_w2e, stride_w2d, stride_w2i, pf_bytes,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,
    DIRECT: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Buffer rows of the pairs at sorted rows row0 .. row0 + BLOCK_M, N tile pid_n (zeros for the invalid bucket).
    DIRECT (pointer loads): row0 is the pair and tile row 0 its only valid row; h row row0 is read (the other tile
    rows load zeros, as an aligned block's padding rows of h hold) and buffer row row0 written.
    PDL: e and SortedPair (the router's / the alignment's, >= 2 launches back) are read before the wait, and with
    PREFETCH (pointer loads) pf_bytes of each W2 row of the tile are L2-prefetched; h and every store come after."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    if DIRECT:
        pair = offs_m
        mvalid = tl.arange(0, BLOCK_M) == 0
    else:
        pair = _load_pre_wait(SortedPair + offs_m, PDL)
        mvalid = pair < P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = Buf + pair.to(tl.int64)[:, None] * D + offs_n[None, :]
    out_mask = mvalid[:, None] & (offs_n < D)[None, :]
    if e >= E:  # pairs with invalid ids contribute zeros
        _pdl_sync(PDL)
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=Buf.dtype.element_ty), mask=out_mask)
    else:
        if PREFETCH:
            _prefetch_rows_l2(W2, e, offs_n, D, stride_w2e, stride_w2d, pf_bytes)
        _pdl_sync(PDL)
        if TMA:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            w_row = e * D + pid_n * BLOCK_N
            for kk in range(tl.cdiv(DI, BLOCK_K)):
                a = H.load([row0, kk * BLOCK_K])
                b = W2.load([w_row, kk * BLOCK_K])
                acc = _mma(a, b.T, acc, IEEE)
        else:
            e64 = e.to(tl.int64)
            n_ld = (offs_n % D).to(tl.int64)
            offs_k = tl.arange(0, BLOCK_K)
            h_ptrs = H + offs_m.to(tl.int64)[:, None] * DI + offs_k[None, :]
            w_ptrs = W2 + e64 * stride_w2e + n_ld[None, :] * stride_w2d + offs_k[:, None] * stride_w2i
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kk in range(tl.cdiv(DI, BLOCK_K)):
                if EVEN_K:
                    if DIRECT:
                        a = tl.load(h_ptrs, mask=mvalid[:, None], other=0.0)
                    else:
                        a = tl.load(h_ptrs)
                    b = tl.load(w_ptrs)
                else:
                    kmask = offs_k < DI - kk * BLOCK_K
                    if DIRECT:
                        a = tl.load(h_ptrs, mask=mvalid[:, None] & kmask[None, :], other=0.0)
                    else:
                        a = tl.load(h_ptrs, mask=kmask[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
                acc = _mma(a, b, acc, IEEE)
                h_ptrs += BLOCK_K
                w_ptrs += BLOCK_K * stride_w2i
        tl.store(out_ptrs, acc.to(Buf.dtype.element_ty), mask=out_mask)  # each expert output rounded to x.dtype


@triton.jit(do_not_specialize=["P", "num_m"])  # per-step counts: no recompile per value
def _down_kernel(
    H, W2, Buf, SortedPair, BlockExpert,
    P, D, DI, E,
    stride_w2e, stride_w2d, stride_w2i, num_m, HH, pf_bytes,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    GROUP_M: tl.constexpr = 0,
    SUB: tl.constexpr = 1,
    TMA: tl.constexpr = False,
    TAIL: tl.constexpr = False,
    DIRECT: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """BLOCK_M here is the down M-block: SUB = alignment block / BLOCK_M programs per alignment block, and a
    sub-block whose first row is padding (so all its rows are) exits. TMA: H is a descriptor over [num_m * BLOCK_M,
    DI] (block [BLOCK_M, BLOCK_K]) and W2 over [E * D, DI] (block [BLOCK_N, BLOCK_K]); the K tail is zero-filled.
    TAIL: a block whose second half is padding runs BLOCK_M / 2 rows (HH: H, or its descriptor with block
    [BLOCK_M / 2, BLOCK_K]). DIRECT (the align-free mode; GROUP_M, SUB, TMA and TAIL off): program (p, n) is pair
    p's block, H is the direct [P, DI], the expert SortedPair[p] (SortedPair is topk_ids flattened, [P];
    BlockExpert is unused); a pair whose id is outside [0, E) stores zeros. PDL: the routing reads (BlockExpert,
    SortedPair) come before the wait and the W2 prefetch (PREFETCH, pf_bytes per row) with them (`_down_rows`);
    a program that exits early waits first."""
    pid_m, pid_n = _tile_ids(num_m, D, BLOCK_N, GROUP_M)
    if DIRECT:
        e = _load_pre_wait(SortedPair + pid_m, PDL)
        e = tl.where((e >= 0) & (e < E), e, E)  # invalid ids: the zero-storing branch of _down_rows
        _down_rows(H, W2, Buf, SortedPair, pid_m, e, pid_n, P, D, DI, E, stride_w2e, stride_w2d, stride_w2i,
                   pf_bytes, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, False, True, PDL, PREFETCH)
    else:
        if SUB == 1:
            e = _load_pre_wait(BlockExpert + pid_m, PDL)
        else:
            e = _load_pre_wait(BlockExpert + pid_m // SUB, PDL)
        if e < 0:  # unused block
            _pdl_sync(PDL)
            return
        if SUB > 1:  # noqa: SIM102 - a compile-time branch around a runtime one
            if _load_pre_wait(SortedPair + pid_m * BLOCK_M, PDL) >= P:  # padding runs to the end of its block
                _pdl_sync(PDL)
                return
        if TAIL:
            if _load_pre_wait(SortedPair + pid_m * BLOCK_M + BLOCK_M // 2, PDL) >= P:
                _down_rows(HH, W2, Buf, SortedPair, pid_m * BLOCK_M, e, pid_n, P, D, DI, E, stride_w2e,
                           stride_w2d, stride_w2i, pf_bytes, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA,
                           False, PDL, PREFETCH)
            else:
                _down_rows(H, W2, Buf, SortedPair, pid_m * BLOCK_M, e, pid_n, P, D, DI, E, stride_w2e,
                           stride_w2d, stride_w2i, pf_bytes, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA,
                           False, PDL, PREFETCH)
        else:
            _down_rows(H, W2, Buf, SortedPair, pid_m * BLOCK_M, e, pid_n, P, D, DI, E, stride_w2e, stride_w2d,
                       stride_w2i, pf_bytes, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA, False, PDL, PREFETCH)


@triton.jit(do_not_specialize=["P"])  # per-step counts: no recompile per value
def _gather_x_kernel(X, Xs, SortedPair, BlockExpert, P, D, E, stride_xt,
                     TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Xs[r] = x[pair(r) // k] for the rows of valid expert blocks, zeros for their padding rows (grid max_blocks
    x cdiv(D, BLOCK_D)). Rows of unused blocks and of the invalid bucket are not written: the gate/up kernel skips
    them. PDL: waits first thing (the alignment is the launch right before it)."""
    _pdl_sync(PDL)
    blk = tl.program_id(0)
    e = tl.load(BlockExpert + blk)
    if (e < 0) | (e >= E):
        return
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPair + offs_m)
    tok = (pair // TOP_K).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = offs_d < D
    v = tl.load(X + tok[:, None] * stride_xt + offs_d[None, :], mask=(pair < P)[:, None] & dm[None, :], other=0.0)
    tl.store(Xs + offs_m.to(tl.int64)[:, None] * D + offs_d[None, :], v, mask=dm[None, :])


def _tma_ok(*ts: Tensor) -> bool:
    """Whether each tensor, read as the 2-D [rows, last dim] view of a contiguous tensor, fits a TMA descriptor:
    16-byte aligned base and row stride (the descriptor class is importable, i.e. Triton >= 3.4)."""
    return TensorDescriptor is not None and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0 for t in ts)


def _rows2d(t: Tensor) -> Tensor:
    return t.view(-1, t.shape[-1])


def gather_sorted_x(x: Tensor, sorted_pair_ids: Tensor, block_expert: Tensor, top_k: int, num_experts: int,
                    block_m: int) -> Tensor:
    """The expert-sorted padded copy of x, [max_blocks * block_m, D] (x.dtype): row r holds x[pair(r) // k] for the
    rows of valid expert blocks, zeros for their padding rows; rows of unused blocks and of the invalid bucket are
    left unwritten (never read). Bytes: reads P * D * elt of gathered x rows (T * D * elt distinct, mostly L2 hits),
    writes (used blocks) * block_m * D * elt, about (P + E * block_m / 2) * D * elt."""
    T, D = x.shape
    max_blocks = block_expert.numel()
    xs = torch.empty(max_blocks * block_m, D, dtype=x.dtype, device=x.device)
    block_d = max(16, min(triton.next_power_of_2(D), 16384 // block_m))
    _gather_x_kernel[(max_blocks, triton.cdiv(D, block_d))](
        x, xs, sorted_pair_ids, block_expert, T * top_k, D, num_experts, x.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4, **pdl.kernel_kwargs(x.device, "moe"),
    )
    return xs


def _gate_up_prefetch(w1: Tensor, w3: Tensor, expert: int | None, pointer_loads: bool) -> tuple[dict, int, int]:
    """(launch keywords, prefetch expert, bytes per W1 / W3 row) of a gate/up launch: PDL's keywords, and the L2
    prefetch of `expert` before the wait (PDL launches with pointer loads, an id in [0, E), 16-byte aligned rows)."""
    kw = pdl.kernel_kwargs(w1.device, "moe")
    want = kw["PDL"] and pointer_loads and expert is not None and 0 <= expert < w1.shape[0]
    nbytes = min(rows_prefetch_bytes(w1, want), rows_prefetch_bytes(w3, want))
    return {**kw, "PREFETCH": nbytes > 0}, int(expert) if nbytes else 0, nbytes


def gate_up(x: Tensor, w1: Tensor, w3: Tensor, sorted_pair_ids: Tensor, block_expert: Tensor, top_k: int,
            act: Activation, cfg: ExpertsConfig, xs: Tensor | None = None,
            prefetch_expert: int | None = None) -> Tensor:
    """Kernel 1: h [max_blocks * block_m, I] (x.dtype) for the alignment (sorted_pair_ids, block_expert) built with
    cfg.block_m; rows of unused and invalid-bucket blocks (and, with tail_m1, the padding half of a block) are not
    written. With cfg.gather_x the sorted copy of x is built first (or `xs` from `gather_sorted_x` is used).
    Bytes (B = expert blocks, elt = x.element_size()): A rows B * block_m * D * elt per N tile (L2 hits when the
    N tiles of a block run together: group_m1), W1 and W3 2 * I * D * elt per block through L2 (about once per
    touched expert from HBM), h written B * block_m * I * elt. prefetch_expert: an expert id the routing is known
    to use (a hint, see `moe_pdl`), L2-prefetched before the PDL wait (pointer loads only)."""
    T, D = x.shape
    E, DI, _ = w1.shape
    bm, bn, bk = cfg.block_m, cfg.block_n1, cfg.block_k1
    max_blocks = block_expert.numel()
    a = x
    if cfg.gather_x:
        a = xs if xs is not None else gather_sorted_x(x, sorted_pair_ids, block_expert, top_k, E, bm)
    h = torch.empty(max_blocks * bm, DI, dtype=x.dtype, device=x.device)
    tma = cfg.tma1 and _tma_ok(w1, w3, *((a,) if cfg.gather_x else ()))
    a_arg, w1_arg, w3_arg = a, w1, w3
    if tma:
        w1_arg = TensorDescriptor.from_tensor(_rows2d(w1), [bn, bk])
        w3_arg = TensorDescriptor.from_tensor(_rows2d(w3), [bn, bk])
        if cfg.gather_x:
            a_arg = TensorDescriptor.from_tensor(a, [bm, bk])
    a_half = None
    if cfg.tail_m1:
        a_half = TensorDescriptor.from_tensor(a, [bm // 2, bk]) if tma and cfg.gather_x else a_arg
    n_tiles = triton.cdiv(DI, bn)
    grid = (max_blocks * n_tiles,) if cfg.group_m1 else (max_blocks, n_tiles)
    kw, pf_expert, pf_bytes = _gate_up_prefetch(w1, w3, prefetch_expert, not tma)
    _gate_up_kernel[grid](
        a_arg, w1_arg, w3_arg, h, sorted_pair_ids, block_expert,
        T * top_k, D, DI, E,
        a.stride(0),
        w1.stride(0), w1.stride(1), w1.stride(2),
        w3.stride(0), w3.stride(1), w3.stride(2),
        float(act.beta), float(act.linear_beta), max_blocks, a_half, pf_expert, pf_bytes,
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SITU=act.kind == "situ",
        EVEN_K=D % bk == 0, IEEE=x.dtype == torch.float32, GROUP_M=cfg.group_m1, A_SORTED=cfg.gather_x, TMA=tma,
        TAIL=cfg.tail_m1,
        num_warps=cfg.num_warps1, num_stages=cfg.num_stages1, **kw,
    )
    return h


def down(h: Tensor, w2: Tensor, sorted_pair_ids: Tensor, block_expert: Tensor, num_pairs: int,
         cfg: ExpertsConfig) -> Tensor:
    """Kernel 2: the per-pair buffer [P, D] (h.dtype), every row written (zeros for invalid ids), from `gate_up`'s
    h. Programs of cfg.block_m2 rows (default cfg.block_m) inside the alignment's blocks. Bytes: h rows
    B * block_m * I * elt per N tile (from HBM on every pass unless group_m2 keeps a block's N tiles together),
    W2 D * I * elt per block through L2 (about once per touched expert from HBM), the buffer P * D * elt written."""
    E, D, DI = w2.shape
    bm = cfg.block_m
    bm2 = cfg.block_m2 or bm
    bn, bk = cfg.block_n2, cfg.block_k2
    sub = bm // bm2
    num_m = block_expert.numel() * sub
    buf = torch.empty(num_pairs, D, dtype=h.dtype, device=h.device)
    tma = cfg.tma2 and _tma_ok(h, w2)
    h_arg, w2_arg = h, w2
    if tma:
        h_arg = TensorDescriptor.from_tensor(h, [bm2, bk])
        w2_arg = TensorDescriptor.from_tensor(_rows2d(w2), [bn, bk])
    h_half = None
    if cfg.tail_m2:
        h_half = TensorDescriptor.from_tensor(h, [bm2 // 2, bk]) if tma else h
    n_tiles = triton.cdiv(D, bn)
    grid = (num_m * n_tiles,) if cfg.group_m2 else (num_m, n_tiles)
    kw = pdl.kernel_kwargs(h.device, "moe")
    pf_bytes = w2_prefetch_bytes(w2, bn, num_m * n_tiles, kw["PDL"] and not tma and cfg.prefetch_w2)
    _down_kernel[grid](
        h_arg, w2_arg, buf, sorted_pair_ids, block_expert,
        num_pairs, D, DI, E,
        w2.stride(0), w2.stride(1), w2.stride(2), num_m, h_half, pf_bytes,
        BLOCK_M=bm2, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=DI % bk == 0, IEEE=h.dtype == torch.float32, GROUP_M=cfg.group_m2, SUB=sub, TMA=tma,
        TAIL=cfg.tail_m2, PREFETCH=pf_bytes > 0,
        num_warps=cfg.num_warps2, num_stages=cfg.num_stages2, **kw,
    )
    return buf


def gate_up_direct(x: Tensor, w1: Tensor, w3: Tensor, pair_ids: Tensor, top_k: int, act: Activation,
                   cfg: ExpertsConfig, prefetch_expert: int | None = None) -> Tensor:
    """Kernel 1 in the direct mode: h [P, I] (x.dtype), row p = the activation of pair p (token p // top_k, expert
    pair_ids[p]); rows of pairs whose id is outside [0, E) are left unwritten (the down kernel never reads them).
    pair_ids: topk_ids flattened, [P] contiguous (any integer dtype). Grid P x cdiv(I, block_n1), cfg.block_m-row
    tiles (cfg.block_m / 2 with tail_m1: every direct block has one row, as an aligned block of one pair runs);
    group_m1, gather_x and tma1 do not apply. Bytes: W1 and W3 2 * I * D * elt per valid pair (pairs sharing an
    expert read it once each, through L2 when they run together), x rows P * D * elt, h P * I * elt written.
    prefetch_expert: as in `gate_up`."""
    D = x.shape[1]
    E, DI, _ = w1.shape
    P = pair_ids.numel()
    bm = cfg.block_m // 2 if cfg.tail_m1 else cfg.block_m
    bn, bk = cfg.block_n1, cfg.block_k1
    h = torch.empty(P, DI, dtype=x.dtype, device=x.device)
    kw, pf_expert, pf_bytes = _gate_up_prefetch(w1, w3, prefetch_expert, True)
    _gate_up_kernel[(P, triton.cdiv(DI, bn))](
        x, w1, w3, h, pair_ids, pair_ids,
        P, D, DI, E,
        x.stride(0),
        w1.stride(0), w1.stride(1), w1.stride(2),
        w3.stride(0), w3.stride(1), w3.stride(2),
        float(act.beta), float(act.linear_beta), P, None, pf_expert, pf_bytes,
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SITU=act.kind == "situ",
        EVEN_K=D % bk == 0, IEEE=x.dtype == torch.float32, DIRECT=True,
        num_warps=cfg.num_warps1, num_stages=cfg.num_stages1, **kw,
    )
    return h


def down_direct(h: Tensor, w2: Tensor, pair_ids: Tensor, cfg: ExpertsConfig) -> Tensor:
    """Kernel 2 in the direct mode: the per-pair buffer [P, D] (h.dtype) from `gate_up_direct`'s h [P, I], every
    row written (zeros for ids outside [0, E)). Grid P x cdiv(D, block_n2), (block_m2 or block_m)-row tiles (half
    that with tail_m2); group_m2 and tma2 do not apply. Bytes: W2 D * I * elt per valid pair, h P * I * elt read,
    the buffer P * D * elt written."""
    E, D, DI = w2.shape
    P = pair_ids.numel()
    bm = cfg.block_m2 or cfg.block_m
    bm = bm // 2 if cfg.tail_m2 else bm
    bn, bk = cfg.block_n2, cfg.block_k2
    buf = torch.empty(P, D, dtype=h.dtype, device=h.device)
    n_tiles = triton.cdiv(D, bn)
    kw = pdl.kernel_kwargs(h.device, "moe")
    pf_bytes = w2_prefetch_bytes(w2, bn, P * n_tiles, kw["PDL"] and cfg.prefetch_w2)
    _down_kernel[(P, n_tiles)](
        h, w2, buf, pair_ids, pair_ids,
        P, D, DI, E,
        w2.stride(0), w2.stride(1), w2.stride(2), P, None, pf_bytes,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=DI % bk == 0, IEEE=h.dtype == torch.float32, DIRECT=True, PREFETCH=pf_bytes > 0,
        num_warps=cfg.num_warps2, num_stages=cfg.num_stages2, **kw,
    )
    return buf


def _check_args(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                act: Activation, add: Tensor | None) -> None:
    """ValueError unless the shapes, dtypes and activation fit `moe_experts`' contract."""
    if act.kind not in ("silu", "situ"):
        raise ValueError(f"unknown gated activation {act.kind!r}; supported: 'silu', 'situ'")
    T, D = x.shape
    E, DI, D1 = w1.shape
    if D1 != D or w3.shape != w1.shape or w2.shape != (E, D, DI):
        raise ValueError(f"need w1, w3 [E, I, {D}] and w2 [E, {D}, I]; got {tuple(w1.shape)}, {tuple(w3.shape)}, "
                         f"{tuple(w2.shape)}")
    if not (w1.dtype == w3.dtype == w2.dtype == x.dtype):
        raise ValueError(f"x and the expert weights must share a dtype; got {x.dtype}, {w1.dtype}, {w3.dtype}, "
                         f"{w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights and topk_ids must both be [{T}, k]; got {tuple(topk_weights.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    check_add(add, x, D)


def _empty_call(x: Tensor, D: int, add: Tensor | None, residual: Tensor | None, norm_weight: Tensor | None,
                norm_eps: float) -> Tensor | tuple[Tensor, Tensor]:
    """A call with nothing to compute (no pair, or D or I zero): zeros (+ add), then the junction if asked."""
    out = torch.zeros(x.shape[0], D, dtype=x.dtype, device=x.device)
    out = out if add is None else out + add
    if residual is None:
        return out
    from tokenspeed.ops.triton.norm import add_rms_norm

    return add_rms_norm(out, residual, norm_weight, norm_eps)


def moe_experts(
    x: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    act: Activation,
    *,
    add: Tensor | None = None,
    residual: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    prefetch_expert: int | None = None,
    config: ExpertsConfig | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Triton `ops.moe_experts` (same contract, `add` too: added in the combine kernel, no extra launch): returns
    [T, D] in x.dtype. `config` overrides the tiles; T <= config.direct_max_tokens takes the direct mode (no
    alignment launch), which gives the aligned path's result bit for bit. With `residual` ([T, D], x.dtype) and
    `norm_weight` ([D]): returns (normed, summed) of the FFN junction fused into the combine (one program per row,
    `combine_add_rms_norm`), bit for bit this op's output followed by `tokenspeed.ops.triton.norm.add_rms_norm(out,
    residual, norm_weight, norm_eps)` (on the GPU: where that kernel takes one row per program, up to 264 rows;
    `ops.moe_experts` fuses up to ADD_NORM_FUSED_MAX_ROWS). prefetch_expert: an expert id the routing is known to
    use (a folded shared expert), L2-prefetched by gate_up before its PDL wait; a hint, no effect on the result.
    Nothing given is mutated."""
    _check_args(x, w1, w3, w2, topk_weights, topk_ids, act, add)
    check_norm(residual, norm_weight, x, w2.shape[1])
    T, D = x.shape
    E, DI, _ = w1.shape
    k = topk_ids.shape[1]
    P = T * k
    if P == 0 or D == 0 or DI == 0:  # no launch at all (an empty gate_up grid would break down's PDL reasoning)
        return _empty_call(x, D, add, residual, norm_weight, norm_eps)
    cfg = config or default_config(T, k, E, D, DI, x.element_size())
    _check_config(cfg)
    if x.stride(1) != 1:
        x = x.contiguous()
    add, residual = _unit_cols(add), _unit_cols(residual)  # before the first launch: the combine reads them pre-wait
    tw = topk_weights.reshape(-1)
    if tw.dtype != torch.float32:
        tw = tw.float()
    if not tw.is_contiguous():
        tw = tw.contiguous()
    if T <= cfg.direct_max_tokens:
        pair_ids = topk_ids.reshape(-1).contiguous()
        h = gate_up_direct(x, w1, w3, pair_ids, k, act, cfg, prefetch_expert)
        buf = down_direct(h, w2, pair_ids, cfg)
    else:
        sorted_pair_ids, block_expert = align(topk_ids, E, cfg.block_m)
        h = gate_up(x, w1, w3, sorted_pair_ids, block_expert, k, act, cfg, prefetch_expert=prefetch_expert)
        buf = down(h, w2, sorted_pair_ids, block_expert, P, cfg)
    if residual is not None:
        return combine_add_rms_norm(buf, tw, k, residual, norm_weight, norm_eps, add)
    return combine(buf, tw, k, x.dtype, add)
