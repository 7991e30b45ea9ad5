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


@triton.jit
def _merge_splits(O, PART, LSE, o_rows, row_ok, first, step, count, dv, dv_ok, DV: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_VC: tl.constexpr):
    """Ragged combine of one row tile: rows o_rows of O (a [BLOCK_H, BLOCK_VC] column tile) from the `count`
    partial items first + s * step (each BLOCK_H rows of PART / LSE), weighted exp2(lse - max)."""
    ri = tl.arange(0, BLOCK_H)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in range(count):
        m = tl.maximum(m, tl.load(LSE + (first + s * step) * BLOCK_H + ri, mask=row_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_H, BLOCK_VC], dtype=tl.float32)
    wsum = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(count):
        prow = (first + s * step) * BLOCK_H + ri
        w = tl.exp2(tl.load(LSE + prow, mask=row_ok, other=float("-inf")) - m)
        part = tl.load(PART + prow[:, None] * DV + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        acc += part * w[:, None]
        wsum += w
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
                      count, dv, dv < DV, DV, BLOCK_H, BLOCK_VC)
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
