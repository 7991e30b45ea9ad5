"""Alignment of the routed experts' (token, slot) pairs by expert, the layout `moe_experts`' grouped GEMMs read.

Plain torch (`align_pairs`; no host synchronisation, every shape a function of (T, k, E) and BLOCK_M only): the
P = T*k pairs (pair p = t*k + j) are bucketed by expert (bucket E collects the invalid ids), stably sorted, and
each bucket's run is padded to a multiple of BLOCK_M. `sorted_pair_ids` [max_blocks * BLOCK_M] holds the pair of
each padded row (P for padding) and `block_expert` [max_blocks] the bucket of each BLOCK_M-row block (-1 for
unused blocks at the end), with max_blocks = P // BLOCK_M + min(E + 1, P): sum_b ceil(c_b / BLOCK_M) <=
sum_b (floor(c_b / BLOCK_M) + 1) over the non-empty buckets (a bound at least as tight as ceil(P/BM) + E).
Decode-sized calls (P <= 4096 pairs, E <= 2046) build the same layout in one single-program launch
(`align_pairs_fused`: per-chunk stable ranks from a pair-by-pair comparison plus running bucket counts), instead of
the dozen small torch kernels of the sort path, which cost more than the weight streaming at batch 1. Larger calls
(prefill chunks, E <= 2046) take `align_pairs_multi`: the same ranks over 1024-pair counting programs, one program's
prefix over programs and buckets, then the scatter (three launches, no host work between them; the torch path's
sort and its ~15 launches took 0.77 ms of host time per MoE layer under cProfile, in an H200 profile of a
1300-token step: `benchmarks/results/step_profile_tail64k_beside15_049266f.json`).

PDL (`tokenspeed.ops.triton.pdl`): on Hopper the fused alignment launches as a programmatic dependent and waits
first thing: its ids come from the launch right before it (the router), and its first act is a write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.moe_pdl import _pdl_sync


def align_pairs(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(sorted_pair_ids [max_blocks * block_m] int32, block_expert [max_blocks] int32), no host sync.

    Pair p = t * k + j. Bucket b = topk_ids[t, j] if it is in [0, E) else E (invalid ids). Each bucket's pairs
    (in pair order) fill ceil(c_b / block_m) consecutive blocks, buckets in increasing order; padding rows hold
    P = T * k; blocks past the last bucket have block_expert -1.
    """
    E = num_experts
    ids = topk_ids.reshape(-1)
    P = ids.numel()
    dev = ids.device
    max_blocks = P // block_m + min(E + 1, P)
    if ids.dtype != torch.int64:
        ids = ids.long()
    bucket = torch.where((ids >= 0) & (ids < E), ids, E)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    raw_start = torch.cumsum(counts, 0) - counts
    blocks = (counts + (block_m - 1)) // block_m
    blk_end = torch.cumsum(blocks, 0)
    blk_start = blk_end - blocks
    rank = torch.arange(P, device=dev) - raw_start[sorted_bucket]
    dest = blk_start[sorted_bucket] * block_m + rank
    sorted_pair_ids = torch.full((max_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(blk_end, torch.arange(max_blocks, device=dev), right=True)
    block_expert = torch.where(block_expert <= E, block_expert, -1).to(torch.int32)
    return sorted_pair_ids, block_expert


# The one-launch alignment serves up to this many (token, slot) pairs and this many buckets (decode and verify);
# larger calls (prefill chunks) take the torch sort.
FUSED_ALIGN_MAX_PAIRS = 4096
FUSED_ALIGN_MAX_BINS = 2048


@triton.jit
def _buckets(Ids, o, m, E):
    """Bucket of each pair o (masked lanes: m False): its expert id if in [0, E), else E (invalid ids)."""
    ids = tl.load(Ids + o, mask=m, other=-1)
    return tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)


@triton.jit
def _rank_chunk(Ids, Rank, Work, start, P, E, running, CHUNK: tl.constexpr, EB: tl.constexpr):
    """Stable in-bucket ranks of pairs start..start + CHUNK - 1 (one program): Rank[p] = running[bucket] (the pairs
    of earlier chunks) + the earlier pairs of this chunk in the same bucket, through the program's Work [EB]
    scratch. Returns running plus this chunk's bucket counts; masked lanes count in bin EB - 1 (> E)."""
    ci = tl.arange(0, CHUNK)
    o = start + ci
    m = o < P
    b = tl.where(m, _buckets(Ids, o, m, E), EB - 1)
    earlier_same = (b[:, None] == b[None, :]) & (ci[None, :] < ci[:, None])
    bins = tl.arange(0, EB)
    tl.store(Work + bins, running)
    tl.debug_barrier()
    base = tl.load(Work + b, cache_modifier=".cg")  # written by other threads of this program
    tl.debug_barrier()
    tl.store(Rank + o, base + tl.sum(earlier_same.to(tl.int32), axis=1), mask=m)
    return running + tl.histogram(b, EB)


@triton.jit
def _store_block_expert(BlockExpert, blk_end, E, max_blocks, EB: tl.constexpr, MB_CHUNK: tl.constexpr):
    """BlockExpert[i] = the bucket owning block i (its blocks end at blk_end [EB]), -1 past the last bucket."""
    bins = tl.arange(0, EB)
    end_real = tl.where(bins <= E, blk_end, 2**30)  # block i belongs to bucket #{b <= E : blk_end[b] <= i}
    for start in range(0, max_blocks, MB_CHUNK):
        i = start + tl.arange(0, MB_CHUNK)
        owner = tl.sum((end_real[None, :] <= i[:, None]).to(tl.int32), axis=1)
        tl.store(BlockExpert + i, tl.where(owner <= E, owner, -1), mask=i < max_blocks)


@triton.jit(do_not_specialize=["P", "n_rows", "max_blocks"])  # per-step counts: no recompile per value
def _align_kernel(
    Ids, SortedPair, BlockExpert, Rank, Work,
    P, E, n_rows, max_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    EB: tl.constexpr,
    MB_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`align_pairs` in one program: stable in-bucket ranks chunk by chunk (a [CHUNK, CHUNK] comparison plus the
    running per-bucket counts), then each pair's destination. Work [EB] and Rank [P] int32 are scratch; bin EB - 1
    (> E) collects the masked lanes and is ignored. PDL: wait for the ids' producer before anything."""
    _pdl_sync(PDL)
    for start in range(0, n_rows, CHUNK):
        o = start + tl.arange(0, CHUNK)
        tl.store(SortedPair + o, tl.zeros([CHUNK], dtype=tl.int32) + P, mask=o < n_rows)
    tl.debug_barrier()
    ci = tl.arange(0, CHUNK)
    bins = tl.arange(0, EB)
    running = tl.zeros([EB], dtype=tl.int32)
    for start in range(0, P, CHUNK):
        running = _rank_chunk(Ids, Rank, Work, start, P, E, running, CHUNK, EB)
    blocks = tl.where(bins <= E, (running + BLOCK_M - 1) // BLOCK_M, 0)
    blk_end = tl.cumsum(blocks, 0)
    tl.store(Work + bins, blk_end - blocks)
    tl.debug_barrier()
    for start in range(0, P, CHUNK):
        o = start + ci
        m = o < P
        b = _buckets(Ids, o, m, E)
        dest = (tl.load(Work + b, mask=m, other=0, cache_modifier=".cg") * BLOCK_M
                + tl.load(Rank + o, mask=m, other=0, cache_modifier=".cg"))
        tl.store(SortedPair + dest, o.to(tl.int32), mask=m)
    _store_block_expert(BlockExpert, blk_end, E, max_blocks, EB, MB_CHUNK)


def align_pairs_fused(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """`align_pairs` (same outputs, bit for bit) in a single launch, for P <= FUSED_ALIGN_MAX_PAIRS pairs and
    E + 2 <= FUSED_ALIGN_MAX_BINS: the decode path, where the torch version's dozen small kernels cost more than
    the GEMMs' launch."""
    E = num_experts
    ids = topk_ids.reshape(-1).contiguous()
    P = ids.numel()
    eb = triton.next_power_of_2(E + 2)
    if not fused_align_fits(P, E):
        raise ValueError(f"the fused alignment takes <= {FUSED_ALIGN_MAX_PAIRS} pairs and <= "
                         f"{FUSED_ALIGN_MAX_BINS - 2} experts; got {P}, {E}")
    max_blocks = P // block_m + min(E + 1, P)
    dev = ids.device
    sorted_pair_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    rank = torch.empty(max(P, 1), dtype=torch.int32, device=dev)
    work = torch.empty(eb, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        ids, sorted_pair_ids, block_expert, rank, work, P, E, max_blocks * block_m, max_blocks,
        BLOCK_M=block_m, CHUNK=128, EB=eb, MB_CHUNK=max(1, 16384 // eb), num_warps=4, **pdl.kernel_kwargs(dev, "moe"),
    )
    return sorted_pair_ids, block_expert


# The multi-program alignment (prefill-sized calls): pairs per counting program, in sub-chunks of MULTI_CHUNK.
MULTI_SPAN = 1024
MULTI_CHUNK = 128


@triton.jit(do_not_specialize=["P", "n_rows", "rows_per_prog"])  # per-step counts: no recompile per value
def _align_count_kernel(
    Ids, SortedPair, Rank, Counts,
    P, E, n_rows, rows_per_prog,
    SPAN: tl.constexpr,
    CHUNK: tl.constexpr,
    EB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program g of `align_pairs_multi`'s first launch: pairs [g * SPAN, (g + 1) * SPAN) get their stable rank
    among the program's pairs of the same bucket (Rank), the program's bucket counts go to Counts[g, :EB] (first
    used as the scratch the ranks gather from), and SortedPair rows [g * rows_per_prog, ...) are set to P (the
    padding value; the scatter launch overwrites the real rows). Bin EB - 1 (> E) collects the masked lanes."""
    _pdl_sync(PDL)
    g = tl.program_id(0)
    ci = tl.arange(0, CHUNK)
    for start in range(0, rows_per_prog, CHUNK):
        o = g * rows_per_prog + start + ci
        tl.store(SortedPair + o, tl.zeros([CHUNK], dtype=tl.int32) + P, mask=(o < n_rows) & (start + ci < rows_per_prog))
    work = Counts + g * EB
    running = tl.zeros([EB], dtype=tl.int32)
    for start in range(0, SPAN, CHUNK):
        running = _rank_chunk(Ids, Rank, work, g * SPAN + start, P, E, running, CHUNK, EB)
    tl.store(work + tl.arange(0, EB), running)


@triton.jit(do_not_specialize=["num_progs", "max_blocks"])
def _align_scan_kernel(
    Counts, BlkStart, BlockExpert,
    num_progs, E, max_blocks,
    BLOCK_M: tl.constexpr,
    EB: tl.constexpr,
    MB_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`align_pairs_multi`'s second launch, one program: Counts [num_progs, EB] becomes, in place, each counting
    program's exclusive prefix per bucket (its pairs' offset within the bucket); BlkStart [EB] the first block of
    each bucket; BlockExpert [max_blocks] the bucket of every block (-1 past the last)."""
    _pdl_sync(PDL)
    bins = tl.arange(0, EB)
    total = tl.zeros([EB], dtype=tl.int32)
    for g in range(num_progs):
        c = tl.load(Counts + g * EB + bins)
        tl.store(Counts + g * EB + bins, total)
        total += c
    blocks = tl.where(bins <= E, (total + BLOCK_M - 1) // BLOCK_M, 0)
    blk_end = tl.cumsum(blocks, 0)
    tl.store(BlkStart + bins, blk_end - blocks)
    _store_block_expert(BlockExpert, blk_end, E, max_blocks, EB, MB_CHUNK)


@triton.jit(do_not_specialize=["P"])
def _align_scatter_kernel(
    Ids, SortedPair, Rank, Counts, BlkStart,
    P, E,
    BLOCK_M: tl.constexpr,
    SPAN: tl.constexpr,
    CHUNK: tl.constexpr,
    EB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`align_pairs_multi`'s third launch: pair p of program g goes to row BlkStart[b] * BLOCK_M + Counts[g, b] +
    Rank[p] of SortedPair (b its bucket). Reads what the two launches before it wrote, after its PDL wait."""
    _pdl_sync(PDL)
    g = tl.program_id(0)
    ci = tl.arange(0, CHUNK)
    for start in range(0, SPAN, CHUNK):
        o = g * SPAN + start + ci
        m = o < P
        b = _buckets(Ids, o, m, E)
        dest = (tl.load(BlkStart + b, mask=m, other=0) * BLOCK_M + tl.load(Counts + g * EB + b, mask=m, other=0)
                + tl.load(Rank + o, mask=m, other=0))
        tl.store(SortedPair + dest, o.to(tl.int32), mask=m)


def align_pairs_multi(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """`align_pairs` (same outputs, bit for bit) in three launches over cdiv(P, MULTI_SPAN) counting programs: per
    program stable in-bucket ranks and bucket counts, one program's prefix over programs and buckets, the scatter.
    For prefill-sized calls (E + 2 <= FUSED_ALIGN_MAX_BINS), where the torch sort path costs ~15 launches and their
    host time per MoE layer."""
    E = num_experts
    ids = topk_ids.reshape(-1).contiguous()
    P = ids.numel()
    eb = triton.next_power_of_2(E + 2)
    if eb > FUSED_ALIGN_MAX_BINS:
        raise ValueError(f"the multi-program alignment takes <= {FUSED_ALIGN_MAX_BINS - 2} experts; got {E}")
    max_blocks = P // block_m + min(E + 1, P)
    dev = ids.device
    n_rows = max_blocks * block_m
    progs = max(1, triton.cdiv(P, MULTI_SPAN))
    sorted_pair_ids = torch.empty(n_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    rank = torch.empty(max(P, 1), dtype=torch.int32, device=dev)
    counts = torch.empty(progs, eb, dtype=torch.int32, device=dev)
    blk_start = torch.empty(eb, dtype=torch.int32, device=dev)
    kw = pdl.kernel_kwargs(dev, "moe")
    _align_count_kernel[(progs,)](ids, sorted_pair_ids, rank, counts, P, E, n_rows, triton.cdiv(n_rows, progs),
                                  SPAN=MULTI_SPAN, CHUNK=MULTI_CHUNK, EB=eb, num_warps=4, **kw)
    _align_scan_kernel[(1,)](counts, blk_start, block_expert, progs, E, max_blocks, BLOCK_M=block_m, EB=eb,
                             MB_CHUNK=max(1, 16384 // eb), num_warps=4, **kw)
    _align_scatter_kernel[(progs,)](ids, sorted_pair_ids, rank, counts, blk_start, P, E, BLOCK_M=block_m,
                                    SPAN=MULTI_SPAN, CHUNK=MULTI_CHUNK, EB=eb, num_warps=4, **kw)
    return sorted_pair_ids, block_expert


def fused_align_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether `align_pairs_fused` takes a call of this many pairs and experts (its bucket bins include the invalid
    bucket and the masked lanes' bin, rounded up to a power of two)."""
    return num_pairs <= FUSED_ALIGN_MAX_PAIRS and triton.next_power_of_2(num_experts + 2) <= FUSED_ALIGN_MAX_BINS


def align(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """`align_pairs_fused` where it fits (decode, verify), `align_pairs_multi` for larger calls of up to
    FUSED_ALIGN_MAX_BINS - 2 experts (prefill), else the torch sort of `align_pairs`."""
    if fused_align_fits(topk_ids.numel(), num_experts):
        return align_pairs_fused(topk_ids, num_experts, block_m)
    if triton.next_power_of_2(num_experts + 2) <= FUSED_ALIGN_MAX_BINS:
        return align_pairs_multi(topk_ids, num_experts, block_m)
    return align_pairs(topk_ids, num_experts, block_m)
