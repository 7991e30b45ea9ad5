"""The MLA split kernel in Gluon for Hopper (sm_90): `mla_decode`'s decode / verify split over a bf16 cache.

Same outputs as `mla_decode._mla_split_kernel` for the cases `usable` accepts (uniform decode or verify, the
balanced plan, 64-key tiles, 16-, 32- or 64-row query tiles): single-split sequences write their
normalised output rows to O directly, the others fp32 partials and log2 LSEs at the plan's workspace rows, so
`mla_decode`'s combine kernels (plain or W_UV) merge them unchanged. With the per-tile softmax sum
(TOKENSPEED_MLA_GLUON_LAZY_SUM=0) bit-identical to the Triton keys-major kernel on the H200 for the same split count
(`benchmarks/mla_gluon_h200.py`, tests/ops/test_triton_mla_gluon.py); the default per-lane sum (LAZY_SUM) differs
from it only in the fp32 summation order of the softmax denominator.

Why a second kernel. Triton's pipeliner issues the keys-major loop's copy of tile i+1 after tile i's dots and
waits for it at the top of the next iteration, so no copy overlaps a dot: about 40% of HBM at best. Here, with
Gluon's explicit async copies, the copy of tile i+1 is issued at the top of iteration i into the other of two
shared-memory buffers and `wait_group(1)` waits only for tile i. The dots are wgmma, keys-major (the 64-key tile
and v_dim are the M dimension, the query rows N). The page of tile i+1 is read one iteration ahead; the plan's
scalars go through a lane-0 shuffle (`mla_split_plan._warp_uniform`) so the loop bounds stay in uniform registers.
H200, split + combine: batch 64 / 32K 616 us (91.8% of HBM) against 1089 us for the Triton kernel; 16 mixed
histories 124 vs 193 us (docs/kernels.md).

fp8 (e4m3) caches: the dots read bf16 tiles, converted from fp8 in shared memory. With 16- or 32-row tiles in
batches of WS_MIN_SEQS (1) sequences or more the kernel is warp-specialized: a producer warpgroup copies each tile's
five chunks into a shared-memory ring (every thread reads back only its own 16-byte pieces, so no barrier between
copy and read), converts them and fills one of two bf16 staging buffers, while the kernel's own warpgroup runs the
dots and the softmax; a `full` and an `empty` mbarrier a buffer hand the tiles over. Otherwise one warpgroup
converts each tile between its copy and its dots. Both give the same bits. FP8_DOTS (opt-in) runs the
warp-specialized kernel's two dots in e4m3 instead (quantised queries, keys straight from the copied tile, a
transposed latent from the producer, e4m3 p): ~10% faster at long contexts, ~3.5% error (docs/kernels.md).

Contract (per program of the grid (ceil(QN * H / BLOCK_H), MAX_SPLITS, N); row r = j * H + h of a sequence is
query token j's head h, which sees keys up to kv_len - QN + j): reads Q [N, QN, H, DV] and QR [N, QN, H, DR]
(bf16, unit last stride), the cache [pages, PAGE, DV + DR] (bf16 or fp8, contiguous rows), the page table (int32) and
KV_LENS; writes its BLOCK_H rows of O for single-split sequences (and zeros for padding sequences, kv_len <= 0,
unless ALL_PARTIAL), else of PART [N * MAX_SPLITS, QN * H, DV] / LSE [N * MAX_SPLITS, QN * H]. ALL_PARTIAL: every
split writes partials (the W_UV combine reads them all). PDL: the protocol of `pdl.py` (wait first, then trigger;
nothing read before).
"""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from tokenspeed.ops.triton.gluon_common import TRITON_VERSIONS  # noqa: F401 - re-exported
from tokenspeed.ops.triton.gluon_common import hopper as _hopper

try:  # Gluon's API changes between Triton releases: `usable` is False outside TRITON_VERSIONS (and off CUDA)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

# Whether `mla_decode` takes this kernel where `usable` allows (read at call time). The environment variable
# TOKENSPEED_MLA_GLUON ("0" off, "1" on) overrides it at each call, so a benchmark can A/B the two kernels between
# CUDA-graph captures in one process.
ENABLED = True
ENV = "TOKENSPEED_MLA_GLUON"
BLOCK_N = 64  # keys per tile (the wgmma M); the plan rounds its chunks to it, so every tile starts at a multiple
# Query rows per program (the wgmma N): one warpgroup (4 warps) up to 32 rows (the accumulator [DV, 32] fp32 is 128
# registers a thread), two for 64 (each owning 32 rows; shared memory 230,400 B of 232,448).
BLOCK_HS = (16, 32, 64)
# Whether `default_block_h` takes 64-row tiles for more than 32 query rows per sequence (verify, 64+ heads) in batches
# of at least WIDE_MIN_SEQS sequences: one program per SM fits beside the key buffers, so fewer, wider row tiles
# mean fewer waves. H200, split + combine, cold L2, 64- vs 32-row tiles (results/mla_gluon_h200_9281f30.json): verify
# (4 tokens x 32 heads) batch 16 / 32K 453 vs 583 us, batch 64 / 4K 274 vs 298; K3's 96 heads batch 16 / 32K 447
# vs 577, batch 64 / 4K 263 vs 302; 4 x 12 heads batch 16 / 32K 246 vs 297. But verify at batch 1 / 4K 39.3 vs
# 23.8 us: the wider tile halves the row tiles, so `default_max_splits` doubles the splits (66 of 64 keys) and the
# fp32 partials (2 KB a row a split) outweigh the cache. Batches of 2-15 were not timed: 32-row tiles there.
WIDE_ROWS = True
WIDE_MIN_SEQS = 16
# Verify steps (several query tokens per sequence) too; decode (one) always.
VERIFY = True
DV, DR = 512, 64  # latent (kv_lora_rank) and rope widths: Kimi-Linear's and K3's
# Caches whose page size is not a multiple of BLOCK_N (the engine's default page is 16): each key row of a tile
# then comes from its own page-table entry (read one tile ahead as the single page is). Sm_90 compile at page 16:
# 1139 instructions per 64-key iteration against 901, no spill reloads. H200, page 16, split + combine, graph, cold
# L2, against the Triton kernel at page 16 (results/mla_gluon_h200_page16_2210135.json; outputs bit-identical):
# batch 64 / 32K 1283 -> 678 us, batch 16 / 32K 336 -> 178, 16 mixed histories 235 -> 130, batch 1 / 4K 22.1 -> 18.5.
SMALL_PAGES = True
# fp8 (e4m3) caches: the tiles are copied as fp8 (half the bytes) and converted to bf16 (exact) in shared memory
# before the dots (fp8 wgmma cannot take the value tile transposed); kv_scale on the scores and the output as in
# the Triton kernel. H200, page 16, against the Triton kernel's fp8 path (results/mla_gluon_h200_fp8_7f43a1b.json,
# within fp8 tolerance): batch 64 / 32K 2323 -> 1210 us, batch 16 / 32K 590 -> 308, mixed 444 -> 217. That was
# twice the bf16 kernel's time for half the bytes: the conversion ran f16 -> bf16 one element at a time on the
# quarter-rate F2F unit (`_fp8_to_bf16` now goes through fp32 on full-rate instructions), and it sat on the dots'
# critical path (now a producer warpgroup's work, WS_FP8). H200, page 16 (benchmarks/README.md): batch 64 / 32K
# 1241 us before, 902 with the conversion alone, 737 warp-specialized (the bf16 cache 678); 16 mixed histories
# 221 / 165 / 132 (bf16 131).
FP8_CACHE = True
# fp8 caches with 16- or 32-row tiles, warp-specialized (`_fp8_producer` / `_fp8_consumer`): a second warpgroup copies
# each fp8 tile into a shared-memory ring (the next tile's chunks in flight while it converts the current one) and
# stores it as bf16 into one of two staging buffers, so the conversion leaves the critical path of the warpgroup that
# runs the dots and the softmax (two mbarriers a buffer: full / empty). Same dots on the same bf16 tiles: bit for bit
# the single-warpgroup fp8 path. TOKENSPEED_MLA_GLUON_WS ("0" / "1") overrides it at each call. (Holding the next
# tile in registers instead spilled ~2 KB a thread: loop-carried fp8 values are unpacked, one element a register.)
WS_FP8 = True
WS_ENV = "TOKENSPEED_MLA_GLUON_WS"
WS_PRODUCER_REGS = 192  # the producer warpgroup's registers a thread; applied only with WS_MAXNREG (setmaxnreg)
# The kernel's maxnreg when warp-specialized (None: Triton's default, 255 for all eight warps and no reallocation).
# 168 (the partitions then hand registers over with setmaxnreg) was slower: batch 64 / 32K 1568 vs 740 us.
WS_MAXNREG: int | None = None
# The fewest sequences a batch needs for the warp-specialized kernel (fewer keep the one-warpgroup kernel). Set to 8
# at 9946d92 / d1a8668, when the warp-specialized
# kernel lost below that (batch 1 / 32K 64.8 vs 48.2 us); re-measured with the per-lane softmax sum at 7031f48
# (H200, page 16, split + combine, results/mla_gluon_ws_small_fp8_7031f48.json) it wins or ties at every batch:
# 1 / 32K 28.6 vs 30.5 us, 1 / 128K 60.6 vs 69.8, 1 x 64K 39.7 vs 43.7, 4 / 32K 59.8 vs 69.7, 4 / 4K 22.9 vs 23.8,
# 1 / 4K 17.2 vs 17.5, 8 / 32K 100.3 vs 120.9; only 4 short ragged histories (4097, 100, 64, 1) 18.0 vs 17.5.
WS_MIN_SEQS = 1


