"""Absorbed-MLA decode / k-token verify over the paged latent cache, split-KV, balanced per request.

The function of `tokenspeed.ops.reference.mla.mla_attention_paged` (and `_paged_decode`) for the batch shape
of decode and verify: N sequences with the same number Q of new tokens (1 for decode, up to ~8 for verify):

    q          [N, Q, H, Dl]   absorbed queries [W_UK^T q_nope ; q_pe] (fp32 / bf16), unit last stride; or, with
                               `q_rope`, q [N, Q, H, v_dim] = W_UK^T q_nope and q_rope [N, Q, H, Dl - v_dim] = q_pe,
                               two strided views (no concatenated copy: the kernel reads the two parts anyway)
    cache      [P, page_size, Dl]  latent rows [c_kv (v_dim) ; k_pe]; bf16 / fp32 / fp8 e4m3 (stored / kv_scale)
    page_table [N, W] int32    a sequence's row i is page_table[n, i // page_size] * page_size + i % page_size
    kv_lens    [N] int (device) context length after this step (the new rows already stored); <= 0: padding
    out        [N, Q, H, v_dim] in q.dtype

Keys are the full latent rows (Dl = v_dim + rope, 576 = 512 + 64 in the real models), values their first v_dim
columns; query j of sequence n sits at position kv_lens[n] - Q + j and sees keys 0..that position (causal,
bottom-right aligned). A padding sequence (kv_len <= 0) gets zeros and nothing of it is read.

Schedule. The Q*H query rows of a sequence share every key, so they are processed together as the rows of one
tile (row r = j * H + h, each with its own causal limit), BLOCK_H rows per program. Grid (HB, max_splits, N)
with HB = cdiv(Q*H, BLOCK_H): G = N * max_splits split slots. The number of splits of each sequence and the
split length are computed on the device from kv_lens by every program (no host synchronisation; the grid
depends only on shapes and max_splits, so the launch is CUDA-graph capturable):

* balanced (default): chunk = max(cdiv(sum(kv_lens), max(G - N, 1)), min_chunk) rounded up to BLOCK_N, and
  splits_n = cdiv(kv_len_n, chunk); so every split in the batch covers about `chunk` rows whatever the mix of
  history lengths (a 64K history gets many splits, a 1K one a single one). The slots are a flat work list:
  slot p = n_slot * max_splits + s serves the split p - start_m of the sequence m with
  start_m <= p < start_m + splits_m (start = exclusive prefix sum of splits, recomputed in-kernel), so a long
  sequence may take more than max_splits splits; sum(splits) <= G always holds, slots past it exit at once.
* uniform (balanced=False): sequence n uses slots n * max_splits + s, splits of cdiv(kv_len_n, max_splits)
  rows rounded up to BLOCK_N (slots past the last non-empty split exit at once).

Each program runs a flash-attention loop over its split: the KV tile [BLOCK_N, Dl] is gathered through the page
table (int64 row offsets) and loaded once as a [BLOCK_N, BLOCK_DV] latent part and a [BLOCK_N, BLOCK_DR] rope
part (BLOCK_DV = next_pow2(v_dim), BLOCK_DR = next_pow2(Dl - v_dim), at least 16 for tl.dot, masked when
padded, so Dl = 576 costs 512 + 64 and not 1024 columns); S = q_v k_v^T + q_r k_r^T, and the PV product
reuses the latent part. Scores and the softmax statistics are fp32 (exp2 with the scale folded in); the dots
run in bf16 with fp32 accumulation for bf16 / fp8 caches (q cast to bf16), in fp32 (IEEE) for fp32 caches. An
fp8 tile is converted to bf16 (exact) and kv_scale is applied to the scores and to the output.

A sequence with a single split writes its output directly (no partials); otherwise each split writes its
normalised partial output [v_dim] fp32 and log-sum-exp (log2) per row into a workspace [G, Q*H, ...] and a
combine kernel merges the splits of every sequence with more than one (the weights exp2(lse_i - max)). Padding
rows are zeroed by the split kernel's programs (hb, 0, n) of that sequence. With max_splits == 1 there is no
combine launch. BLOCK_H 32 when Q*H is a multiple of 32, else 16. Two orientations of the flash loop
(`KEYS_MAJOR`, docs/kernels.md has the H200 numbers): keys-major (the default for a bf16 cache: scores [BLOCK_N,
BLOCK_H] and the output [v_dim, BLOCK_H], so the key tile and v_dim are the wgmma M; BLOCK_N 64, 4 warps, 2
stages; the page of each key tile read one tile ahead so the pipeliner double-buffers the tiles) and rows-major
(fp8 / fp32 caches: [BLOCK_H, BLOCK_N] scores, BLOCK_N 32, 8 warps at BLOCK_H 32 else 4, 2 stages). A key tile
that fits a page (PAGE % BLOCK_N == 0; splits start at multiples of BLOCK_N) is addressed from one page-table
entry with compile-time row offsets (`mla_flash._kv_tile`'s ROW). benchmarks/mla_compile_sm90.py compiles every variant
for sm_90 offline.

On Hopper, uniform batches over a bf16 or fp8 cache with 512 + 64 columns and the balanced plan take a Gluon split
kernel instead (`tokenspeed.ops.triton.mla_gluon`: explicit cp.async double buffering, wgmma keys-major, 16-,
32- or 64-row tiles; pages a multiple of 64 unless `mla_gluon.SMALL_PAGES`; fp8 caches with
`mla_gluon.FP8_CACHE`). It writes this split kernel's outputs (bit for bit over a bf16 cache), so the combines
below are shared; num_warps / num_stages do not apply to it, and its row tile (`mla_gluon.default_block_h`) can
be wider, which feeds `default_max_splits`. `TOKENSPEED_MLA_GLUON=0` or `mla_gluon.ENABLED = False` keeps every
call on this module's kernel.

Split policy (the two knobs; module constants read at call time, keyword arguments per call): max_splits
defaults to `default_max_splits` (a grid of DEFAULT_WAVES x 132 programs) and min_chunk to MIN_CHUNK. Every split
of more than one writes Q*H*v_dim*4 bytes of partials that the combine reads back (64 KB per split at Q*H = 32,
v_dim = 512), against chunk * Dl * 2 bytes of bf16 cache it reads: at batch 1 / 4K the default plan is 64 splits
of 64 rows (4 MB of partials for a 4.7 MB cache). benchmarks/mla_decode_h200.py --policies times the choices.

PDL (`tokenspeed.ops.triton.pdl`): both kernels wait first (`gdc_wait`) and then release their dependents. Nothing
is read before the wait: the split kernel's first reads are kv_lens and the page table (host-to-device copies
of this step), the queries (the previous kernel's output) and the cache (its new rows stored just before); the
combine reads the split kernel's partials. So the overlap is only the launch and the wait itself.

Ragged batches (`cu_seqlens_q` given): any mix of query lengths, e.g. 15 decodes beside a 16..1000-token tail on
a long history, in one launch (plus the combine), with the same split and combine kernels (RAGGED constexpr; the
flash loop and the output store are shared @triton.jit helpers, so the uniform path compiles as before):

    q            [T, H, Dl] flat (or q [T, H, v_dim] + q_rope [T, H, Dl - v_dim]), any token / head strides
    cu_seqlens_q [N+1] int32 / int64 (device): sequence n's tokens are cu[n]..cu[n+1]-1
    max_q        host int >= every q_len_n (not a constexpr: it only bounds the grid)
    out          [T, H, v_dim] in q.dtype; rows of padding sequences (kv_len <= 0) are zeros, of tokens past
                 cu[N] unwritten

Sequence n's rows are r = j * H + h (j < q_len_n, token cu[n] + j, causal limit kv_len_n - q_len_n + j), in
row blocks of BLOCK_H; blocks_n = cdiv(q_len_n * H, BLOCK_H) (0 when q_len_n = 0: nothing of it is touched).
Plan, computed by every program from cu_seqlens and kv_lens (device values only: no host synchronisation):
with the budget B = N * max_splits (default: DEFAULT_WAVES x the SM count) and the work W = sum_n blocks_n *
kv_len_n, chunk = max(cdiv(W, B), min_chunk) rounded up to BLOCK_N, splits_n = max(cdiv(kv_len_n, chunk), 1).
A work item is (sequence, split s, row block hb) and covers keys s*chunk .. (s+1)*chunk - 1 (also cut at the
block's last causal limit); items are numbered sequence by sequence, split-major within one (the row blocks
of one key range run side by side and share it in L2). So a long tail, whose row blocks already fill the
machine, keeps one split (W / B exceeds its history) while a decode beside a short tail gets several, and a
64K decode among 1K ones gets more than the short ones: splitting follows the work, not the query length.

Bounds (what keeps the grid static and the workspace small): let RB = min(N * cdiv(bucket(max_q) * H,
BLOCK_H), cdiv(T * H, BLOCK_H) + N - 1) >= sum_n blocks_n, bucket(max_q) = max(16, next_pow2(max_q)) (q lengths
are clamped to it). The items number sum_n blocks_n * splits_n < W / chunk + sum_n blocks_n <= B + RB: the split
grid is 1-D of B + RB programs (those past the last item exit at once, after the PDL wait). A sequence with more
than one split has kv_len > chunk >= W / B, so the row blocks of split sequences total < B, and their items
(the only ones that write partials) < 2 B and < B + RB. The workspace holds min(2 B, B + RB) items of BLOCK_H
rows x v_dim fp32 (+ LSE): 2 x 264 x 32 x 512 x 4 = 35 MB at the defaults on an H200 (H 32, v_dim 512; N <= 64:
B <= 320, 42 MB), whatever max_q; the combine grid is (v_dim / 128, min(B, RB)) programs, one per row block of a
split sequence, merging its splits over a [BLOCK_H, 128] tile. max_splits == 1: no splits, RB programs, no
combine launch, no workspace. The grid depends only on (T, N, bucket(max_q), max_splits), so a CUDA graph
captured for one bucket replays any batch of that shape. `plan_ragged` / `ragged_grid` mirror it on the host.

W_UV fused into the combine (`w_uv` [H, v_head, v_dim], kv_b_proj's W_UV view): the output is o[t, h] =
W_UV[h] o_lat[t, h] ([.., H, v_head] in q's dtype); every split item then writes partials and
`tokenspeed.ops.triton.mla_combine_uv` merges them and multiplies (its docstring has the contract).

Modules: the device-side plan helpers every program runs (`_plan_balanced`, `_uniform_chunk`, `_plan_ragged`,
`_ragged_item`) are `tokenspeed.ops.triton.mla_split_plan`, shared with the W_UV combine; the split program's
flash loop and row store (`_kv_tile`, `_flash_step`, `_flash_step_t`, `_flash_rows`, `_store_rows`) are
`tokenspeed.ops.triton.mla_flash`; the plain combine (`_mla_combine_kernel`, its tiles `combine_tiles`) is
`tokenspeed.ops.triton.mla_combine` (re-exported here); this module keeps the split kernel, the wrappers, the
policy constants (MIN_CHUNK, DEFAULT_WAVES, KEYS_MAJOR, UNIFORM_PLAN, read at call time from here) and the plan's
host mirrors (`plan_splits`, `plan_ragged`, `ragged_grid`).

Split count at small batch and short context (why the default stays). Batch 1, 4K, H 32: the default plan is 64
splits of 64 rows; each split program reads 64 x 1152 B = 74 KB of bf16 cache and writes 64 KB of fp32 partials
(its 32 rows x 512), so the partials total as much as the cache (4.2 vs 4.7 MB). But they stay in L2 (50 MB):
what bounds a latency-bound split program is its own bytes over one SM's bandwidth (~50-100 GB/s with two 36 KB
stages in flight), C / S + 64 KB for S splits of a C-byte cache, and that falls with S: 138 KB at S 64, 211 KB at
32, 359 KB at 16 (2.3 / 3.5 / 6.0 us at 60 GB/s), 101 KB at 128. The (fused) combine program re-reads S x 2 KB of
partials plus 32 KB of W_UV: 160 / 96 / 64 KB. Summed, S 48..64 is flat (~4 us), 32 is ~15% worse and 16 ~70%
worse, 128 about even; so MIN_CHUNK 64 (S 64 at 4K) stays, and the split count is not cut for short contexts
until an H200 sweep says otherwise (benchmarks/mla_decode_h200.py --policies; MIN_CHUNK and DEFAULT_WAVES are the
knobs, read at call time). What the fused combine changes: its per-program partial bytes grow with S (256 KB at
S 128, 32K context), where the unfused combine read S x 512 B per program; MIN_CHUNK 96..128 is the first thing
to time if the fused combine turns out slow at long contexts.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import mla_combine_uv as _uv
from tokenspeed.ops.triton import mla_gluon as _gluon
from tokenspeed.ops.triton.mla_combine import (  # noqa: F401 - COMBINE_*, combine_tiles re-exported
    COMBINE_ENV,
    COMBINE_MAX_BLOCK_S,
    COMBINE_TILE_ELEMS,
    _mla_combine_kernel,
    combine_tiles,
    merge_unroll,
)
from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2
from tokenspeed.ops.triton.mla_flash import _flash_rows, _store_rows
from tokenspeed.ops.triton.mla_split_plan import (
    _pick,
    _plan_balanced,
    _ragged_item,
    _uniform_chunk,
    _warp_uniform,
)

LOG2E = 1.4426950408889634
# The shortest balanced split (rows). Partials cost Q*H*v_dim*8 bytes per split (written, then read back), so at
# Q*H = 32 a split under ~114 bf16 rows moves more partial bytes than cache bytes; 64 is kept until the H200 sweep
# (benchmarks/mla_decode_h200.py --policies) picks a value.
MIN_CHUNK = 64
# default_max_splits: split slots for about this many waves of 132 programs. One wave, from the H200 policy sweep
# (benchmarks/results/mla_decode_policies_h200_1b048d5.json, split + combine, us, batch x context): 20.2 / 73.8 at
# b1 4K / 32K (two waves: 20.4 / 114.9), 37.2 / 143.0 at b4 (51.9 / 156.9), 82.5 / 484.6 at b16, 269 / 1838 at
# b64 (two waves within 2%).
DEFAULT_WAVES = 1.0
# The split kernel's dot orientation: False computes scores as [rows, keys] (rows = query heads, 32 at Kimi-Linear:
# too few for a wgmma tile, so the dots run as mma.sync with every warp re-reading the queries from shared memory
# each key tile); True computes them as [keys, rows] and the output as [v_dim, rows], so the key tile (BLOCK_N)
# and v_dim are the dots' M dimension (wgmma on sm_90, operands straight from shared memory). None: keys-major for
# the cache dtypes of KEYS_MAJOR_DTYPES (an fp8 cache measured slower keys-major: its tiles are converted through
# registers). Read at call time.
KEYS_MAJOR: bool | None = None
KEYS_MAJOR_DTYPES = (torch.bfloat16,)
# The split plan's scalars through `mla_split_plan._warp_uniform` (CUDA only): the keys-major kernel with the
# balanced / ragged plan then compiles without spills for sm_90 (256 B and 33 reloads in its loop without; the
# uniform plan, whose scalars come from loads, has none). H200, split + combine, cold L2, graph (ea93670,
# results/mla_decode_h200{,_uniform_plan}_ea93670.json): balanced 16 mixed histories 230.5 -> 194.4 us, 16 x 16K
# 176.9 -> 149.6, 64 x 4K 219.9 -> 183.0, 1 x 64K 77.7 -> 69.1 (= the uniform plan's 69.2). Read at call time.
UNIFORM_PLAN = True
# Launch defaults of the keys-major loop (BLOCK_N, num_warps, num_stages).
KEYS_MAJOR_LAUNCH = (64, 4, 2)


# The scalars that vary with the batch and the policy are not specialised (divisible by 16, equal to 1): one
# compiled variant serves them all (fewer JIT compiles at warm-up and in the policy sweep).
@triton.jit(do_not_specialize=["N", "MAX_SPLITS", "min_chunk", "max_q", "stride_pt"])
def _mla_split_kernel(
    Qp, stride_qn, stride_qj, stride_qh,
    QR, stride_rn, stride_rj, stride_rh,
    CACHE, stride_cp, stride_cr,
    PT, stride_pt,
    KV_LENS,
    O, PART, LSE,
    N, MAX_SPLITS, min_chunk, sm_scale_log2, kv_scale,
    CU, max_q,
    QN: tl.constexpr,
    H: tl.constexpr,
    PAGE: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
    BALANCED: tl.constexpr,
    RAGGED: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    ALL_PARTIAL: tl.constexpr = False,
    KEYS_MAJOR: tl.constexpr = False,
    ROW: tl.constexpr = 0,
    UNIFORM: tl.constexpr = False,
):
    if PDL:  # everything this kernel reads may come from the kernels just before it: wait first, on every path
        gdc_wait()
        gdc_launch_dependents()
    CT = tl.float32 if IEEE else tl.bfloat16
    if RAGGED:  # a 1-D grid over the plan's work items; q [T, H, .] (stride_qj / stride_rj: per token)
        n, count, rows, row_ok, first, lo, hi, lim, base = _ragged_item(CU, KV_LENS, N, MAX_SPLITS, min_chunk,
                                                                        max_q, H, BLOCK_H, BLOCK_SEQ, BLOCK_N,
                                                                        ALL_PARTIAL, UNIFORM)
        if count == 0:  # past the last item
            return
        dv = tl.arange(0, BLOCK_DV)
        dr = tl.arange(0, BLOCK_DR)
        dv_ok = dv < DV
        dr_ok = dr < DR
        tok = first + rows // H
        h64 = (rows % H).to(tl.int64)
        q_ptr = Qp + tok * stride_qj + h64 * stride_qh
        r_ptr = QR + tok * stride_rj + h64 * stride_rh
        o_base = base  # one of the two is used: see `_ragged_item`
        p_base = base
        p_rows = rows
    else:
        pid_h = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_n = tl.program_id(2).to(tl.int64)
        QH: tl.constexpr = QN * H
        OUT_TY = O.dtype.element_ty

        rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok = rows < QH
        dv = tl.arange(0, BLOCK_DV)
        dr = tl.arange(0, BLOCK_DR)
        dv_ok = dv < DV
        dr_ok = dr < DR

        # Padding sequence: zeros, written once (slot 0 of its own row of the grid, whatever the plan); with
        # ALL_PARTIAL the W_UV combine writes them (it sees no split: zeros).
        own_len = tl.load(KV_LENS + pid_n).to(tl.int64)
        if (pid_s == 0) & (own_len <= 0) & (not ALL_PARTIAL):
            zo = O + (pid_n * QH + rows[:, None]) * DV + dv[None, :]
            tl.store(zo, tl.zeros([BLOCK_H, BLOCK_DV], dtype=OUT_TY), mask=row_ok[:, None] & dv_ok[None, :])

        # Which (sequence, split) this slot serves.
        if BALANCED:
            p = pid_n * MAX_SPLITS + pid_s
            idx, lens, counts, starts, chunk = _plan_balanced(KV_LENS, N, N * MAX_SPLITS, min_chunk, BLOCK_SEQ,
                                                              BLOCK_N)
            n = tl.sum((starts + counts <= p).to(tl.int64), axis=0)  # first sequence whose splits end after p
            n = tl.minimum(n, N - 1)
            kv_len = _warp_uniform(_pick(idx, lens, n), UNIFORM).to(tl.int64)
            count = _warp_uniform(_pick(idx, counts, n), UNIFORM).to(tl.int64)
            start = _warp_uniform(_pick(idx, starts, n), UNIFORM).to(tl.int64)
            chunk = _warp_uniform(chunk, UNIFORM).to(tl.int64)
            n = _warp_uniform(n, UNIFORM).to(tl.int64)
            s = p - start
        else:
            n = pid_n
            kv_len = tl.maximum(own_len, 0)
            chunk = _uniform_chunk(kv_len, MAX_SPLITS, BLOCK_N)
            count = (kv_len + chunk - 1) // chunk
            start = n * MAX_SPLITS
            s = pid_s.to(tl.int64)
        if s >= count:  # past the plan's last split (or a padding sequence)
            return

        lo = (s * chunk).to(tl.int32)  # positions fit in int32 (page_table is int32-indexed anyway)
        hi = tl.minimum(lo + chunk, kv_len).to(tl.int32)
        j = rows // H
        h = rows % H
        lim = kv_len - QN + j  # last key position row r sees

        j64 = j.to(tl.int64)
        h64 = h.to(tl.int64)
        q_ptr = Qp + n * stride_qn + j64 * stride_qj + h64 * stride_qh
        r_ptr = QR + n * stride_rn + j64 * stride_rj + h64 * stride_rh
        o_base = n * QH
        p_base = (start + s) * QH
        p_rows = rows
    q_v = tl.load(q_ptr[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0).to(CT)
    q_r = tl.load(r_ptr[:, None] + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0).to(CT)
    acc, m_i, l_i = _flash_rows(q_v, q_r, lim, CACHE, stride_cp, stride_cr, PT + n * stride_pt, lo, hi,
                                sm_scale_log2, dv, dv_ok, dr, dr_ok, PAGE, DV, BLOCK_H, BLOCK_N, BLOCK_DV, IEEE,
                                KEYS_MAJOR, ROW)
    _store_rows(acc, m_i, l_i, kv_scale, (count == 1) & (not ALL_PARTIAL), O, o_base, rows, PART, LSE, p_base,
                p_rows, row_ok, dv, dv_ok, DV)


def default_block_h(q_rows: int) -> int:
    """16 or 32 rows per program (tl.dot needs >= 16): the fewer padded rows, ties to 32 (fewer KV re-reads)."""
    waste = {b: triton.cdiv(q_rows, b) * b - q_rows for b in (32, 16)}
    return min(waste, key=lambda b: (waste[b], -b))


def default_max_splits(num_seqs: int, q_rows: int, num_sms: int = 132, *, block_h: int | None = None,
                       waves: float | None = None) -> int:
    """Split slots per sequence so that the grid (HB x max_splits x N) holds about `waves` (default DEFAULT_WAVES)
    x num_sms programs."""
    waves = DEFAULT_WAVES if waves is None else waves
    hb = triton.cdiv(max(q_rows, 1), block_h or default_block_h(q_rows))
    return max(1, min(1024, math.ceil(waves * num_sms / (max(num_seqs, 1) * hb))))


def _in_page_row(cache: Tensor, block_n: int) -> int:
    """The split kernel's ROW: the cache's row stride when its key tiles lie in one page (PAGE % BLOCK_N == 0;
    the plans start every split at a multiple of BLOCK_N), else 0 (a page-table entry per row)."""
    return 0 if cache.shape[1] % block_n else cache.stride(1)


def uses_keys_major(cache_dtype: torch.dtype, keys_major: bool | None = None) -> bool:
    """Whether `mla_decode` runs keys-major over a cache of `cache_dtype`: `keys_major`, else KEYS_MAJOR, else
    (both None) whether the dtype is in KEYS_MAJOR_DTYPES."""
    choice = KEYS_MAJOR if keys_major is None else keys_major
    return cache_dtype in KEYS_MAJOR_DTYPES if choice is None else bool(choice)


def launch_block_n(cache_dtype: torch.dtype, keys_major: bool | None = None, block_n: int | None = None) -> int:
    """The key tile `mla_decode` launches with (what its split plans round chunks to; `plan_splits`' block_n)."""
    return _loop_launch(uses_keys_major(cache_dtype, keys_major), block_n, None, None)[0]


def _uniform_plan(q: Tensor) -> bool:
    """The split kernel's UNIFORM: UNIFORM_PLAN on a CUDA device (the shuffle is inline PTX)."""
    return UNIFORM_PLAN and q.is_cuda


def _loop_launch(keys_major: bool, block_n: int | None, num_warps: int | None, num_stages: int | None
                 ) -> tuple[int, int | None, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel: the given ones, else the loop form's defaults
    (num_warps None: by BLOCK_H, as `_launch` picks)."""
    if keys_major:
        dn, dw, ds = KEYS_MAJOR_LAUNCH
        return block_n or dn, num_warps or dw, num_stages or ds
    return block_n or 32, num_warps, num_stages or 2


def _check_queries(q: Tensor, q_rope: Tensor | None, v_dim: int, ragged: bool = False) -> int:
    """Validates q (and q_rope): [N, Q, H, D], or [T, H, D] when ragged; returns the latent row width Dl."""
    nd, form = (3, "[T, H, D]") if ragged else (4, "[N, Q, H, D]")
    if q.dim() != nd or q.stride(-1) != 1:
        raise ValueError(f"q must be {form} with unit last stride; got {tuple(q.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32 / bf16 / fp16; got {q.dtype}")
    if q_rope is None:
        return q.shape[-1]
    if q.shape[-1] != v_dim:
        raise ValueError(f"with q_rope, q holds the latent part only: last dim {v_dim}; got {q.shape[-1]}")
    if q_rope.dim() != nd or q_rope.shape[:-1] != q.shape[:-1] or q_rope.stride(-1) != 1 or q_rope.dtype != q.dtype:
        raise ValueError(f"q_rope must be [{', '.join(map(str, q.shape[:-1]))}, R] of q's dtype with unit last "
                         f"stride; got {tuple(q_rope.shape)} {q_rope.dtype}")
    return v_dim + q_rope.shape[-1]


def _check_rest(N: int, Dl: int, cache: Tensor, page_table: Tensor, kv_lens: Tensor, v_dim: int) -> None:
    if cache.dim() != 3 or cache.shape[-1] != Dl or cache.stride(-1) != 1:
        raise ValueError(f"cache must be [P, page_size, {Dl}] with unit last stride; got {tuple(cache.shape)}")
    if not 0 < v_dim < Dl:
        raise ValueError(f"v_dim must be in (0, {Dl}); got {v_dim}")
    if page_table.dim() != 2 or page_table.shape[0] != N:
        raise ValueError(f"page_table must be [{N}, W]; got {tuple(page_table.shape)}")
    if kv_lens.shape != (N,):
        raise ValueError(f"kv_lens must be [{N}]; got {tuple(kv_lens.shape)}")
    if cache.dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"cache must be fp32 / bf16 / fp8 e4m3; got {cache.dtype}")


def _check_launch(bh: int, block_n: int, ms: int, n: int, min_chunk: int | None) -> int:
    """Validates the launch knobs; returns min_chunk (default MIN_CHUNK)."""
    if bh < 16 or bh & (bh - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_H and BLOCK_N must be powers of two >= 16; got {bh}, {block_n}")
    if not 1 <= ms <= 65535 or n > 65535:
        raise ValueError(f"max_splits must be in [1, 65535] and N <= 65535; got {ms}, {n}")
    mc = int(MIN_CHUNK if min_chunk is None else min_chunk)
    if mc < 1:
        raise ValueError(f"min_chunk must be >= 1; got {mc}")
    return mc


def mla_decode(
    q: Tensor,
    cache: Tensor,
    page_table: Tensor,
    kv_lens: Tensor,
    scale: float,
    v_dim: int,
    kv_scale: float = 1.0,
    *,
    q_rope: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    max_q: int | None = None,
    max_splits: int | None = None,
    balanced: bool = True,
    BLOCK_H: int | None = None,
    BLOCK_N: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_chunk: int | None = None,
    out: Tensor | None = None,
    w_uv: Tensor | None = None,
    keys_major: bool | None = None,
) -> Tensor:
    """Paged absorbed-MLA decode / verify (the contract of the module docstring). Returns [N, Q, H, v_dim], or
    [T, H, v_dim] for a ragged batch.

    q_rope: the query's rope part as its own [..., Dl - v_dim] tensor (q is then [..., v_dim]); cu_seqlens_q:
    [N+1] int32 / int64 device offsets of each sequence's tokens in a flat q [T, H, .] (the ragged form; max_q, a
    host int >= every sequence's token count, is then required); max_splits: split slots per sequence (default
    `default_max_splits`); balanced: the balanced plan (else uniform; the ragged plan is always balanced);
    BLOCK_H / BLOCK_N / num_warps / num_stages: launch configuration (defaults: BLOCK_N 32, 2 stages, or
    KEYS_MAJOR_LAUNCH keys-major); keys_major: the dots' orientation (default KEYS_MAJOR, read at call time);
    min_chunk: the shortest balanced split in rows (default MIN_CHUNK); out: a contiguous output; w_uv:
    [H, v_head, v_dim] (kv_b_proj's W_UV view, unit last stride): the output is then o_lat @ W_UV[h]^T per head,
    [..., H, v_head] (`mla_combine_uv`; the composition `mla_decode(...)` then bmm, with o_lat rounded to q's dtype
    in between as there). Reads only; writes `out` (and its own workspace)."""
    km = uses_keys_major(cache.dtype, keys_major)
    block_n_arg = BLOCK_N
    BLOCK_N, num_warps, num_stages = _loop_launch(km, BLOCK_N, num_warps, num_stages)
    if cu_seqlens_q is not None:
        return _mla_decode_ragged(q, cache, page_table, kv_lens, scale, v_dim, kv_scale, q_rope, cu_seqlens_q, max_q,
                                  max_splits, BLOCK_H, BLOCK_N, num_warps, num_stages, min_chunk, out, w_uv, km)
    Dl = _check_queries(q, q_rope, v_dim)
    N, QN, H = q.shape[:3]
    _check_rest(N, Dl, cache, page_table, kv_lens, v_dim)
    vh = _uv._check_uv(w_uv, H, v_dim)
    page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    kv_lens = kv_lens if kv_lens.is_contiguous() else kv_lens.contiguous()
    if out is None:
        out = torch.empty(N, QN, H, vh, dtype=q.dtype, device=q.device)
    elif out.shape != (N, QN, H, vh) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{N}, {QN}, {H}, {vh}] tensor of q's dtype")
    if N == 0 or QN * H == 0:
        return out
    qh = QN * H
    qr = q[..., v_dim:] if q_rope is None else q_rope
    # Hopper: the Gluon split kernel, unless the call fixes the rows-major orientation or another key tile
    orientation = KEYS_MAJOR if keys_major is None else keys_major
    gluon = (orientation is not False and block_n_arg in (None, _gluon.BLOCK_N)
             and _gluon.usable(q, qr, cache, v_dim, _gluon.BLOCK_N, balanced))
    bh = BLOCK_H or (_gluon.default_block_h(qh, N) if gluon else default_block_h(qh))
    gluon = gluon and bh in _gluon.BLOCK_HS
    BLOCK_N = _gluon.BLOCK_N if gluon else BLOCK_N  # the plan's key rounding (an fp8 cache's Triton tile is 32)
    ms = int(max_splits) if max_splits is not None else default_max_splits(N, qh, block_h=bh)
    mc = _check_launch(bh, BLOCK_N, ms, N, min_chunk)
    _launch(q, qr, cache, page_table, kv_lens, out, scale, kv_scale, ms, mc, balanced, bh, BLOCK_N, num_warps,
            num_stages, v_dim, w_uv, km, gluon)
    return out


def _launch(q: Tensor, qr: Tensor, cache: Tensor, page_table: Tensor, kv_lens: Tensor, out: Tensor, scale: float,
            kv_scale: float, ms: int, min_chunk: int, balanced: bool, bh: int, block_n: int, num_warps: int | None,
            num_stages: int, v_dim: int, w_uv: Tensor | None = None, keys_major: bool = False,
            gluon: bool = False) -> None:
    """The split kernel (gluon: `mla_gluon`'s), then (max_splits > 1) the combine kernel, over validated
    arguments. With w_uv every split writes partials and the W_UV combine always runs (it also writes the padding
    sequences' zeros)."""
    N, QN, H = q.shape[:3]
    qh = QN * H
    uv = w_uv is not None
    if ms > 1 or uv:
        part = torch.empty(N * ms, qh, v_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(N * ms, qh, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # never touched: one split per sequence
    block_seq = plan_block_seq(N) if balanced else 1  # the uniform plan reads only its own kv_len
    use_pdl = pdl.enabled(q.device, "mla")
    launch = pdl.launch_kwargs(q.device, "mla")
    if gluon:
        _gluon.launch(q, qr, cache, page_table, kv_lens, out, part, lse, ms, min_chunk,
                      float(scale) * float(kv_scale) * LOG2E, float(kv_scale), bh, block_seq, uv,
                      {"PDL": use_pdl, **launch})  # the same decision as `pdl.kernel_kwargs`
    else:
        _split(q, qr, cache, page_table, kv_lens, out, part, lse, scale, kv_scale, ms, min_chunk, balanced, bh,
               block_n, num_warps, num_stages, v_dim, uv, keys_major, block_seq, use_pdl, launch)
    if uv:
        _uv._combine_uv(w_uv, kv_lens, kv_lens, out, part, lse, N * QN, N, ms, min_chunk, 0, QN, v_dim, bh,
                        block_seq, block_n, bool(balanced), False)
    elif ms > 1:
        block_s, block_vc = combine_tiles(ms, v_dim)
        _mla_combine_kernel[(triton.cdiv(v_dim, block_vc), qh, N)](
            kv_lens, out, part, lse,
            N, ms, min_chunk,
            kv_lens, 0,
            QH=qh, DV=v_dim, BLOCK_VC=block_vc, BLOCK_S=block_s, BLOCK_SEQ=block_seq, BLOCK_N=block_n,
            BALANCED=bool(balanced), PDL=use_pdl,
            num_warps=4, **launch,
        )


def _split(q: Tensor, qr: Tensor, cache: Tensor, page_table: Tensor, kv_lens: Tensor, out: Tensor, part: Tensor,
           lse: Tensor, scale: float, kv_scale: float, ms: int, min_chunk: int, balanced: bool, bh: int,
           block_n: int, num_warps: int | None, num_stages: int, v_dim: int, uv: bool, keys_major: bool,
           block_seq: int, use_pdl: bool, launch: dict) -> None:
    """The Triton split kernel of a uniform batch (`_launch`'s arguments)."""
    N, QN, H = q.shape[:3]
    qh, Dl = QN * H, cache.shape[-1]
    _mla_split_kernel[(triton.cdiv(qh, bh), ms, N)](
        q, q.stride(0), q.stride(1), q.stride(2),
        qr, qr.stride(0), qr.stride(1), qr.stride(2),
        cache, cache.stride(0), cache.stride(1),
        page_table, page_table.stride(0),
        kv_lens,
        out, part, lse,
        N, ms, min_chunk, float(scale) * float(kv_scale) * LOG2E, float(kv_scale),
        kv_lens, 0,  # CU, max_q: ragged only
        QN=QN, H=H, PAGE=cache.shape[1], DV=v_dim, DR=Dl - v_dim,
        BLOCK_DV=max(16, next_pow2(v_dim)), BLOCK_DR=max(16, next_pow2(Dl - v_dim)), BLOCK_H=bh, BLOCK_N=block_n,
        BLOCK_SEQ=block_seq, BALANCED=bool(balanced), RAGGED=False, IEEE=cache.dtype == torch.float32, PDL=use_pdl,
        ALL_PARTIAL=uv, KEYS_MAJOR=keys_major, ROW=_in_page_row(cache, block_n), UNIFORM=_uniform_plan(q),
        num_warps=num_warps or (4 if bh <= 16 else 8), num_stages=num_stages, **launch,
    )


_SM_COUNTS: dict[int, int] = {}
INTERPRETER_SMS = 4  # num_sms off CUDA: every program of a grid costs the interpreter milliseconds


def num_sms(device: torch.device) -> int:
    """The SM count the ragged default split budget is sized for (DEFAULT_WAVES x it): the CUDA device's (132 on an
    H200), INTERPRETER_SMS elsewhere (the Triton interpreter: small grids keep the CPU tests fast)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def plan_block_seq(num_seqs: int) -> int:
    """BLOCK_SEQ of the balanced split plan (every program reads all N histories as one vector): a power of two
    >= 16, so the batch sizes of a serving run share a few compiled variants (one up to 16 sequences); the plan
    masks the lanes past N, so the result does not depend on it."""
    return max(16, next_pow2(num_seqs))


def ragged_max_q_bucket(max_q: int) -> int:
    """The grid's bucket of a ragged batch's longest query: a power of two >= 16 (few distinct grids)."""
    return max(16, next_pow2(max_q))


def ragged_grid(num_tokens: int, num_seqs: int, heads: int, max_q: int, max_splits: int, block_h: int
                ) -> tuple[int, int, int]:
    """(split programs, combine row blocks, partial items of workspace) of a ragged launch; host ints only.

    RB = min(N * cdiv(bucket(max_q) * H, BLOCK_H), cdiv(T * H, BLOCK_H) + N - 1) bounds the row blocks
    sum_n cdiv(q_len_n * H, BLOCK_H); B = N * max_splits is the plan's budget. The plan keeps < B + RB items, the
    row blocks of split sequences < B, and their items < min(2 B, B + RB) (module docstring). max_splits == 1:
    no splits, RB programs, no combine, no workspace."""
    rb = min(num_seqs * triton.cdiv(ragged_max_q_bucket(max_q) * heads, block_h),
             triton.cdiv(num_tokens * heads, block_h) + num_seqs - 1)
    if max_splits == 1:
        return rb, 0, 0
    budget = num_seqs * max_splits
    return budget + rb, min(budget, rb), min(2 * budget, budget + rb)


def _mla_decode_ragged(q: Tensor, cache: Tensor, page_table: Tensor, kv_lens: Tensor, scale: float, v_dim: int,
                       kv_scale: float, q_rope: Tensor | None, cu: Tensor, max_q: int | None,
                       max_splits: int | None, BLOCK_H: int | None, BLOCK_N: int, num_warps: int | None,
                       num_stages: int, min_chunk: int | None, out: Tensor | None, w_uv: Tensor | None = None,
                       keys_major: bool = False) -> Tensor:
    """`mla_decode` of a ragged batch: validates, then launches (`_launch_ragged`). Returns [T, H, v_dim]."""
    Dl = _check_queries(q, q_rope, v_dim, ragged=True)
    T, H = q.shape[:2]
    N = kv_lens.shape[0] if kv_lens.dim() == 1 else -1
    _check_rest(N, Dl, cache, page_table, kv_lens, v_dim)
    vh = _uv._check_uv(w_uv, H, v_dim)
    if cu.shape != (N + 1,) or cu.dtype not in (torch.int32, torch.int64) or cu.device != q.device:
        raise ValueError(f"cu_seqlens_q must be an int32 / int64 [{N + 1}] tensor on q's device; got "
                         f"{tuple(cu.shape)} {cu.dtype} {cu.device}")
    if max_q is None or int(max_q) < 0:
        raise ValueError(f"a ragged batch needs max_q, a host int >= every sequence's query length; got {max_q}")
    if out is None:
        out = torch.empty(T, H, vh, dtype=q.dtype, device=q.device)
    elif out.shape != (T, H, vh) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{T}, {H}, {vh}] tensor of q's dtype")
    if N == 0 or T * H == 0:
        return out
    bh = BLOCK_H or default_block_h(H)
    ms = int(max_splits) if max_splits is not None else default_max_splits(N, bh, num_sms(q.device), block_h=bh)
    mc = _check_launch(bh, BLOCK_N, ms, N, min_chunk)
    page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    kv_lens = kv_lens if kv_lens.is_contiguous() else kv_lens.contiguous()
    cu = cu if cu.is_contiguous() else cu.contiguous()
    qr = q[..., v_dim:] if q_rope is None else q_rope
    _launch_ragged(q, qr, cache, page_table, kv_lens, cu, int(max_q), out, scale, kv_scale, ms, mc, bh, BLOCK_N,
                   num_warps, num_stages, v_dim, w_uv, keys_major)
    return out


def _launch_ragged(q: Tensor, qr: Tensor, cache: Tensor, page_table: Tensor, kv_lens: Tensor, cu: Tensor,
                   max_q: int, out: Tensor, scale: float, kv_scale: float, ms: int, min_chunk: int, bh: int,
                   block_n: int, num_warps: int | None, num_stages: int, v_dim: int, w_uv: Tensor | None = None,
                   keys_major: bool = False) -> None:
    """The ragged split kernel (a 1-D grid over the plan's items), then the ragged combine, over validated
    arguments (`ragged_grid` sizes both and the workspace). With w_uv every item writes partials (the workspace
    then holds one per split program) and the W_UV combine runs."""
    T, H = q.shape[:2]
    N, Dl = kv_lens.shape[0], cache.shape[-1]
    uv = w_uv is not None
    programs, comb_blocks, part_items = ragged_grid(T, N, H, max_q, ms, bh)
    part_items = programs if uv else part_items
    if part_items:
        part = torch.empty(part_items, bh, v_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(part_items, bh, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # never touched: one split per sequence
    mc = min_chunk if ms > 1 else 2**31 - 1  # max_splits == 1: a chunk longer than any history, so no splits
    mq, block_seq = ragged_max_q_bucket(max_q), plan_block_seq(N)
    use_pdl = pdl.enabled(q.device, "mla")
    launch = pdl.launch_kwargs(q.device, "mla")
    _mla_split_kernel[(programs, 1, 1)](
        q, 0, q.stride(0), q.stride(1),
        qr, 0, qr.stride(0), qr.stride(1),
        cache, cache.stride(0), cache.stride(1),
        page_table, page_table.stride(0),
        kv_lens,
        out, part, lse,
        N, ms, mc, float(scale) * float(kv_scale) * LOG2E, float(kv_scale),
        cu, mq,
        QN=1, H=H, PAGE=cache.shape[1], DV=v_dim, DR=Dl - v_dim,
        BLOCK_DV=max(16, next_pow2(v_dim)), BLOCK_DR=max(16, next_pow2(Dl - v_dim)), BLOCK_H=bh, BLOCK_N=block_n,
        BLOCK_SEQ=block_seq, BALANCED=True, RAGGED=True, IEEE=cache.dtype == torch.float32, PDL=use_pdl,
        ALL_PARTIAL=uv, KEYS_MAJOR=keys_major, ROW=_in_page_row(cache, block_n), UNIFORM=_uniform_plan(q),
        num_warps=num_warps or (4 if bh <= 16 else 8), num_stages=num_stages, **launch,
    )
    if uv:
        _uv._combine_uv(w_uv, kv_lens, cu, out, part, lse, T, N, ms, mc, mq, 1, v_dim, bh, block_seq, block_n, True,
                        True)
    elif comb_blocks:
        block_vc = min(next_pow2(v_dim), 128)
        _mla_combine_kernel[(triton.cdiv(v_dim, block_vc), comb_blocks, 1)](
            kv_lens, out, part, lse,
            N, ms, mc,
            cu, mq,
            QH=1, DV=v_dim, BLOCK_VC=block_vc, BLOCK_S=16, BLOCK_SEQ=block_seq, BLOCK_N=block_n,
            BALANCED=True, PDL=use_pdl, RAGGED=True, H=H, BLOCK_H=bh, UNROLL=merge_unroll(),
            num_warps=4, **launch,
        )


def plan_splits(kv_lens: list[int], max_splits: int, balanced: bool = True, block_n: int = 32,
                min_chunk: int | None = None) -> tuple[list[int], list[int]]:
    """Host mirror of the kernels' split plan (for tests and reports): (split length, number of splits) per
    sequence. The kernels compute the same on the device. min_chunk: default MIN_CHUNK."""
    min_chunk = MIN_CHUNK if min_chunk is None else min_chunk
    lens = [max(int(k), 0) for k in kv_lens]
    if balanced:
        denom = max(len(lens) * max_splits - len(lens), 1)
        chunk = _cdiv(max(_cdiv(sum(lens), denom), min_chunk), block_n) * block_n
        chunks = [chunk] * len(lens)
    else:
        chunks = [_cdiv(_cdiv(max(k, 1), max_splits), block_n) * block_n for k in lens]
    return chunks, [_cdiv(k, c) for k, c in zip(lens, chunks)]


def plan_ragged(q_lens: list[int], kv_lens: list[int], heads: int, max_splits: int, block_h: int,
                block_n: int = 32, min_chunk: int | None = None, max_q: int | None = None) -> dict:
    """Host mirror of the ragged plan (for tests and reports): {"chunk", "blocks", "splits"} (per sequence) and
    the totals {"items", "partial_items", "combine_blocks"} the kernels compute on the device."""
    mq = ragged_max_q_bucket(max(q_lens, default=0) if max_q is None else max_q)
    qls = [min(max(int(q), 0), mq) for q in q_lens]
    kvs = [max(int(k), 0) for k in kv_lens]
    blocks = [_cdiv(q * heads, block_h) for q in qls]
    mc = (MIN_CHUNK if min_chunk is None else min_chunk) if max_splits > 1 else 2**31 - 1
    budget = len(qls) * max_splits
    chunk = _cdiv(max(_cdiv(sum(b * k for b, k in zip(blocks, kvs)), budget), mc), block_n) * block_n
    splits = [max(_cdiv(k, chunk), 1) if b else 0 for b, k in zip(blocks, kvs)]
    split = [(b, s) for b, s in zip(blocks, splits) if s > 1]
    return {"chunk": chunk, "blocks": blocks, "splits": splits, "items": sum(b * s for b, s in zip(blocks, splits)),
            "partial_items": sum(b * s for b, s in split), "combine_blocks": sum(b for b, _ in split)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The W_UV combine's names stay readable here (`mla_decode._mla_combine_uv_kernel`, ...) as before it moved out.
_UV_NAMES = frozenset({"_mla_combine_uv_kernel", "_uv_rows", "_combine_uv", "_check_uv", "UV_BLOCK_T", "UV_BLOCK_V"})


def __getattr__(name: str):
    """Re-exports the W_UV combine's names from `mla_combine_uv` (module attributes looked up at access time)."""
    if name in _UV_NAMES:
        return getattr(_uv, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
