"""The W_UV product of absorbed MLA fused into `mla_decode`'s split combine (`mla_decode(..., w_uv=...)`).

W_UV fused into the combine (`w_uv` [H, v_head, v_dim], kv_b_proj's W_UV view): the output is o[t, h] =
W_UV[h] o_lat[t, h] ([.., H, v_head] in q's dtype), the composition `mla_decode` then the model's bmm, which
rounds o_lat to q's dtype in between (the split kernel's direct store or the combine's store); the fused combine
rounds at the same point, then multiplies (tl.dot, fp32 accumulation, one rounding), so the only difference is the
fp32 summation order. A head's product needs its whole latent row, and a split program holds all H heads of a
key range (W_UV of every head: 4 MB), so the product can only follow the merge: with w_uv every split item writes
partials (ALL_PARTIAL: single-split sequences too; a padding sequence's zeros come out of the merge, which sees no
split) and `_mla_combine_uv_kernel` always runs, one program per (UV_BLOCK_V output columns, head, UV_BLOCK_T
tokens). One program per head would stream W_UV[h] (128 KB) alone on 32 SMs at batch 1; 32 columns give 128
programs reading 32 KB of W_UV each (before the PDL wait), at the price of each re-merging the head's partials
(splits x 2 KB, from L2). Workspace: uniform N * max_splits slots as before (allocated also at max_splits 1);
ragged one partial item per split program. 5 launches of a decode layer's attention become 3 with
`mla_prep.mla_norm_store_absorb` (W_UK).

PDL (`tokenspeed.ops.triton.pdl`): W_UV (kv_b_proj's weight: no kernel writes it) is loaded before `gdc_wait`; the
partials and log-sum-exps (the split kernel just before), kv_lens and cu_seqlens after it.

Split from `tokenspeed.ops.triton.mla_decode` (which launches it and re-exports its names): the combine reads the
split kernel's plan (`_plan_balanced`, `_plan_ragged`, `_uniform_chunk` of `tokenspeed.ops.triton.mla_split_plan`,
which both modules import; this one does not import `mla_decode`) to find the partials.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2
from tokenspeed.ops.triton.mla_combine import UV_MERGE_UNROLL, _merge_rows, merge_unroll
from tokenspeed.ops.triton.mla_split_plan import _plan_balanced, _plan_ragged, _uniform_chunk


@triton.jit
def _uv_rows(toks, h, T, CU, KV_LENS, N, MAX_SPLITS, min_chunk, max_q, H: tl.constexpr, QN: tl.constexpr,
             BLOCK_H: tl.constexpr, BLOCK_SEQ: tl.constexpr, BLOCK_N: tl.constexpr, BALANCED: tl.constexpr,
             RAGGED: tl.constexpr):
    """Where the partials of head h of tokens `toks` [BLOCK_T] lie: (first partial row, row step between splits,
    number of splits, token valid), each [BLOCK_T]; split s of token t is partial row base + s * step (rows of
    PART [rows, DV] and LSE [rows]). Ragged: the ALL_PARTIAL item numbering of `_ragged_item`; uniform: slot
    (start_n + s) of `_mla_split_kernel`, row j * H + h."""
    if RAGGED:
        idx, first, q_len, _, blocks, splits, _, part_starts, _, _ = _plan_ragged(
            CU, KV_LENS, N, max_q, N * MAX_SPLITS, min_chunk, H, BLOCK_H, BLOCK_SEQ, BLOCK_N, True)
        ends = tl.load(CU + idx + 1, mask=idx < N, other=0).to(tl.int64)
        n = tl.sum(((ends[None, :] <= toks[:, None]) & (idx[None, :] < N)).to(tl.int64), axis=1)
        sel = idx[None, :] == n[:, None]  # no lane for a token past cu[N]: every pick is 0
        j = toks - tl.sum(tl.where(sel, first[None, :], 0), axis=1)
        ok = (toks < T) & (n < N) & (j >= 0) & (j < tl.sum(tl.where(sel, q_len[None, :], 0), axis=1))
        r = j * H + h
        hb = r // BLOCK_H
        base = (tl.sum(tl.where(sel, part_starts[None, :], 0), axis=1) + hb) * BLOCK_H + (r - hb * BLOCK_H)
        step = tl.sum(tl.where(sel, blocks[None, :], 0), axis=1) * BLOCK_H
        count = tl.sum(tl.where(sel, splits[None, :], 0), axis=1)
    else:
        n = toks // QN
        ok = toks < T
        if BALANCED:
            idx, _, counts, starts, _ = _plan_balanced(KV_LENS, N, N * MAX_SPLITS, min_chunk, BLOCK_SEQ, BLOCK_N)
            sel = idx[None, :] == n[:, None]
            count = tl.sum(tl.where(sel, counts[None, :], 0), axis=1)
            start = tl.sum(tl.where(sel, starts[None, :], 0), axis=1)
        else:
            kv_len = tl.maximum(tl.load(KV_LENS + n, mask=ok, other=0).to(tl.int64), 0)
            chunk = _uniform_chunk(kv_len, MAX_SPLITS, BLOCK_N)
            count = (kv_len + chunk - 1) // chunk
            start = n * MAX_SPLITS
        base = start * (QN * H) + (toks - n * QN) * H + h
        step = tl.zeros_like(base) + QN * H
    return base, step, tl.where(ok, count, 0), ok


@triton.jit(do_not_specialize=["T", "N", "MAX_SPLITS", "min_chunk", "max_q"])
def _mla_combine_uv_kernel(
    KV_LENS, CU, O, PART, LSE, WUV, stride_wh, stride_wv,
    T, N, MAX_SPLITS, min_chunk, max_q,
    H: tl.constexpr,
    QN: tl.constexpr,
    DV: tl.constexpr,
    VH: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BALANCED: tl.constexpr,
    RAGGED: tl.constexpr,
    PDL: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Program (vb, h, tb): merges head h's split partials of BLOCK_T tokens over the whole latent row ([BLOCK_T,
    BLOCK_DV] fp32, weights exp2(lse - max) as in `_mla_combine_kernel`), rounds the latent output to O's dtype
    (where the unfused path rounds it), and writes o[t, h, vb * BLOCK_V ...] = o_lat @ W_UV[h, vb block]^T (tl.dot,
    fp32 accumulation, one rounding). Tokens without a live split get zeros."""
    LAT = O.dtype.element_ty
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    tb = tl.program_id(2)
    vi = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    w = tl.load(WUV + h.to(tl.int64) * stride_wh + vi[:, None] * stride_wv + dv[None, :],
                mask=(vi < VH)[:, None] & dv_ok[None, :], other=0.0).to(LAT)  # kv_b_proj's weight: before the wait
    if PDL:  # the partials come from the split kernel just before
        gdc_wait()
        gdc_launch_dependents()
    toks = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    base, step, count, ok = _uv_rows(toks, h, T, CU, KV_LENS, N, MAX_SPLITS, min_chunk, max_q, H, QN, BLOCK_H,
                                     BLOCK_SEQ, BLOCK_N, BALANCED, RAGGED)
    acc, wsum = _merge_rows(PART, LSE, base, step, count, tl.max(count, axis=0), dv, dv_ok, DV, UNROLL)
    o_lat = (acc / tl.where(wsum > 0, wsum, 1.0)[:, None]).to(LAT)
    if LAT == tl.float32:
        o = tl.dot(o_lat, tl.trans(w), input_precision="ieee")
    else:
        o = tl.dot(o_lat, tl.trans(w))
    tl.store(O + (toks[:, None] * H + h) * VH + vi[None, :], o.to(LAT), mask=ok[:, None] & (vi < VH)[None, :])