# The softmax sum of a tile kept per key lane ([BLOCK_N, BLOCK_H], `_tile_dots`' LAZY_L) and reduced across the warps
# once per split instead of once per tile: each tile then pays one cross-warp reduction (the max) instead of two.
# Changes the fp32 summation order of l only (outputs within a bf16 ulp or two of the per-tile sum's, so no longer
# bit-equal to the Triton kernel). TOKENSPEED_MLA_GLUON_LAZY_SUM ("0" / "1") overrides it at each call. H200, page
# 16, split + combine, cold L2, per-tile -> lazy (results/mla_gluon_lazy_{bf16,fp8}_2ab7dc7.json): bf16 batch 64 /
# 32K 674.9 -> 628.4 us (83.8 -> 90.0% of HBM), 16 / 64K 329.1 -> 315.1, verify 4 x 16 / 32K 504.9 -> 472.9, K3's
# 96 heads 16 / 32K 493.5 -> 466.3; fp8 64 / 32K 735.5 -> 668.6, verify 627.5 -> 579.5; batch 1 within +-1 us
# (128K 61.3 -> 60.9, fp8 72.4 -> 70.1; fp8 4K 16.8 -> 17.4).
LAZY_SUM = True
LAZY_SUM_ENV = "TOKENSPEED_MLA_GLUON_LAZY_SUM"

# The warp-specialized fp8 kernel's dots in fp8 (e4m3 wgmma) instead of on bf16 copies of the tile: the query rows
# quantised in the kernel (one scale a row: its largest magnitude to 448), S^T = K Q^T read straight from the fp8 key
# tile the copies land in (three buffers), p rounded to e4m3 after a scale of P_SCALE, and the 8-bit wgmma's
# K-major value operand (V^T [DV, BLOCK_N]) written by the producer warpgroup from its own copied bytes. Shared
# memory a tile falls from ~290 KB (bf16 staging) to ~170 KB. Not bit-equal to the bf16 dots: the query and p are
# rounded to e4m3 (3 mantissa bits). TOKENSPEED_MLA_GLUON_FP8_DOTS ("0" / "1") overrides it at each call.
FP8_DOTS = False
FP8_DOTS_ENV = "TOKENSPEED_MLA_GLUON_FP8_DOTS"
P_SCALE = 256.0  # p (<= 1) times this before its e4m3 rounding (<= 448), divided out of the output


