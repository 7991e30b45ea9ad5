"""The device-side split plan of `mla_decode` (the work each split program serves), shared by its kernels.

`tokenspeed.ops.triton.mla_decode`'s split kernel, `tokenspeed.ops.triton.mla_combine`'s combine and
`tokenspeed.ops.triton.mla_combine_uv`'s W_UV combine recompute the same plan in every program from device values
only (kv_lens, cu_seqlens: no host synchronisation), so a split kernel's partials are found again by whichever combine follows it:

* `_plan_balanced`: the balanced uniform-batch plan (chunk, splits per sequence, their slot starts);
* `_uniform_chunk`: the uniform plan's split length of one sequence (balanced=False);
* `_plan_ragged`: the ragged plan (row blocks, splits, item / partial-item / combine-block starts, chunk);
* `_ragged_item`: the ragged work item of one split program under that plan;
* `_pick`: one lane of a per-sequence vector as a scalar;
* `_warp_uniform`: a plan scalar re-read from lane 0 of its warp (so ptxas sees it as warp-uniform).

The plans' contracts (budgets, bounds) are `mla_decode`'s module docstring; its host mirrors (`plan_splits`,
`plan_ragged`, `ragged_grid`) and the policy constants they read (MIN_CHUNK, DEFAULT_WAVES) stay in `mla_decode`,
where callers and tests look them up. Only @triton.jit helpers live here (no launches, no host state).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plan_balanced(KV_LENS, N, G, min_chunk, BLOCK_SEQ: tl.constexpr, BLOCK_N: tl.constexpr):
    """(idx, lens, counts, starts, chunk) of the balanced split plan, as [BLOCK_SEQ] vectors + the chunk."""
    idx = tl.arange(0, BLOCK_SEQ)
    lens = tl.load(KV_LENS + idx, mask=idx < N, other=0).to(tl.int64)
    lens = tl.maximum(lens, 0)
    total = tl.sum(lens, axis=0)
    denom = tl.maximum(G - N, 1)
    chunk = tl.maximum((total + denom - 1) // denom, min_chunk)
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    counts = (lens + chunk - 1) // chunk
    starts = tl.cumsum(counts, axis=0) - counts
    return idx, lens, counts, starts, chunk


@triton.jit
def _pick(idx, vec, n):
    """vec[n] as a scalar (vec a [BLOCK_SEQ] vector)."""
    return tl.sum(tl.where(idx == n, vec, 0), axis=0)


@triton.jit
def _warp_uniform(x, ON: tl.constexpr):
    """x, an integer scalar every thread holds the same value of (a plan value: reductions leave it replicated);
    ON: read from lane 0 of the warp as int32 (the plans' positions, rows and slots fit; `shfl.sync.idx`, sm_90
    inline PTX: compiled code only, not the interpreter), else x unchanged. Values out of reductions are not
    provably uniform to ptxas, which then keeps the flash loop's bounds and addresses in vector registers; through
    the shuffle they stay in uniform ones (the keys-major split kernel's loop: 0 spill reloads instead of 33,
    `benchmarks/mla_compile_sm90.py [--uniform-plan]`)."""
    if ON:
        return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r", [x.to(tl.int32)],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return x


@triton.jit
def _uniform_chunk(kv_len, MAX_SPLITS, BLOCK_N: tl.constexpr):
    c = (tl.maximum(kv_len, 1) + MAX_SPLITS - 1) // MAX_SPLITS
    return (c + BLOCK_N - 1) // BLOCK_N * BLOCK_N


@triton.jit
def _plan_ragged(CU, KV_LENS, N, max_q, budget, min_chunk, H: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_SEQ: tl.constexpr, BLOCK_N: tl.constexpr, ALL_PARTIAL: tl.constexpr = False):
    """The ragged plan (module docstring) as [BLOCK_SEQ] vectors, one lane per sequence (lanes >= N hold zeros):
    (idx, first token, q_len, kv_len, row blocks, splits, item starts, partial-item starts, combine-block starts)
    and the scalar chunk. ALL_PARTIAL (the W_UV-fused combine): every item, single splits too, has a partial item
    (then partial-item starts == item starts)."""
    idx = tl.arange(0, BLOCK_SEQ)
    ok = idx < N
    first = tl.load(CU + idx, mask=ok, other=0).to(tl.int64)
    q_len = tl.load(CU + idx + 1, mask=ok, other=0).to(tl.int64) - first
    # Clamped to the grid's bucket of max_q: a sequence longer than it breaks the contract (its rows come out wrong
    # or unwritten) but every program and workspace index stays in bounds.
    q_len = tl.minimum(tl.maximum(q_len, 0), max_q)
    kv = tl.maximum(tl.load(KV_LENS + idx, mask=ok, other=0).to(tl.int64), 0)
    blocks = (q_len * H + BLOCK_H - 1) // BLOCK_H
    work = tl.sum(blocks * kv, axis=0)
    chunk = tl.maximum((work + budget - 1) // budget, min_chunk)
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    # A sequence with rows but no keys (padding) keeps one split: its programs write its zeros.
    splits = tl.where(blocks > 0, tl.maximum((kv + chunk - 1) // chunk, 1), 0)
    items = blocks * splits
    starts = tl.cumsum(items, axis=0) - items
    if ALL_PARTIAL:
        split_items = items
    else:
        split_items = tl.where(splits > 1, items, 0)
    part_starts = tl.cumsum(split_items, axis=0) - split_items
    split_blocks = tl.where(splits > 1, blocks, 0)
    comb_starts = tl.cumsum(split_blocks, axis=0) - split_blocks
    return idx, first, q_len, kv, blocks, splits, starts, part_starts, comb_starts, chunk


@triton.jit
def _ragged_item(CU, KV_LENS, N, MAX_SPLITS, min_chunk, max_q, H: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_SEQ: tl.constexpr, BLOCK_N: tl.constexpr, ALL_PARTIAL: tl.constexpr = False,
                 UNIFORM: tl.constexpr = False):
    """The work item of split program p = program_id(0) under the ragged plan: (sequence n, its number of splits
    (0: p is past the last item), rows [BLOCK_H] (sequence-local r = j * H + h), row_ok, first token, key range
    lo..hi, causal limit per row, and the row base of its stores). Row r goes to output row base + r (first * H +
    r) when the sequence has one split, else to partial row base + r (item * BLOCK_H + r - hb * BLOCK_H): one int32
    scalar live across the flash loop, not two (T * H and the workspace's rows fit in int32). The per-sequence
    values are picked inline, not through `_pick`: each helper call costs the interpreter milliseconds, and every
    program of the grid runs this. UNIFORM: the scalars through `_warp_uniform`."""
    p = tl.program_id(0).to(tl.int64)
    idx, first, q_len, kv, blocks, splits, starts, part_starts, _, chunk = _plan_ragged(
        CU, KV_LENS, N, max_q, N * MAX_SPLITS, min_chunk, H, BLOCK_H, BLOCK_SEQ, BLOCK_N, ALL_PARTIAL)
    n = tl.sum(((starts + blocks * splits <= p) & (idx < N)).to(tl.int64), axis=0)  # the sequence p falls in
    sel = idx == n  # no lane when p is past the last item (n == N): every pick is then 0
    count = tl.sum(tl.where(sel, splits, 0), axis=0)
    nb = tl.maximum(tl.sum(tl.where(sel, blocks, 0), axis=0), 1)
    local = p - tl.sum(tl.where(sel, starts, 0), axis=0)
    s = local // nb  # split-major: the row blocks of one key range run side by side (it is read once from DRAM)
    hb = local - s * nb
    ql = tl.sum(tl.where(sel, q_len, 0), axis=0)
    kv_len = tl.sum(tl.where(sel, kv, 0), axis=0)
    # int32 rows and limits (a sequence's positions and rows fit): fewer registers live across the flash loop
    rows = (hb * BLOCK_H).to(tl.int32) + tl.arange(0, BLOCK_H)
    lim = (kv_len - ql).to(tl.int32) + rows // H
    last_lim = kv_len - ql + (tl.minimum(hb * BLOCK_H + BLOCK_H, ql * H) - 1) // H
    lo = s * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, kv_len), last_lim + 1)  # no key past the block's last causal limit
    tok0 = tl.sum(tl.where(sel, first, 0), axis=0)
    base = tl.where((count == 1) & (not ALL_PARTIAL), tok0 * H,
                    (tl.sum(tl.where(sel, part_starts, 0), axis=0) + local - hb) * BLOCK_H)
    return (_warp_uniform(n, UNIFORM).to(tl.int64), _warp_uniform(count, UNIFORM).to(tl.int64), rows,
            rows < ql * H, _warp_uniform(tok0, UNIFORM).to(tl.int64), _warp_uniform(lo.to(tl.int32), UNIFORM),
            _warp_uniform(hi.to(tl.int32), UNIFORM), lim, _warp_uniform(base.to(tl.int32), UNIFORM))