# The W_UV combine's tiles: UV_BLOCK_T tokens (tl.dot's 16 rows; a decode step of N <= 16 sequences is one tile) x
# UV_BLOCK_V output columns of one head. Each program re-merges its head's partials over the whole latent row
# (splits x 2 KB at r 512, from L2: they were just written) and streams UV_BLOCK_V x r of W_UV; at H 32 and
# v_head 128, 32 columns make 4 x 32 = 128 programs (one wave of 132 SMs) reading 32 KB of W_UV each, where one
# program per head would stream 128 KB of it alone (and leave 100 SMs idle at batch 1).
UV_BLOCK_T = 16
UV_BLOCK_V = 32


def _check_uv(w_uv: Tensor | None, H: int, v_dim: int) -> int:
    """Validates W_UV [H, v_head, v_dim] (unit last stride); returns the output width (v_head, or v_dim)."""
    if w_uv is None:
        return v_dim
    if w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != v_dim or w_uv.stride(-1) != 1 or \
            not w_uv.is_floating_point():
        raise ValueError(f"w_uv must be a float [{H}, v_head, {v_dim}] view with unit last stride; got "
                         f"{tuple(w_uv.shape)}")
    return w_uv.shape[1]


def _combine_uv(w_uv: Tensor, kv_lens: Tensor, cu: Tensor, out: Tensor, part: Tensor, lse: Tensor, T: int, N: int,
                ms: int, min_chunk: int, max_q: int, QN: int, v_dim: int, bh: int, block_seq: int, block_n: int,
                balanced: bool, ragged: bool) -> None:
    """Launches `_mla_combine_uv_kernel` over the T tokens of out [.., H, v_head] (every split wrote partials)."""
    H, vh = w_uv.shape[:2]
    block_v = max(16, min(UV_BLOCK_V, next_pow2(vh)))
    _mla_combine_uv_kernel[(triton.cdiv(vh, block_v), H, triton.cdiv(T, UV_BLOCK_T))](
        kv_lens, cu, out, part, lse, w_uv, w_uv.stride(0), w_uv.stride(1),
        T, N, ms, min_chunk, max_q,
        H=H, QN=QN, DV=v_dim, VH=vh, BLOCK_DV=max(16, next_pow2(v_dim)), BLOCK_V=block_v, BLOCK_T=UV_BLOCK_T,
        BLOCK_H=bh, BLOCK_SEQ=block_seq, BLOCK_N=block_n, BALANCED=balanced, RAGGED=ragged,
        UNROLL=merge_unroll(1 if ragged else UV_MERGE_UNROLL),
        num_warps=8, **pdl.kernel_kwargs(out.device, "mla"),
    )