def _switch(env: str, default: bool) -> bool:
    """The environment variable `env` ("0" / "1") when set, else `default`. Raises ValueError on another value."""
    v = os.environ.get(env, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{env} must be 0 or 1; got {v!r}")
    return v == "1" if v else default


def enabled() -> bool:
    """ENABLED, or TOKENSPEED_MLA_GLUON when set. Raises ValueError on a value other than 0 / 1."""
    return _switch(ENV, ENABLED)


def ws_fp8() -> bool:
    """WS_FP8, or TOKENSPEED_MLA_GLUON_WS when set. Raises ValueError on a value other than 0 / 1."""
    return _switch(WS_ENV, WS_FP8)


def lazy_sums() -> bool:
    """LAZY_SUM, or TOKENSPEED_MLA_GLUON_LAZY_SUM when set. Raises ValueError on a value other than 0 / 1."""
    return _switch(LAZY_SUM_ENV, LAZY_SUM)


def fp8_dots() -> bool:
    """FP8_DOTS, or TOKENSPEED_MLA_GLUON_FP8_DOTS when set. Raises ValueError on a value other than 0 / 1."""
    return _switch(FP8_DOTS_ENV, FP8_DOTS)


def warp_specialized(cache_dtype: torch.dtype, block_h: int, num_seqs: int) -> bool:
    """Whether `launch` takes the warp-specialized fp8 kernel: an fp8 cache, 16- or 32-row tiles (one consumer
    warpgroup), at least WS_MIN_SEQS sequences, and `ws_fp8()`."""
    return cache_dtype == torch.float8_e4m3fn and block_h <= 32 and num_seqs >= WS_MIN_SEQS and ws_fp8()


def default_block_h(q_rows: int, num_seqs: int) -> int:
    """Query rows per program for q_rows = Q * H rows a sequence in a batch of num_seqs: 16 or 32 when they fit,
    else 64 (WIDE_ROWS and num_seqs >= WIDE_MIN_SEQS) or 32."""
    if q_rows <= 32:
        return 16 if q_rows <= 16 else 32
    return 64 if WIDE_ROWS and num_seqs >= WIDE_MIN_SEQS else 32




def usable(q: Tensor, qr: Tensor, cache: Tensor, v_dim: int, block_n: int, balanced: bool) -> bool:
    """Whether `launch` can serve this `mla_decode` call (with a row tile of BLOCK_HS): Gluon of TRITON_VERSIONS
    and `enabled()`, an sm_90 GPU, q [N, Q, H, >= v_dim] / qr [N, Q, H, DR] bf16 and a bf16 (or, FP8_CACHE, fp8
    e4m3) cache, unit last strides and contiguous cache rows, Q 1 (or VERIFY), v_dim == DV, cache rows DV + DR
    wide, pages a multiple of BLOCK_N (or SMALL_PAGES), the balanced plan with BLOCK_N keys."""
    if not (q.is_cuda and _hopper(q.device) and enabled()):
        return False
    bf16 = q.dtype == qr.dtype == torch.bfloat16 and (
        cache.dtype == torch.bfloat16 or (FP8_CACHE and cache.dtype == torch.float8_e4m3fn))
    shapes = ((q.shape[1] == 1 or VERIFY) and v_dim == DV and q.shape[3] >= DV and qr.shape[-1] == DR
              and cache.shape[-1] == DV + DR and (cache.shape[1] % BLOCK_N == 0 or SMALL_PAGES))
    strides = q.stride(-1) == 1 and qr.stride(-1) == 1 and cache.stride(2) == 1 and cache.stride(1) == DV + DR
    return bool(bf16 and shapes and strides and balanced and block_n == BLOCK_N)


def launch(q: Tensor, qr: Tensor, cache: Tensor, page_table: Tensor, kv_lens: Tensor, out: Tensor, part: Tensor,
           lse: Tensor, max_splits: int, min_chunk: int, sm_scale_log2: float, kv_scale: float, block_h: int,
           block_seq: int, all_partial: bool, pdl_kwargs: dict) -> None:
    """The split grid (ceil(Q * H / block_h), max_splits, N) over validated arguments (`usable` True; shapes as
    `mla_decode._launch` allocates them). pdl_kwargs: `pdl.kernel_kwargs` ({"PDL": bool[, "launch_pdl": True]})."""
    N, QN, H = q.shape[:3]
    ws = warp_specialized(cache.dtype, block_h, N)
    if ws and WS_MAXNREG:
        pdl_kwargs = {**pdl_kwargs, "maxnreg": WS_MAXNREG}
    _mla_split_gluon_kernel[(triton.cdiv(QN * H, block_h), max_splits, N)](
        q, q.stride(0), q.stride(1), q.stride(2), qr, qr.stride(0), qr.stride(1), qr.stride(2),
        cache, cache.stride(0), page_table, page_table.stride(0), kv_lens,
        out, part, lse, N, max_splits, min_chunk, sm_scale_log2, kv_scale,
        QN=QN, H=H, PAGE=cache.shape[1], DV=DV, ROW=DV + DR, BLOCK_H=block_h, BLOCK_N=BLOCK_N, BLOCK_SEQ=block_seq,
        ALL_PARTIAL=all_partial, KV_BYTES=cache.element_size(), WS=ws, WS_REGS=WS_PRODUCER_REGS, LAZY_L=lazy_sums(),
        F8D=ws and fp8_dots(), P_SCALE=P_SCALE,
        num_warps=4 * triton.cdiv(block_h, 32), **pdl_kwargs)


if gluon is not None:
    from tokenspeed.ops.triton.gluon_common import grid_dependency as _grid_dependency

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _uniform(x):
        """x (an integer scalar the same in every thread) read from lane 0 as int32: ptxas then keeps it in a
        uniform register (`mla_split_plan._warp_uniform`)."""
        return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r",
                                         [x.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _tile_pages(pt_row, k0, hi, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, LKV: gl.constexpr,
                    LKR: gl.constexpr):
        """The pages of keys k0 .. k0 + BLOCK_N - 1 (0 past hi) for `_issue_tile`, as int64: one scalar, twice,
        when PAGE is a multiple of BLOCK_N (the plan starts every split at a multiple of BLOCK_N, so a tile lies in
        one page), else one per key row, in the row layouts of the latent and of the rope copies."""
        if PAGE % BLOCK_N == 0:
            page = gl.load(pt_row + k0 // PAGE, mask=k0 < hi, other=0).to(gl.int64)
            return page, page
        else:
            r_kv = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LKV))
            r_kr = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LKR))
            return (gl.load(pt_row + r_kv // PAGE, mask=r_kv < hi, other=0).to(gl.int64),
                    gl.load(pt_row + r_kr // PAGE, mask=r_kr < hi, other=0).to(gl.int64))

    @gluon.jit
    def _issue_tile(kv_bufs, kr_bufs, buf, CACHE, pages, stride_cp, k0, hi, PAGE: gl.constexpr, DV: gl.constexpr,
                    ROW: gl.constexpr, BLOCK_N: gl.constexpr, LKV: gl.constexpr, LKR: gl.constexpr):
        """cp.async of keys k0 .. k0 + BLOCK_N - 1 (pages: `_tile_pages`) into buffer `buf` (rows from hi on
        zero-filled); one commit group."""
        p_kv, p_kr = pages
        r_kv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LKV))
        c_kv = gl.arange(0, DV, layout=gl.SliceLayout(0, LKV))
        r_kr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LKR))
        c_kr = gl.arange(0, ROW - DV, layout=gl.SliceLayout(0, LKR))
        if PAGE % BLOCK_N == 0:  # one page: compile-time row offsets from its base
            base = CACHE + p_kv * stride_cp + (k0 % PAGE) * ROW
            rows_kv = base + r_kv * ROW
            rows_kr = base + DV + r_kr * ROW
        else:  # a page per row
            rows_kv = CACHE + p_kv * stride_cp + ((k0 + r_kv) % PAGE) * ROW
            rows_kr = CACHE + DV + p_kr * stride_cp + ((k0 + r_kr) % PAGE) * ROW
        cp.async_copy_global_to_shared(kv_bufs.index(buf), rows_kv[:, None] + c_kv[None, :],
                                       mask=(k0 + r_kv < hi)[:, None])
        cp.async_copy_global_to_shared(kr_bufs.index(buf), rows_kr[:, None] + c_kr[None, :],
                                       mask=(k0 + r_kr < hi)[:, None])
        cp.commit_group()

    @gluon.jit
    def _plan(KV_LENS, N, MAX_SPLITS, min_chunk, pid_n, pid_s, BLOCK_SEQ: gl.constexpr, BLOCK_N: gl.constexpr,
              LSEQ: gl.constexpr):
        """(n, kv_len, count, start, chunk, s) of slot (pid_n, pid_s) in the balanced plan of
        `mla_split_plan._plan_balanced` (the same integer arithmetic), warp-uniform."""
        idx = gl.arange(0, BLOCK_SEQ, layout=LSEQ)
        lens = gl.maximum(gl.load(KV_LENS + idx, mask=idx < N, other=0).to(gl.int64), 0)
        total = gl.sum(lens, axis=0)
        denom = gl.maximum(N * MAX_SPLITS - N, 1)
        chunk = gl.maximum((total + denom - 1) // denom, min_chunk)
        chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        counts = (lens + chunk - 1) // chunk
        starts = gl.associative_scan(counts, 0, _add) - counts
        p = pid_n * MAX_SPLITS + pid_s
        n = gl.minimum(gl.sum((starts + counts <= p).to(gl.int64), axis=0), N - 1)
        kv_len = _uniform(gl.sum(gl.where(idx == n, lens, 0), axis=0)).to(gl.int64)
        count = _uniform(gl.sum(gl.where(idx == n, counts, 0), axis=0)).to(gl.int64)
        start = _uniform(gl.sum(gl.where(idx == n, starts, 0), axis=0)).to(gl.int64)
        chunk = _uniform(chunk).to(gl.int64)
        n = _uniform(n).to(gl.int64)
        return n, kv_len, count, start, chunk, p - start

    @gluon.jit
    def _fp8_to_bf16(x):
        """e4m3 -> bf16, exact, through fp32: on sm_90 two e4m3 -> f16x2 unpacks a pair, HADD2.F32 widens each
        half and F2FP packs two fp32 into bf16x2, all full-rate ALU work; the direct cast (f16 -> bf16 per element
        on F2F.BF16.F16, a quarter-rate unit) took 288 of them per thread and tile."""
        return x.to(gl.float32).to(gl.bfloat16)

    @gluon.jit
    def _stage_bf16(src_kv, src_kr, dst_kv, dst_kr, DV: gl.constexpr, LC: gl.constexpr, LCR: gl.constexpr):
        """An fp8 key tile (src_kv [BLOCK_N, DV], src_kr [BLOCK_N, DR] in shared memory) converted to bf16 (exact)
        into dst_kv / dst_kr, 128 columns at a time (64 fp8 values a thread in flight at 4 warps)."""
        for c in gl.static_range(DV // 128):
            dst_kv.slice(c * 128, 128, dim=1).store(_fp8_to_bf16(src_kv.slice(c * 128, 128, dim=1).load(LC)))
        dst_kr.store(_fp8_to_bf16(src_kr.load(LCR)))

    @gluon.jit
    def _scores(kv_s, kr_s, qv_s, qr_s, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr):
        """S^T = K Q^T of one key tile (kv_s [BLOCK_N, DV] / kr_s [BLOCK_N, DR] in shared memory), issued as
        wgmma (keys-major): the accumulator token, [BLOCK_N, BLOCK_H] fp32 once waited."""
        st = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA)
        st = warpgroup_mma(kv_s, qv_s.permute((1, 0)), st, is_async=True)
        return warpgroup_mma(kr_s, qr_s.permute((1, 0)), st, is_async=True)

    @gluon.jit
    def _softmax_tile(st, m_i, l_i, k0, hi, lim, sm_scale_log2, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                      MMA: gl.constexpr, LAZY_L: gl.constexpr):
        """The online softmax's step over one tile's scores st (keys k0 ..; CAUSAL: row r sees keys <= lim[r]):
        (p [BLOCK_N, BLOCK_H] fp32, alpha [BLOCK_H] (the rescale of the output so far), m, l)."""
        pos = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        if CAUSAL:
            seen = (pos < hi)[:, None] & (pos[:, None] <= lim[None, :])
        else:
            seen = (pos < hi)[:, None]
        st = gl.where(seen, st * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(st, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        pt = gl.exp2(st - m_safe[None, :])
        if LAZY_L:
            l_i = l_i * alpha[None, :] + pt
        else:
            l_i = l_i * alpha + gl.sum(pt, axis=0)
        return pt, alpha, m_new, l_i

    @gluon.jit
    def _tile_dots(kv_s, kr_s, qv_s, qr_s, p_s, acc_t, m_i, l_i, k0, hi, lim, sm_scale_log2, BLOCK_H: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MMA: gl.constexpr, LAZY_L: gl.constexpr):
        """One key tile (kv_s [BLOCK_N, DV] / kr_s [BLOCK_N, DR] bf16 in shared memory, keys k0 ..) into the online
        softmax: the scores S^T = K Q^T (wgmma, keys-major), p through p_s, acc_t += V^T P^T. Returns (acc_t, m_i,
        l_i); the tile's buffers and p_s are free once it returns (both wgmma waited). LAZY_L: l_i is the
        [BLOCK_N, BLOCK_H] running sum of p per key lane (`_row_sums` reduces it once, after the last tile), so the
        tile pays one cross-warp reduction (the max) instead of two; else l_i [BLOCK_H]."""
        st = warpgroup_mma_wait(0, deps=[_scores(kv_s, kr_s, qv_s, qr_s, BLOCK_H, BLOCK_N, MMA)])
        pt, alpha, m_new, l_i = _softmax_tile(st, m_i, l_i, k0, hi, lim, sm_scale_log2, BLOCK_N, CAUSAL, MMA, LAZY_L)
        p_s.store(pt.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # every warp's rows of p before the warpgroup's wgmma reads them
        acc_t = warpgroup_mma(kv_s.permute((1, 0)), p_s, acc_t * alpha[None, :], is_async=True)
        acc_t = warpgroup_mma_wait(0, deps=[acc_t])
        return acc_t, m_new, l_i

    @gluon.jit
    def _zero_sums(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr, LAZY_L: gl.constexpr):
        """The online softmax's initial sum l for `_tile_dots`: [BLOCK_N, BLOCK_H] with LAZY_L, else [BLOCK_H]."""
        if LAZY_L:
            return gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA)
        else:
            return gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(0, MMA))

    @gluon.jit
    def _row_sums(l_i, LAZY_L: gl.constexpr):
        """l [BLOCK_H] from `_tile_dots`' running sum (summed over the key lanes with LAZY_L)."""
        if LAZY_L:
            return gl.sum(l_i, axis=0)
        else:
            return l_i

    @gluon.jit
    def _flash_tiles(qv_s, qr_s, kv_bufs, kr_bufs, st_kv, st_kr, p_s, CACHE, stride_cp, pt_row, lo, hi, lim,
                     sm_scale_log2, BLOCK_H: gl.constexpr, PAGE: gl.constexpr, DV: gl.constexpr, ROW: gl.constexpr,
                     BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr, LKV: gl.constexpr,
                     LKR: gl.constexpr, LC: gl.constexpr, LCR: gl.constexpr, MMA: gl.constexpr,
                     LAZY_L: gl.constexpr):
        """Online softmax over keys lo .. hi - 1 (CAUSAL: row r sees keys <= lim[r]): (acc [DV, BLOCK_H] fp32
        unnormalised, m [BLOCK_H], l [BLOCK_H]) in log2 units. Tile i+1's copy is issued before tile i's dots;
        each buffer is refilled only after every warp left it."""
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
        l_i = _zero_sums(BLOCK_H, BLOCK_N, MMA, LAZY_L)
        acc_t = gl.zeros([DV, BLOCK_H], gl.float32, MMA)
        _issue_tile(kv_bufs, kr_bufs, 0, CACHE, _tile_pages(pt_row, lo, hi, PAGE, BLOCK_N, LKV, LKR), stride_cp,
                    lo, hi, PAGE, DV, ROW, BLOCK_N, LKV, LKR)
        page_next = _tile_pages(pt_row, lo + BLOCK_N, hi, PAGE, BLOCK_N, LKV, LKR)  # read one tile ahead
        for i in range((hi - lo + BLOCK_N - 1) // BLOCK_N):
            k0 = lo + i * BLOCK_N
            nxt = k0 + BLOCK_N
            if nxt < hi:  # the next tile's copy starts before this tile's dots (its buffer was freed last time)
                _issue_tile(kv_bufs, kr_bufs, (i + 1) % 2, CACHE, page_next, stride_cp, nxt, hi, PAGE, DV, ROW,
                            BLOCK_N, LKV, LKR)
                cp.wait_group(1)
            else:
                cp.wait_group(0)
            page_next = _tile_pages(pt_row, nxt + BLOCK_N, hi, PAGE, BLOCK_N, LKV, LKR)
            fence_async_shared()  # this thread's cp.async writes, visible to wgmma's async proxy ...
            gl.thread_barrier()  # ... and every thread's
            if FP8:  # the dots read the tile converted to bf16 (st_kv / st_kr: free since the last iteration's end)
                _stage_bf16(kv_bufs.index(i % 2), kr_bufs.index(i % 2), st_kv, st_kr, DV, LC, LCR)
                fence_async_shared()
                gl.thread_barrier()
                kv_s = st_kv
                kr_s = st_kr
            else:
                kv_s = kv_bufs.index(i % 2)
                kr_s = kr_bufs.index(i % 2)
            acc_t, m_i, l_i = _tile_dots(kv_s, kr_s, qv_s, qr_s, p_s, acc_t, m_i, l_i, k0, hi, lim, sm_scale_log2,
                                         BLOCK_H, BLOCK_N, CAUSAL, MMA, LAZY_L)
            gl.thread_barrier()  # every warp is done with buffer i % 2 before iteration i + 1 refills it
        return acc_t, m_i, _row_sums(l_i, LAZY_L)

    @gluon.jit
    def _issue_fp8_chunk(ring, c: gl.constexpr, CACHE, pages, stride_cp, k0, hi, PAGE: gl.constexpr,
                         DV: gl.constexpr, ROW: gl.constexpr, BLOCK_N: gl.constexpr, LP: gl.constexpr,
                         LPR: gl.constexpr):
        """cp.async of chunk c of keys k0 .. k0 + BLOCK_N - 1 (c < 4: latent columns 128 c .. 128 c + 127 into
        ring slot c; c = 4: the rope columns into `ring`'s last slot view) with rows from hi on zero-filled, not
        read; one commit group. Every thread copies the 16-byte pieces it later reads itself (layout LP / LPR)."""
        p_kv, p_kr = pages
        if c < 4:
            r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LP))
            cols = c * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LP))
            if PAGE % BLOCK_N == 0:
                rows = CACHE + p_kv * stride_cp + (k0 % PAGE) * ROW + r * ROW
            else:
                rows = CACHE + p_kv * stride_cp + ((k0 + r) % PAGE) * ROW
            cp.async_copy_global_to_shared(ring.index(c), rows[:, None] + cols[None, :], mask=(k0 + r < hi)[:, None])
        else:
            rr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LPR))
            cr = DV + gl.arange(0, ROW - DV, layout=gl.SliceLayout(0, LPR))
            if PAGE % BLOCK_N == 0:
                rows_r = CACHE + p_kr * stride_cp + (k0 % PAGE) * ROW + rr * ROW
            else:
                rows_r = CACHE + p_kr * stride_cp + ((k0 + rr) % PAGE) * ROW
            cp.async_copy_global_to_shared(ring.index(4).slice(0, ROW - DV, dim=1), rows_r[:, None] + cr[None, :],
                                           mask=(k0 + rr < hi)[:, None])
        cp.commit_group()

    @gluon.jit
    def _fp8_producer(CACHE, stride_cp, pt_row, lo, hi, st_kv, st_kr, ring, full, empty, PAGE: gl.constexpr,
                      DV: gl.constexpr, ROW: gl.constexpr, BLOCK_N: gl.constexpr):
        """The worker partition (4 warps): for each key tile i of lo .. hi - 1, wait until staging buffer i % 2 is
        empty, convert the tile (fp8 in `ring`, five chunks: the latent's four 128-column slices and the rope
        part) to bf16 (exact) into it and arrive on its `full` barrier. A chunk's slot is refilled with tile
        i + 1's chunk right after its conversion, so the whole next tile is in flight while this partition waits;
        each thread reads only the bytes it copied (no barrier between copies and reads), pages one tile ahead."""
        gl.static_assert(DV == 512, "the producer converts the latent as four 128-column chunks")
        LP: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])   # [BLOCK_N, 128] fp8 chunks
        LPR: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [BLOCK_N, DR]
        pages = _tile_pages(pt_row, lo, hi, PAGE, BLOCK_N, LP, LPR)
        for c in gl.static_range(5):
            _issue_fp8_chunk(ring, c, CACHE, pages, stride_cp, lo, hi, PAGE, DV, ROW, BLOCK_N, LP, LPR)
        pages = _tile_pages(pt_row, lo + BLOCK_N, hi, PAGE, BLOCK_N, LP, LPR)
        for i in range((hi - lo + BLOCK_N - 1) // BLOCK_N):
            nxt = lo + (i + 1) * BLOCK_N  # past hi every copy is masked off: zero-fill, no traffic
            b = i % 2
            mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)  # barriers start with phase 1 complete
            for c in gl.static_range(5):
                cp.wait_group(4)  # chunk c of tile i (the four later groups are younger)
                if c < 4:
                    v = ring.index(c).load(LP)
                    st_kv.index(b).slice(c * 128, 128, dim=1).store(_fp8_to_bf16(v))
                else:
                    v = ring.index(4).slice(0, ROW - DV, dim=1).load(LPR)
                    st_kr.index(b).store(_fp8_to_bf16(v))
                # issued after the store that consumed v, so the slot's old bytes were read
                _issue_fp8_chunk(ring, c, CACHE, pages, stride_cp, nxt, hi, PAGE, DV, ROW, BLOCK_N, LP, LPR)
            pages = _tile_pages(pt_row, nxt + BLOCK_N, hi, PAGE, BLOCK_N, LP, LPR)
            fence_async_shared()  # the generic stores, before the consumer's wgmma (async proxy) reads them
            gl.thread_barrier()  # every producer thread's stores before the single arrive
            mbarrier.arrive(full.index(b), count=1)
        cp.wait_group(0)  # the masked copies past the end, before the partition exits

    @gluon.jit
    def _fp8_consumer(qv_s, qr_s, st_kv, st_kr, p_s, full, empty, lo, hi, lim, sm_scale_log2,
                      BLOCK_H: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                      MMA: gl.constexpr, LAZY_L: gl.constexpr):
        """The default partition (the kernel's warpgroup): `_flash_tiles`' online softmax over the bf16 tiles the
        producer stages, buffer i % 2 for tile i, handed back through its `empty` barrier once both dots are done."""
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
        l_i = _zero_sums(BLOCK_H, BLOCK_N, MMA, LAZY_L)
        acc_t = gl.zeros([DV, BLOCK_H], gl.float32, MMA)
        for i in range((hi - lo + BLOCK_N - 1) // BLOCK_N):
            b = i % 2
            mbarrier.wait(full.index(b), (i // 2) & 1)
            acc_t, m_i, l_i = _tile_dots(st_kv.index(b), st_kr.index(b), qv_s, qr_s, p_s, acc_t, m_i, l_i,
                                         lo + i * BLOCK_N, hi, lim, sm_scale_log2, BLOCK_H, BLOCK_N, CAUSAL, MMA,
                                         LAZY_L)
            gl.thread_barrier()  # every warp's wgmma done with buffer b (and p_s) before it is handed back
            mbarrier.arrive(empty.index(b), count=1)
        return acc_t, m_i, _row_sums(l_i, LAZY_L)

    @gluon.jit
    def _issue_fp8_tile(k8, kr8, slot, CACHE, pages, stride_cp, k0, hi, PAGE: gl.constexpr, DV: gl.constexpr,
                        ROW: gl.constexpr, BLOCK_N: gl.constexpr, LP: gl.constexpr, LPR: gl.constexpr):
        """F8D: cp.async of keys k0 .. k0 + BLOCK_N - 1 (rows from hi on zero-filled, not read) straight into key
        buffer `slot` (k8 [., BLOCK_N, DV] / kr8 [., BLOCK_N, DR] fp8, the S dot's operand), the latent in four
        128-column chunks of layout LP (the bytes each thread later reads back itself), the rope part in LPR; one
        commit group."""
        p_kv, p_kr = pages
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LP))
        rr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LPR))
        if PAGE % BLOCK_N == 0:
            rows = CACHE + p_kv * stride_cp + (k0 % PAGE) * ROW + r * ROW
            rows_r = CACHE + p_kr * stride_cp + (k0 % PAGE) * ROW + rr * ROW
        else:
            rows = CACHE + p_kv * stride_cp + ((k0 + r) % PAGE) * ROW
            rows_r = CACHE + p_kr * stride_cp + ((k0 + rr) % PAGE) * ROW
        for c in gl.static_range(DV // 128):
            cols = c * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LP))
            cp.async_copy_global_to_shared(k8.index(slot).slice(c * 128, 128, dim=1), rows[:, None] + cols[None, :],
                                           mask=(k0 + r < hi)[:, None])
        cr = DV + gl.arange(0, ROW - DV, layout=gl.SliceLayout(0, LPR))
        cp.async_copy_global_to_shared(kr8.index(slot), rows_r[:, None] + cr[None, :], mask=(k0 + rr < hi)[:, None])
        cp.commit_group()

    @gluon.jit
    def _f8d_producer(CACHE, stride_cp, pt_row, lo, hi, k8, kr8, vt8, full, empty, PAGE: gl.constexpr,
                      DV: gl.constexpr, ROW: gl.constexpr, BLOCK_N: gl.constexpr):
        """F8D's worker partition (4 warps). Tile i's keys go to key buffer i % 3, its transposed latent to value
        buffer i % 2 (vt8 [2, DV, BLOCK_N]): at iteration i, once the consumer has handed back tile i - 2 (its
        `empty` barrier: key buffer (i + 1) % 3 and value buffer i % 2 free), issue tile i + 1's copy, wait for
        tile i's, write its latent transposed (each thread reads only the bytes it copied: a [4 keys, 16 columns]
        block a chunk row, stored as 16 rows of 4 keys) and arrive on `full`. Two tiles are in flight while the
        consumer runs one."""
        gl.static_assert(DV % 128 == 0, "the latent is copied and transposed in 128-column chunks")
        gl.static_assert(BLOCK_N == 64, "a chunk's layout covers 64 keys")
        LP: gl.constexpr = gl.BlockedLayout([4, 16], [16, 2], [1, 4], [1, 0])  # [BLOCK_N, 128] fp8 chunks
        LPR: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [BLOCK_N, DR]
        _issue_fp8_tile(k8, kr8, 0, CACHE, _tile_pages(pt_row, lo, hi, PAGE, BLOCK_N, LP, LPR), stride_cp, lo, hi,
                        PAGE, DV, ROW, BLOCK_N, LP, LPR)
        pages = _tile_pages(pt_row, lo + BLOCK_N, hi, PAGE, BLOCK_N, LP, LPR)
        for i in range((hi - lo + BLOCK_N - 1) // BLOCK_N):
            nxt = lo + (i + 1) * BLOCK_N  # past hi every copy is masked off: zero-fill, no traffic
            b = i % 2
            mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)  # tile i - 2 handed back (barriers start phase-1 done)
            _issue_fp8_tile(k8, kr8, (i + 1) % 3, CACHE, pages, stride_cp, nxt, hi, PAGE, DV, ROW, BLOCK_N, LP, LPR)
            pages = _tile_pages(pt_row, nxt + BLOCK_N, hi, PAGE, BLOCK_N, LP, LPR)
            cp.wait_group(1)  # tile i (the younger group is tile i + 1)
            for c in gl.static_range(DV // 128):
                v = k8.index(i % 3).slice(c * 128, 128, dim=1).load(LP)
                vt8.index(b).slice(c * 128, 128, dim=0).store(gl.permute(v, (1, 0)))
            fence_async_shared()  # the copies and the stores, before the consumer's wgmma (async proxy) reads them
            gl.thread_barrier()  # every producer thread's, before the single arrive
            mbarrier.arrive(full.index(b), count=1)
        cp.wait_group(0)  # the masked copies past the end, before the partition exits

    @gluon.jit
    def _f8d_pv(vt_s, p_s, acc_t, pt, alpha, P_SCALE: gl.constexpr):
        """F8D's output wgmma, issued: p * P_SCALE rounded to e4m3 into p_s [BLOCK_H, BLOCK_N] (the K-major B
        operand; after every warp's rows are stored), acc_t * alpha + V^T P^T with V^T = vt_s [DV, BLOCK_N]."""
        p_s.store(gl.permute((pt * P_SCALE).to(p_s.dtype), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()  # every warp's rows of p before the warpgroup's wgmma reads them
        return warpgroup_mma(vt_s, p_s.permute((1, 0)), acc_t * alpha[None, :], is_async=True)

    @gluon.jit
    def _f8d_consumer(qv_s, qr_s, k8, kr8, vt8, p_s, col_scale, full, empty, lo, hi, lim, BLOCK_H: gl.constexpr,
                      DV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MMA: gl.constexpr,
                      LAZY_L: gl.constexpr, P_SCALE: gl.constexpr):
        """F8D's default partition: the online softmax over tile i, S^T = K Q^T from key buffer i % 3 and the
        quantised queries (col_scale [BLOCK_H]: each row's query scale times sm_scale_log2), acc += V^T P^T from
        value buffer i % 2, handed back through `empty` once both dots are done. Returns (acc [DV, BLOCK_H] times
        P_SCALE, m, l)."""
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
        l_i = _zero_sums(BLOCK_H, BLOCK_N, MMA, LAZY_L)
        acc_t = gl.zeros([DV, BLOCK_H], gl.float32, MMA)
        scale = col_scale[None, :]
        for i in range((hi - lo + BLOCK_N - 1) // BLOCK_N):
            b = i % 2
            mbarrier.wait(full.index(b), (i // 2) & 1)
            st = warpgroup_mma_wait(0, deps=[_scores(k8.index(i % 3), kr8.index(i % 3), qv_s, qr_s, BLOCK_H, BLOCK_N,
                                                     MMA)])
            pt, alpha, m_i, l_i = _softmax_tile(st, m_i, l_i, lo + i * BLOCK_N, hi, lim, scale, BLOCK_N, CAUSAL, MMA,
                                                LAZY_L)
            acc_t = warpgroup_mma_wait(0, deps=[_f8d_pv(vt8.index(b), p_s, acc_t, pt, alpha, P_SCALE)])
            gl.thread_barrier()  # every warp's wgmma done with the tile's buffers (and p_s) before the hand-back
            mbarrier.arrive(empty.index(b), count=1)
        return acc_t, m_i, _row_sums(l_i, LAZY_L)

    @gluon.jit
    def _quantize_rows(q_v, q_r):
        """Rows of (q_v [BLOCK_H, DV], q_r [BLOCK_H, DR]) (one layout) as e4m3 with one scale a row (its largest
        magnitude over both to 448; 1 for a zero row): (q8_v, q8_r, scale [BLOCK_H] fp32)."""
        qf = q_v.to(gl.float32)
        rf = q_r.to(gl.float32)
        amax = gl.maximum(gl.max(gl.abs(qf), axis=1), gl.max(gl.abs(rf), axis=1))
        scale = gl.where(amax > 0, amax / 448.0, 1.0)
        inv = 1.0 / scale
        return ((qf * inv[:, None]).to(gl.float8e4nv), (rf * inv[:, None]).to(gl.float8e4nv), scale)

    @gluon.jit
    def _store_rows(PTR, base, o, rows, d, QH: gl.constexpr, DV: gl.constexpr, EVEN: gl.constexpr):
        """o [DV, BLOCK_H] at rows base + rows (those < QH unless EVEN) of a [., DV] buffer, cast to its dtype."""
        ptr = PTR + (base + rows[None, :]) * DV + d[:, None]
        if EVEN:
            gl.store(ptr, o.to(PTR.dtype.element_ty))
        else:
            gl.store(ptr, o.to(PTR.dtype.element_ty), mask=(rows < QH)[None, :])

    @gluon.jit
    def _store_partial(PART, LSE, prow, o, m_i, l_i, rows, d, row0, QH: gl.constexpr, DV: gl.constexpr,
                       BLOCK_H: gl.constexpr, EVEN: gl.constexpr, MMA: gl.constexpr):
        """A split's normalised rows o [DV, BLOCK_H] fp32 at PART rows prow + rows, its log2 LSE at LSE."""
        _store_rows(PART, prow, o, rows, d, QH, DV, EVEN)
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        r = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, MMA))
        if EVEN:
            gl.store(LSE + prow + r, lse)
        else:
            gl.store(LSE + prow + r, lse, mask=r < QH)

    @gluon.jit
    def _load_queries(Qp, stride_qn, stride_qj, stride_qh, n, row0, QH: gl.constexpr, H: gl.constexpr,
                      WIDTH: gl.constexpr, BLOCK_H: gl.constexpr, EVEN: gl.constexpr, LQ: gl.constexpr):
        """Rows row0 .. row0 + BLOCK_H - 1 of sequence n's [QN * H, WIDTH] queries (row = j * H + h; rows past QH
        zero unless EVEN)."""
        r = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        ptr = (Qp + n * stride_qn + ((r // H) * stride_qj + (r % H) * stride_qh)[:, None]
               + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LQ))[None, :])
        if EVEN:
            return gl.load(ptr)
        else:
            return gl.load(ptr, mask=(r < QH)[:, None], other=0.0)

    @gluon.jit(do_not_specialize=["N", "MAX_SPLITS", "min_chunk", "stride_pt"])
    def _mla_split_gluon_kernel(
        Qp, stride_qn, stride_qj, stride_qh,
        QR, stride_rn, stride_rj, stride_rh,
        CACHE, stride_cp,
        PT, stride_pt,
        KV_LENS,
        O, PART, LSE,
        N, MAX_SPLITS, min_chunk, sm_scale_log2, kv_scale,
        QN: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr, DV: gl.constexpr, ROW: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SEQ: gl.constexpr, ALL_PARTIAL: gl.constexpr,
        KV_BYTES: gl.constexpr, WS: gl.constexpr, WS_REGS: gl.constexpr, PDL: gl.constexpr,
        LAZY_L: gl.constexpr = False, F8D: gl.constexpr = False, P_SCALE: gl.constexpr = 256.0,
    ):
        DR: gl.constexpr = ROW - DV
        gl.static_assert(WS or not F8D, "the fp8 dots are a form of the warp-specialized kernel (WS)")
        QH: gl.constexpr = QN * H
        EVEN: gl.constexpr = QH % BLOCK_H == 0
        # One warpgroup (4 warps) per 32 rows, at least one: with two, each owns half of the rows (the dots' N) and
        # both read the same key buffers.
        WG: gl.constexpr = (BLOCK_H + 31) // 32
        NW: gl.constexpr = 4 * WG
        FP8: gl.constexpr = KV_BYTES == 1
        VEC: gl.constexpr = 16 // KV_BYTES  # cache elements per 16-byte copy
        LKV: gl.constexpr = gl.BlockedLayout([1, VEC], [2, 16], [NW, 1], [1, 0])   # [BLOCK_N, DV] tile copies
        LKR: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // DR, DR // VEC], [NW, 1], [1, 0])  # [., DR]
        LC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])      # fp8 -> bf16 staging, [., 128]
        LCR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])      # ... [., DR]
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])      # [BLOCK_H, DV] / [., DR] queries
        LSEQ: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])                # the plan's [BLOCK_SEQ] vectors
        MMA_K: gl.constexpr = 32 if F8D else 16  # the wgmma's K: 32 for 8-bit operands
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BLOCK_H // WG, MMA_K])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SH8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        SH8R: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=DR, element_bitwidth=8, rank=2)
        SH_P: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BLOCK_H, element_bitwidth=16, rank=2)
        RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])  # WS: the producer's own 16-byte pieces
        LOUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NW], [0, 1])    # [DV, BLOCK_H] fp32, d fastest

        row0 = gl.program_id(0) * BLOCK_H
        pid_s = gl.program_id(1)
        pid_n = gl.program_id(2).to(gl.int64)
        if PDL:  # everything read below may come from the kernels just before this one
            _grid_dependency(pid_s)
        n, kv_len, count, start, chunk, s = _plan(KV_LENS, N, MAX_SPLITS, min_chunk, pid_n, pid_s, BLOCK_SEQ,
                                                  BLOCK_N, LSEQ)
        d = gl.arange(0, DV, layout=gl.SliceLayout(1, LOUT))
        rows = row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, LOUT))
        if not ALL_PARTIAL:  # with ALL_PARTIAL the W_UV combine writes the padding sequences' zeros
            own_len = gl.load(KV_LENS + pid_n).to(gl.int64)
            if (pid_s == 0) & (own_len <= 0):  # a padding sequence: zeros
                _store_rows(O, pid_n * QH, gl.zeros([DV, BLOCK_H], gl.float32, LOUT), rows, d, QH, DV, EVEN)
        if s < count:
            lo = (s * chunk).to(gl.int32)
            hi = gl.minimum(lo + chunk, kv_len).to(gl.int32)
            q_v = _load_queries(Qp, stride_qn, stride_qj, stride_qh, n, row0, QH, H, DV, BLOCK_H, EVEN, LQ)
            q_r = _load_queries(QR, stride_rn, stride_rj, stride_rh, n, row0, QH, H, DR, BLOCK_H, EVEN, LQ)
            if F8D:  # e4m3 query rows (one scale a row, applied to the scores) and fp8 key / value buffers
                q8_v, q8_r, q_scale = _quantize_rows(q_v, q_r)
                qv_s = gl.allocate_shared_memory(CACHE.dtype.element_ty, [BLOCK_H, DV], SH8, q8_v)
                qr_s = gl.allocate_shared_memory(CACHE.dtype.element_ty, [BLOCK_H, DR], SH8R, q8_r)
                col_scale = gl.convert_layout(q_scale, gl.SliceLayout(0, MMA)) * sm_scale_log2
            else:
                qv_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DV], SH, q_v)
                qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DR], SH, q_r)
            if F8D:  # three key buffers (the S operand, filled by the copies), two transposed latents (V^T)
                kv_bufs = gl.allocate_shared_memory(CACHE.dtype.element_ty, [3, BLOCK_N, DV], SH8)
                kr_bufs = gl.allocate_shared_memory(CACHE.dtype.element_ty, [3, BLOCK_N, DR], SH8R)
                vt8 = gl.allocate_shared_memory(CACHE.dtype.element_ty, [2, DV, BLOCK_N], SH8R)
            elif WS:  # two bf16 staging buffers the producer partition fills, and its fp8 ring (five chunk slots)
                kv_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DV], SH)
                kr_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DR], SH)
                ring = gl.allocate_shared_memory(CACHE.dtype.element_ty, [5, BLOCK_N, 128], RING)
            elif FP8:  # fp8 copy buffers, and one bf16 tile the dots read
                kv_bufs = gl.allocate_shared_memory(CACHE.dtype.element_ty, [2, BLOCK_N, DV], SH8)
                kr_bufs = gl.allocate_shared_memory(CACHE.dtype.element_ty, [2, BLOCK_N, DR], SH8R)
                st_kv = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, DV], SH)
                st_kr = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, DR], SH)
            else:
                kv_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DV], SH)
                kr_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DR], SH)
                st_kv = kv_bufs  # unused
                st_kr = kr_bufs
            if F8D:  # p^T as e4m3 [BLOCK_H, BLOCK_N]: the 8-bit wgmma's K-major B operand
                p_s = gl.allocate_shared_memory(CACHE.dtype.element_ty, [BLOCK_H, BLOCK_N], SH8R)
            else:
                p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], SH_P)
            fence_async_shared()  # the queries' stores, before wgmma reads them (async proxy) ...
            gl.thread_barrier()  # ... from every warp
            # the last key row r = j * H + h sees (verify: token j of QN sees the keys up to its own position)
            lim = kv_len - QN + (row0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, MMA))) // H
            if WS:  # (F8D is a form of the warp-specialized kernel)
                full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
                empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
                for b in gl.static_range(2):
                    mbarrier.init(full.index(b), count=1)
                    mbarrier.init(empty.index(b), count=1)
                gl.thread_barrier()  # the barriers' initialisation before either partition uses them
            if F8D:
                acc_t, m_i, l_i = gl.warp_specialize([
                    (_f8d_consumer, (qv_s, qr_s, kv_bufs, kr_bufs, vt8, p_s, col_scale, full, empty, lo, hi, lim,
                                     BLOCK_H, DV, BLOCK_N, QN > 1, MMA, LAZY_L, P_SCALE)),
                    (_f8d_producer, (CACHE, stride_cp, PT + n * stride_pt, lo, hi, kv_bufs, kr_bufs, vt8, full,
                                     empty, PAGE, DV, ROW, BLOCK_N)),
                ], [4], [WS_REGS])
            elif WS:
                acc_t, m_i, l_i = gl.warp_specialize([
                    (_fp8_consumer, (qv_s, qr_s, kv_bufs, kr_bufs, p_s, full, empty, lo, hi, lim, sm_scale_log2,
                                     BLOCK_H, DV, BLOCK_N, QN > 1, MMA, LAZY_L)),
                    (_fp8_producer, (CACHE, stride_cp, PT + n * stride_pt, lo, hi, kv_bufs, kr_bufs, ring, full,
                                     empty, PAGE, DV, ROW, BLOCK_N)),
                ], [4], [WS_REGS])
            else:
                acc_t, m_i, l_i = _flash_tiles(qv_s, qr_s, kv_bufs, kr_bufs, st_kv, st_kr, p_s, CACHE, stride_cp,
                                               PT + n * stride_pt, lo, hi, lim, sm_scale_log2, BLOCK_H, PAGE, DV,
                                               ROW, BLOCK_N, QN > 1, FP8, LKV, LKR, LC, LCR, MMA, LAZY_L)
            # the epilogue of `mla_flash._store_rows`: normalised rows, direct when the sequence has one split
            o_scale = kv_scale / P_SCALE if F8D else kv_scale  # F8D's acc carries P_SCALE
            inv = gl.where(l_i > 0, o_scale / gl.where(l_i > 0, l_i, 1.0), 0.0)
            o = gl.convert_layout(acc_t * inv[None, :], LOUT)
            if ALL_PARTIAL:
                _store_partial(PART, LSE, (start + s) * QH, o, m_i, l_i, rows, d, row0, QH, DV, BLOCK_H, EVEN, MMA)
            elif count == 1:
                _store_rows(O, n * QH, o, rows, d, QH, DV, EVEN)
            else:
                _store_partial(PART, LSE, (start + s) * QH, o, m_i, l_i, rows, d, row0, QH, DV, BLOCK_H, EVEN, MMA)
