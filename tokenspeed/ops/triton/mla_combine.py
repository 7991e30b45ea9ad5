"""`mla_decode`'s plain combine: each sequence's (or ragged row block's) splits, when it has more than one,
merged into its output rows with weights exp2(lse_i - max) (the contract is `tokenspeed.ops.triton.mla_decode`'s
module docstring).

`_mla_combine_kernel` serves the uniform plan (grid cdiv(v_dim, BLOCK_VC) x Q*H x N: a program per value-column
block, query row and sequence) and the ragged one (`_merge_splits` per row tile: a program per column block and
combine row block). The uniform tiles (`combine_tiles`) hold all of a sequence's split slots at once, so the LSE
maximum and the weighted sum each take one dependent round trip to L2. The W_UV combine is
`tokenspeed.ops.triton.mla_combine_uv`. Both recompute the split plan from device values (`mla_split_plan`) to
find the partials; this module does not import `mla_decode`, which launches the kernel and re-exports its names.

PDL (`tokenspeed.ops.triton.pdl`): the partials come from the split kernel just before, so every program waits
first thing, on every path.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton._utils import next_pow2
from tokenspeed.ops.triton.mla_split_plan import _pick, _plan_balanced, _plan_ragged, _uniform_chunk


# Split slots whose loads the merge loops issue together (`_merge_rows`): one dependent L2 round trip per UNROLL
# slots instead of one per slot (the adds stay in slot order, so the result is the same bits). The ragged combine
# takes MERGE_UNROLL; the W_UV combine (`mla_combine_uv`) UV_MERGE_UNROLL on the uniform plan, where its [16, 512]
# fp32 tiles of 2 slots fit its registers (sm_90: 249-255 a thread, no spill, one program an SM as with 1 slot),
# and 1 on the ragged plan (which spills at 1 already). TOKENSPEED_MLA_MERGE_UNROLL overrides both at each call
# (1: the former loops, for A/B runs). Checked offline (`benchmarks/mla_compile_sm90.py`), not yet timed on the GPU.
MERGE_UNROLL = 4
UV_MERGE_UNROLL = 2
MERGE_UNROLL_ENV = "TOKENSPEED_MLA_MERGE_UNROLL"


def merge_unroll(default: int = MERGE_UNROLL) -> int:
    """The merge loops' UNROLL for the next launch: `default`, or MERGE_UNROLL_ENV's value (1, 2, 4 or 8)."""
    v = os.environ.get(MERGE_UNROLL_ENV, "").strip()
    if not v:
        return default
    if v not in ("1", "2", "4", "8"):
        raise ValueError(f"{MERGE_UNROLL_ENV} must be 1, 2, 4 or 8; got {v!r}")
    return int(v)


@triton.jit
def _merge_rows(PART, LSE, prow, rstep, count, max_count, dv, dv_ok, DV: tl.constexpr, UNROLL: tl.constexpr):
    """The weighted merge of R rows' split partials: row i's split s (s < count[i]) is partial row prow[i] +
    s * rstep[i] (rstep a [R] vector, or one scalar for every row) of PART [rows, DV] fp32 and LSE [rows] (log2
    sum-exps); returns (acc [R, len(dv)] = sum over s of PART * exp2(lse - max) in slot order, wsum [R] = the sum of
    those weights; max over a row's splits, 0 for a row without any). max_count >= every count[i]. The loads of
    UNROLL slots are issued before their adds."""
    m = tl.full(prow.shape, float("-inf"), dtype=tl.float32)
    for s0 in range(0, max_count, UNROLL):
        for u in tl.static_range(UNROLL):
            s = s0 + u
            m = tl.maximum(m, tl.load(LSE + prow + s * rstep, mask=s < count, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([prow.shape[0], dv.shape[0]], dtype=tl.float32)
    wsum = tl.zeros(prow.shape, dtype=tl.float32)
    for s0 in range(0, max_count, UNROLL):
        for u in tl.static_range(UNROLL):
            s = s0 + u
            row = prow + s * rstep
            wt = tl.exp2(tl.load(LSE + row, mask=s < count, other=float("-inf")) - m)
            acc += tl.load(PART + row[:, None] * DV + dv[None, :], mask=(s < count)[:, None] & dv_ok[None, :],
                           other=0.0) * wt[:, None]
            wsum += wt
    return acc, wsum


@triton.jit
def _merge_splits(O, PART, LSE, o_rows, row_ok, first, step, count, dv, dv_ok, DV: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_VC: tl.constexpr, UNROLL: tl.constexpr):
    """Ragged combine of one row tile: rows o_rows of O (a [BLOCK_H, BLOCK_VC] column tile) from the `count`
    partial items first + s * step (each BLOCK_H rows of PART / LSE), weighted exp2(lse - max)."""
    ri = tl.arange(0, BLOCK_H)
    acc, wsum = _merge_rows(PART, LSE, first * BLOCK_H + ri, step * BLOCK_H, tl.where(row_ok, count, 0), count, dv,
                            dv_ok, DV, UNROLL)
    out = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
    tl.store(O + o_rows[:, None] * DV + dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit(do_not_specialize=["N", "MAX_SPLITS", "min_chunk", "max_q"])
def _mla_combine_kernel(
    KV_LENS, O, PART, LSE,
    N, MAX_SPLITS, min_chunk,
    CU, max_q,
    QH: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_VC: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BALANCED: tl.constexpr,
    PDL: tl.constexpr,
    RAGGED: tl.constexpr = False,
    H: tl.constexpr = 1,
    BLOCK_H: tl.constexpr = 16,
    UNROLL: tl.constexpr = MERGE_UNROLL,
):
    if PDL:  # the partials come from the split kernel just before: wait first, on every path
        gdc_wait()
        gdc_launch_dependents()
    pid_v = tl.program_id(0)
    if RAGGED:  # program (pid_v, c): the c-th row block among the sequences with more than one split
        c = tl.program_id(1).to(tl.int64)
        idx, first, q_len, _, blocks, splits, _, part_starts, comb_starts, _ = _plan_ragged(
            CU, KV_LENS, N, max_q, N * MAX_SPLITS, min_chunk, H, BLOCK_H, BLOCK_SEQ, BLOCK_N)
        split_blocks = tl.where(splits > 1, blocks, 0)
        sel = idx == tl.sum(((comb_starts + split_blocks <= c) & (idx < N)).to(tl.int64), axis=0)
        count = tl.sum(tl.where(sel, splits, 0), axis=0)  # 0 past the last block (no lane selected)
        if count <= 1:
            return
        hb = c - tl.sum(tl.where(sel, comb_starts, 0), axis=0)
        rows = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        dv = pid_v * BLOCK_VC + tl.arange(0, BLOCK_VC)
        _merge_splits(O, PART, LSE, tl.sum(tl.where(sel, first, 0), axis=0) * H + rows,
                      rows < tl.sum(tl.where(sel, q_len, 0), axis=0) * H,
                      tl.sum(tl.where(sel, part_starts, 0), axis=0) + hb, tl.sum(tl.where(sel, blocks, 0), axis=0),
                      count, dv, dv < DV, DV, BLOCK_H, BLOCK_VC, UNROLL)
    else:
        r = tl.program_id(1)
        n = tl.program_id(2).to(tl.int64)
        if BALANCED:
            idx, _, counts, starts, _ = _plan_balanced(KV_LENS, N, N * MAX_SPLITS, min_chunk, BLOCK_SEQ, BLOCK_N)
            count = _pick(idx, counts, n)
            start = _pick(idx, starts, n)
        else:
            kv_len = tl.maximum(tl.load(KV_LENS + n).to(tl.int64), 0)
            chunk = _uniform_chunk(kv_len, MAX_SPLITS, BLOCK_N)
            count = (kv_len + chunk - 1) // chunk
            start = n * MAX_SPLITS
        if count <= 1:  # written by the split kernel (one split) or a padding row (zeroed there)
            return

        si = tl.arange(0, BLOCK_S)
        m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
        for c0 in range(0, count, BLOCK_S):
            ok = c0 + si < count
            m = tl.maximum(m, tl.load(LSE + (start + c0 + si) * QH + r, mask=ok, other=float("-inf")))
        mx = tl.max(m, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)

        dv = pid_v * BLOCK_VC + tl.arange(0, BLOCK_VC)
        dv_ok = dv < DV
        acc = tl.zeros([BLOCK_VC], dtype=tl.float32)
        wsum = tl.zeros([BLOCK_S], dtype=tl.float32)
        for c0 in range(0, count, BLOCK_S):
            ok = c0 + si < count
            slot = start + c0 + si
            w = tl.exp2(tl.load(LSE + slot * QH + r, mask=ok, other=float("-inf")) - mx)
            part = tl.load(PART + (slot[:, None] * QH + r) * DV + dv[None, :], mask=ok[:, None] & dv_ok[None, :],
                           other=0.0)
            wsum += w
            acc += tl.sum(part * w[:, None], axis=0)
        tot = tl.sum(wsum, axis=0)
        out = acc / tl.where(tot > 0, tot, 1.0)
        tl.store(O + (n * QH + r) * DV + dv, out.to(O.dtype.element_ty), mask=dv_ok)


# Split slots the uniform combine reads in one tile at most (all of a sequence's at one wave of 132 programs and
# one sequence), and the fp32 elements of its [BLOCK_S, BLOCK_VC] partial tile.
# TOKENSPEED_MLA_COMBINE_MAX_S overrides the first at each call (16: the former tiling, for A/B runs).
COMBINE_MAX_BLOCK_S = 256
COMBINE_TILE_ELEMS = 4096
COMBINE_ENV = "TOKENSPEED_MLA_COMBINE_MAX_S"


def combine_tiles(max_splits: int, v_dim: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_VC) of the uniform combine for max_splits split slots a sequence: every slot in one tile
    (BLOCK_S = next_pow2(max_splits), 16 to COMBINE_MAX_BLOCK_S), so the LSE max and the weighted sum each take one
    dependent round trip to L2 instead of one a 16-slot block (batch 1 at one wave: 8 + 8 at 128 splits), with
    BLOCK_VC narrowed to keep the tile at COMBINE_TILE_ELEMS (16 to 128 columns; more programs, each with less).
    Up to 16 slots (from 9 sequences at one wave) this is the former fixed 16 x 128 tiling."""
    cap = os.environ.get(COMBINE_ENV, "").strip()
    if cap and (not cap.isdigit() or int(cap) < 16 or int(cap) & (int(cap) - 1)):
        raise ValueError(f"{COMBINE_ENV} must be a power of two >= 16; got {cap!r}")
    block_s = max(16, min(next_pow2(max_splits), int(cap) if cap else COMBINE_MAX_BLOCK_S))
    block_vc = max(16, min(next_pow2(v_dim), 128, COMBINE_TILE_ELEMS // block_s))
    return block_s, block_vc
