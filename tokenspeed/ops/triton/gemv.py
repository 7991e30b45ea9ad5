"""Skinny GEMM / GEMV for decode-sized projections: y[M, N] = x[M, K] @ W[N, K]^T with M small (1..16).

Same contract as `torch.nn.functional.linear(x, W)` without bias: x [M, K] (any row stride; any column stride,
unit stride gives vector loads), W [N, K] row-major with unit column stride (the nn.Linear weight layout),
x.dtype == W.dtype in {bf16, fp16, fp32}; returns y [M, N] contiguous in x.dtype, or in fp32 on request
(`out_dtype=torch.float32`: the fp32 accumulation itself, e.g. the MoE router's fp32 logits from bf16 weights).
Products accumulate in fp32 and are rounded to the output dtype once, at the end (fp32 inputs use IEEE fp32
arithmetic, no TF32).

At M <= 16 the op reads each weight once and does 2*M FLOPs per weight element, so it is bound by the weight
stream (N*K*elt bytes). Both kernels stream W exactly once: program (n, s) owns rows [n*BLOCK_N, (n+1)*BLOCK_N)
of W and the K range [s*K_SPLIT, (s+1)*K_SPLIT), loops over it in BLOCK_K steps (W is contiguous along K, so the
tile loads are 16-byte vectors when K is a multiple of 8 for 2-byte types) and keeps the [M, BLOCK_N] partial
products of all M rows in registers:

- kind "fma" (CUDA cores): per step, acc[BM, BN] += sum_k x[BM, 1, BK] * w[1, BN, BK] (the M rows of x are a
  tiny [BM, BK] tile read from L1/L2 next to the weight tile; BM = next_pow2(M)).
- kind "dot" (tensor cores, operands swapped): acc[BN, BM] += W_tile[BN, BK] @ x_tile[BM, BK]^T with BM padded
  to 16, so the weight tile is the MMA's wide operand and the software pipeliner (num_stages) streams it
  through shared memory with asynchronous copies.

SPLIT_K > 1 (for layers whose N is too small to give every SM work) is deterministic and takes one launch: each
program (n, s) writes its fp32 partial to a workspace [SPLIT_K, M, N], then counts itself in with an acq_rel
atomic on its n-tile's semaphore (an int32 per n-tile, one zeroed array per device, `semaphores`); the program
that arrives last sums the tile's SPLIT_K partials in the fixed order s = 0..SPLIT_K-1 (so the bits do not depend
on the arrival order), rounds once, writes y and resets the semaphore to 0 for the next call or graph replay.
Nobody waits for anybody, so the scheme cannot deadlock whatever the residency. `reduce="launch"` keeps the
previous scheme (a second tiny kernel sums the splits in the same order: identical bits) for A/B timing.
On Hopper the kernels use programmatic dependent launch (PDL, `tokenspeed.ops.triton.pdl`; TOKENSPEED_PDL=0
turns it off): before any read of x, each program executes `griddepcontrol.wait` (so it sees everything the
previous kernel wrote, x included, and, for the semaphores, every earlier GEMV has finished and reset them) and
then releases its dependents at once, so a following GEMV (or reduce) is scheduled while this one streams.
Measured on an H200 in CUDA graphs: two PDL launches cost about 0.6-1 us less per split-K call than two plain
ones; the fused reduction removes the second launch (and its PDL wait) altogether.

Weight prefetch before the wait (`GemvConfig.prefetch`): a program launched as a dependent is resident while the
previous kernel still runs, so it can put its weight stream in flight early (no kernel writes a weight).
- "l2": one `cp.async.bulk.prefetch.L2.global` per weight row of the program, covering the row's
  K range of the program (capped so the resident programs prefetch at most PREFETCH_L2_BYTES together). After
  the wait the loop's loads hit L2 or merge with the prefetches in flight, so the whole K range, not only its
  first tile, starts streaming during the previous kernel. The loop, its software pipelining and its registers
  are unchanged. Compiled only into PDL launches (inline asm: not in the interpreter), and only when the rows
  start 16-byte aligned (the instruction's rule; else "none"). ptxas issues it from a short uniform-register
  loop over a warp's distinct rows (about 32 iterations), before the wait. It moves no data into the SM, and
  L2 is where every SM's writes land, so it cannot return stale data even if the "weight" were being written.
- "regs" (the default: in the H200 chain benchmark, benchmarks/gemv_pdl_chain_h200.py, a producer -> o_proj ->
  router -> in_proj chain took 36.5 us with "regs", 37.9 with "none", 38.9 with "l2", 40.7 without PDL): the
  first W tile is loaded into registers before the wait and the loop's first step is peeled (the
  rest of the loop is pipelined as before). It hides one DRAM round trip at most (the next tile's load is
  issued after the wait) and holds the tile in registers and shared memory (+20 KB for 64 x 128 bf16 tiles).
  It stays compiled without PDL (then it is only the peel), so the interpreter tests its loop. Under PDL it
  reads real data before the wait: the weight must not be written by the two kernels launched before the GEMV.
- "none": nothing before the wait.

Rows past N and x rows past M are clamped to the last valid row for the loads (so the loads need no row mask)
and masked at the store. CUDA-graph safe: no host synchronisation; the output and the split-K workspace are
allocated from the shapes; the semaphore array is allocated once per device outside any capture (a capture that
comes first takes the two-launch reduction instead).

Measured (benchmarks/gemv_h200.py, H200, bf16, cold L2, graph replay after a producer kernel, M = 1..8; with
the two-launch split-K reduction): weights >= 100 MB stream at 88-105% of 4.27 TB/s (cuBLAS 84-103%); 16-100 MB
at 51-83% (cuBLAS 45-82%); below ~16 MB every call is latency-bound (2.5-6.6 us, about 3-5 us of it fixed: the
dependent launch, the first DRAM round trip, the split-K reduce), for cuBLAS too. The tensor-core kernel wins
almost everywhere; the CUDA-core one only on a few tiny layers at M <= 2 (it is also the fp32 path).
`tokenspeed.ops.linear` routes per shape from the table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import gemv_smem, pdl
from tokenspeed.ops.triton._utils import l2_prefetch_bulk

MAX_M = 16
KINDS = ("fma", "dot", "smem")
REDUCES = ("fused", "launch")
PREFETCHES = ("none", "l2", "regs")
_NUM_SMS_DEFAULT = 132  # H200 / H100 SXM
# "l2" prefetch: bytes the programs resident at once may prefetch together (per row: this / (programs * BLOCK_N)),
# well under the H200's L2 (50+ MB), so prefetched lines are not evicted before the loop reads them and the
# previous kernel's output (our x) stays in L2. CTAS_PER_SM: the resident programs per SM assumed for that split.
PREFETCH_L2_BYTES = 24 << 20
PREFETCH_CTAS_PER_SM = 2


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration. kind: "fma" | "dot"; block sizes are powers of two (dot: block_n, block_k >= 16).
    reduce (split_k > 1 only): "fused", the last split of each n-tile sums the partials inside the GEMV launch,
    or "launch", a second kernel does (the previous scheme, kept for A/B timing); both give identical bits.
    prefetch: what a program does with its weights before its PDL wait (see the module docstring): "none";
    "l2", an L2 prefetch of its weight rows' K range (PDL launches only, and only when the rows are 16-byte
    aligned; otherwise "none"); "regs", the first W tile loaded into registers (the loop's first step peeled;
    also without PDL, where it is only the peel).
    kind "smem" (`gemv_smem`, Gluon on sm_90, M <= 4): block_n whole weight rows a tile, copied in block_k
    chunks into num_stages shared-memory buffers before the PDL wait; programs_per_sm > 0 makes the grid
    persistent (that many programs an SM, each looping over row tiles), 0 gives one program a tile. split_k,
    reduce and prefetch do not apply. Where the kernel cannot run the call (`gemv_smem.unusable_reason`: CPU,
    interpreter, another GPU or Triton, layout), `gemv` takes `default_config` instead."""

    kind: str = "fma"
    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    reduce: str = "fused"
    prefetch: str = "regs"
    programs_per_sm: int = 0

    def validate(self) -> GemvConfig:
        """Raise ValueError on an impossible configuration; return self."""
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {self.kind!r}")
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two; got {v}")
        if self.kind == "dot" and min(self.block_n, self.block_k) < 16:
            raise ValueError(f"kind 'dot' needs block_n, block_k >= 16; got {self.block_n}, {self.block_k}")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}; got {self.reduce!r}")
        if self.prefetch not in PREFETCHES:
            raise ValueError(f"prefetch must be one of {PREFETCHES}; got {self.prefetch!r}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"split_k and num_stages must be >= 1; got {self.split_k}, {self.num_stages}")
        if self.programs_per_sm < 0:
            raise ValueError(f"programs_per_sm must be >= 0; got {self.programs_per_sm}")
        return self


_device_info: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """The device's SM count; the interpreter: 132 (an H200's)."""
    if device.type != "cuda":
        return _NUM_SMS_DEFAULT
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = _device_info.get(idx)
    if sms is None:
        sms = _device_info[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return sms


def _num_sms_pdl(device: torch.device) -> tuple[int, bool]:
    """(SM count, launch as programmatic dependents: `pdl.enabled`, so TOKENSPEED_PDL=0 turns it off)."""
    return _num_sms(device), pdl.enabled(device, "gemv")


def default_config(M: int, N: int, K: int, elt_size: int = 2, num_sms: int = _NUM_SMS_DEFAULT) -> GemvConfig:
    """A reasonable launch configuration for [M, K] x [N, K]^T when the routing table has none.

    2-byte types: the tensor-core kernel with [64 x 128] weight tiles, 4 warps, 4 stages (the most frequent
    winner of the H200 sweep in benchmarks/gemv_h200.py for M = 1..8). fp32: the CUDA-core kernel with
    [16 x 128] tiles. Then split-K (a power of two) until the grid fills one wave (>= num_sms programs), capped
    so each split still loops over >= 4 BLOCK_K steps. Tuned values come from the routing table; this is only
    the fallback.
    """
    if elt_size <= 2:
        cfg = GemvConfig("dot", block_n=64, block_k=128, num_warps=4, num_stages=4)
    else:
        cfg = GemvConfig("fma", block_n=16, block_k=128, num_warps=4, num_stages=3)
    n_blocks = triton.cdiv(N, cfg.block_n)
    split = 1
    while n_blocks * split < num_sms and K >= 8 * split * cfg.block_k:
        split *= 2
    return replace(cfg, split_k=split)


@triton.jit
def _tiles(X, W, M, N, K, k_split, stride_xm, stride_xk, stride_wn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program's (split, row, column, k) offsets, its K range [k_lo, k_hi) and the first W / x tile pointers
    (rows clamped to N-1 / M-1, so loads need no row mask; stores mask them)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
    k_lo = pid_s * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w_ptrs = W + rows_w[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = X + rows_x[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    return pid_s, offs_m, offs_n, offs_k, k_lo, k_hi, w_ptrs, x_ptrs


@triton.jit
def _load_tile(ptrs, k0, offs_k, K, EVEN_K: tl.constexpr):
    """The [rows, BLOCK_K] tile at ptrs, whose columns are k0 + offs_k (columns >= K read as 0 unless EVEN_K)."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=((k0 + offs_k) < K)[None, :], other=0.0)


@triton.jit
def _load_k_step(w_ptrs, x_ptrs, k0, offs_k, K, EVEN_K: tl.constexpr):
    """The W [BLOCK_N, BLOCK_K] and x [BLOCK_M, BLOCK_K] tiles at k0 (columns >= K read as 0 unless EVEN_K)."""
    return _load_tile(w_ptrs, k0, offs_k, K, EVEN_K), _load_tile(x_ptrs, k0, offs_k, K, EVEN_K)


@triton.jit
def _prefetch_rows_l2(W, offs_n, N, stride_wn, k_lo, k_hi, row_bytes):
    """One `cp.async.bulk.prefetch.L2` per weight row of the program (rows clamped to N-1): the row's bytes from
    column k_lo, (k_hi - k_lo) columns capped at row_bytes, rounded down to 16 bytes (the instruction's unit;
    the host guarantees 16-byte aligned row starts). A hint: fire and forget, no registers held. An element of
    the row tensor held by several threads issues the same prefetch from each (harmless, merged in L2)."""
    elt: tl.constexpr = W.dtype.element_ty.primitive_bitwidth // 8
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    ptrs = W + rows * stride_wn + k_lo
    nbytes = tl.minimum((k_hi - k_lo) * elt, row_bytes) // 16 * 16 + tl.zeros_like(offs_n)
    l2_prefetch_bulk(ptrs, nbytes)


@triton.jit
def _pre_wait(W, offs_n, N, stride_wn, k_lo, k_hi, pf_row_bytes, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """PDL launches: the "l2" weight prefetch (weights are never written by a kernel, so they may be read
    before the wait), then wait for the producer of x and release our dependents. Nothing without PDL."""
    if PDL:
        if PREFETCH == "l2":
            _prefetch_rows_l2(W, offs_n, N, stride_wn, k_lo, k_hi, pf_row_bytes)
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _epilogue(acc, Out, Y, Sem, M, N, pid_s, offs_m, offs_n, stride_os, stride_om,
              N_MAJOR: tl.constexpr, REDUCE_SPLITS: tl.constexpr):
    """Store a program's fp32 tile acc ([BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] when N_MAJOR) at
    Out + pid_s * stride_os, rounded to Out's dtype (y itself when there is one split; the fp32 workspace slice
    of split pid_s otherwise).

    REDUCE_SPLITS > 1 (the fused split-K reduction): then the program counts itself in on its n-tile's
    semaphore Sem[pid_n] and the last of the REDUCE_SPLITS programs to arrive sums the tile's partials in the
    fixed order s = 0, 1, ... (bit-identical to `_splitk_reduce_kernel`, whatever the arrival order), rounds once
    to Y's dtype, writes y and sets Sem[pid_n] back to 0 for the next call (and the next graph replay).
    Ordering: the CTA barrier puts every thread's partial store before the one thread's acq_rel gpu-scope atomic
    (release is cumulative); the atomic's result is broadcast through shared memory behind a barrier, so the
    last program's loads follow its acquire; they read L2 (.cg), where every SM's stores meet, not the SM's
    non-coherent L1.
    Why sharing one counter array between all GEMV launches is safe: the counters are touched only after the
    kernel's gdc_wait (`griddepcontrol.wait` returns once the previous grid in the stream has completed and its
    memory is visible; without PDL, plain stream order). That makes grid completion ordered along the stream as
    long as every kernel launched as a programmatic dependent executes griddepcontrol.wait before it exits (true
    of every PDL launch here: these GEMVs and the split-K reduce, which wait first thing), so a later GEMV cannot
    reach its atomics before every earlier GEMV has finished and reset its counters. Two split-K GEMVs running
    concurrently on different streams of one device would share counters: not supported.
    """
    if N_MAJOR:
        offs = offs_m[None, :] * stride_om + offs_n[:, None]
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        offs = offs_m[:, None] * stride_om + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(Out + pid_s * stride_os + offs, acc.to(Out.dtype.element_ty), mask=mask)
    if REDUCE_SPLITS > 1:
        pid_n = tl.program_id(0)
        tl.debug_barrier()  # every thread's partial store is issued before the (single-thread) release below
        arrived = tl.atomic_add(Sem + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == REDUCE_SPLITS - 1:  # the last split of this n-tile to finish: reduce it
            total = tl.zeros_like(acc)
            for s in tl.static_range(REDUCE_SPLITS):  # fixed order: deterministic
                total += tl.load(Out + s * stride_os + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=mask)
            tl.store(Sem + pid_n, 0)


# The row count M takes no divisibility-by-16 specialisation (M == 1 still specialises): an eager step of M rows
# then reuses the variant a captured graph of another M compiled instead of compiling one mid-serve (a step of 16
# rows beside graphs of at most 8). The split-K workspace's split stride is rounded up to 16 elements
# (`_split_stride`), so it is always divisible (its loads and stores stay vectorised) whatever M * N is.
_ROW_ARGS = ["M"]


@triton.jit(do_not_specialize_on_alignment=_ROW_ARGS)
def _gemv_fma_kernel(
    X, W, Out, Y, Sem,
    M, N, K, k_split, pf_row_bytes,
    stride_xm, stride_xk, stride_wn, stride_os, stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    REDUCE_SPLITS: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_s, offs_m, offs_n, offs_k, k_lo, k_hi, w_ptrs, x_ptrs = _tiles(
        X, W, M, N, K, k_split, stride_xm, stride_xk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    if PREFETCH == "regs":  # the first W tile before the wait (every split owns >= 1 step)
        w_first = _load_tile(w_ptrs, k_lo, offs_k, K, EVEN_K)
    _pre_wait(W, offs_n, N, stride_wn, k_lo, k_hi, pf_row_bytes, PREFETCH, PDL)  # x is readable from here on
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = k_lo
    if PREFETCH == "regs":  # the peeled first step
        x = _load_tile(x_ptrs, k_lo, offs_k, K, EVEN_K)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w_first.to(tl.float32)[None, :, :], axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
        k_start += BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        w, x = _load_k_step(w_ptrs, x_ptrs, k0, offs_k, K, EVEN_K)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
    _epilogue(acc, Out, Y, Sem, M, N, pid_s, offs_m, offs_n, stride_os, stride_om, False, REDUCE_SPLITS)


@triton.jit
def _mma(w, x, acc, IEEE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x[BLOCK_M, BLOCK_K]^T on tensor cores (fp32 inputs: IEEE)."""
    if IEEE:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit(do_not_specialize_on_alignment=_ROW_ARGS)
def _gemv_dot_kernel(
    X, W, Out, Y, Sem,
    M, N, K, k_split, pf_row_bytes,
    stride_xm, stride_xk, stride_wn, stride_os, stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    REDUCE_SPLITS: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_s, offs_m, offs_n, offs_k, k_lo, k_hi, w_ptrs, x_ptrs = _tiles(
        X, W, M, N, K, k_split, stride_xm, stride_xk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    if PREFETCH == "regs":  # the first W tile before the wait (every split owns >= 1 step)
        w_first = _load_tile(w_ptrs, k_lo, offs_k, K, EVEN_K)
    _pre_wait(W, offs_n, N, stride_wn, k_lo, k_hi, pf_row_bytes, PREFETCH, PDL)  # x is readable from here on
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = k_lo
    if PREFETCH == "regs":  # the peeled first step; the loop below (the rest) is software-pipelined as before
        x = _load_tile(x_ptrs, k_lo, offs_k, K, EVEN_K)
        acc = _mma(w_first, x, acc, IEEE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
        k_start += BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        w, x = _load_k_step(w_ptrs, x_ptrs, k0, offs_k, K, EVEN_K)
        acc = _mma(w, x, acc, IEEE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
    _epilogue(acc, Out, Y, Sem, M, N, pid_s, offs_m, offs_n, stride_os, stride_om, True, REDUCE_SPLITS)


@triton.jit(do_not_specialize_on_alignment=["MN"])
def _splitk_reduce_kernel(Ws, Y, MN, stride_s, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # scheduled while the GEMV runs; waits here for its partials, then releases its dependents
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(Ws + s * stride_s + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def _split_stride(M: int, N: int) -> int:
    """Elements between two splits' partials in the split-K workspace: M * N rounded up to a multiple of 16."""
    return -(-M * N // 16) * 16


def _check(x: Tensor, weight: Tensor, out_dtype: torch.dtype, out: Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x and weight must share a dtype in bf16/fp16/fp32; got {x.dtype}, {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight must have unit column stride (row-major [N, K])")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"M must be in [1, {MAX_M}]; got {x.shape[0]}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device; got {x.device}, {weight.device}")
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be x.dtype or torch.float32; got {out_dtype}")
    M, N = x.shape[0], weight.shape[0]
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{M}, {N}] {out_dtype} tensor; got {tuple(out.shape)} {out.dtype}")


def resolve_config(M: int, N: int, K: int, elt_size: int, device: torch.device, **overrides: int | str | None
                   ) -> GemvConfig:
    """`default_config` with the given non-None fields replaced (the table stores complete configs); the prefetch
    mode, when not given, from TOKENSPEED_GEMV_PREFETCH if set (none | l2 | regs; for A/B timing)."""
    base = default_config(M, N, K, elt_size, _num_sms(device))
    given = {k: v for k, v in overrides.items() if v is not None}
    env_prefetch = os.environ.get("TOKENSPEED_GEMV_PREFETCH", "").strip()
    if env_prefetch and "prefetch" not in given:
        given["prefetch"] = env_prefetch
    return replace(base, **given).validate() if given else base


# Split-K arrival counters (one int32 per n-tile), one zeroed array per device, shared by every split-K GEMV on it
# (see `_epilogue` for why that is safe) and never freed: CUDA graphs keep its address.
SEMAPHORE_SLOTS = 1 << 16
_semaphores: dict[torch.device, Tensor] = {}


def semaphores(device: torch.device) -> Tensor | None:
    """The device's split-K counters (SEMAPHORE_SLOTS zeros, restored to zero by every fused reduction); created
    on first use, or None when that first use is inside a CUDA-graph capture (a capture would only record the
    zero fill), in which case the caller falls back to the two-launch reduction."""
    sem = _semaphores.get(device)
    if sem is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        sem = torch.zeros(SEMAPHORE_SLOTS, dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeros visible to every stream before any kernel uses them
        _semaphores[device] = sem
    return sem


def effective_split(K: int, cfg: GemvConfig) -> tuple[int, int]:
    """(number of splits, K per split) that `gemv` launches for cfg: split_k capped so every split owns >= 1
    BLOCK_K step, and no split is empty."""
    steps = triton.cdiv(K, cfg.block_k)
    k_split = triton.cdiv(steps, min(cfg.split_k, steps)) * cfg.block_k
    return triton.cdiv(K, k_split), k_split


def prefetch_plan(cfg: GemvConfig, weight: Tensor, n_tiles: int, split: int, pdl_on: bool, num_sms: int
                  ) -> tuple[str, int]:
    """(the PREFETCH mode compiled in, bytes per weight row the "l2" mode may prefetch) for a launch of
    n_tiles x split programs. "l2" needs a PDL launch (its inline asm exists only in that variant; without PDL
    there is no wait to overlap) and 16-byte aligned row starts (base, row stride and BLOCK_K steps), else it
    becomes "none"; the per-row cap spreads PREFETCH_L2_BYTES over the programs resident at once. "regs" is
    kept without PDL (then it only peels the first K step)."""
    if cfg.prefetch == "regs":
        return "regs", 0
    elt = weight.element_size()
    aligned = weight.data_ptr() % 16 == 0 and weight.stride(0) * elt % 16 == 0 and cfg.block_k * elt % 16 == 0
    if cfg.prefetch != "l2" or not pdl_on or not aligned:
        return "none", 0
    resident = min(n_tiles * split, PREFETCH_CTAS_PER_SM * num_sms)
    row_bytes = PREFETCH_L2_BYTES // (resident * cfg.block_n) // 16 * 16
    return ("l2", row_bytes) if row_bytes > 0 else ("none", 0)


def gemv(
    x: Tensor,
    weight: Tensor,
    *,
    kind: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    reduce: str | None = None,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    prefetch: str | None = None,
    programs_per_sm: int | None = None,
) -> Tensor:
    """y = x @ weight^T for x [M, K] (1 <= M <= 16), weight [N, K] -> y [M, N] contiguous, out_dtype.

    out_dtype: x.dtype (None, the default) or torch.float32: then 16-bit inputs give the fp32 accumulation
    itself, never rounded to 16 bits (the MoE router's logits). Launch-config arguments left None come from
    `default_config` (reduce: "fused", prefetch: "regs" unless given or set by TOKENSPEED_GEMV_PREFETCH; see `GemvConfig`). split_k is capped so every
    split owns at least one BLOCK_K step. `out`, if given, is a contiguous [M, N] tensor of out_dtype that
    receives y (and is returned).
    prefetch="regs" under PDL reads the first weight tile before waiting for the previous kernel: the weight must
    not be written by either of the two kernels launched just before (true of model weights).
    Raises ValueError on unsupported shapes, dtypes or layouts (see the module docstring).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check(x, weight, out_dtype, out)
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device) if out is None else out
    if N == 0:
        return y
    if K == 0:
        return y.zero_()
    cfg = resolve_config(M, N, K, x.element_size(), x.device, kind=kind, block_n=block_n, block_k=block_k,
                         split_k=split_k, num_warps=num_warps, num_stages=num_stages, reduce=reduce,
                         prefetch=prefetch, programs_per_sm=programs_per_sm)
    if cfg.kind == "smem":
        if gemv_smem.unusable_reason(x, weight, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) is None:
            num_sms, pdl_on = _num_sms_pdl(x.device)
            return gemv_smem.launch(x, weight, y, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                                    cfg.programs_per_sm, num_sms, pdl_on)
        cfg = default_config(M, N, K, x.element_size(), _num_sms(x.device))
    split, k_split = effective_split(K, cfg)
    n_tiles = triton.cdiv(N, cfg.block_n)
    sem = semaphores(x.device) if split > 1 and cfg.reduce == "fused" else None
    if sem is not None and n_tiles > sem.numel():  # more n-tiles than counters: the two-launch reduction
        sem = None
    stride_s = _split_stride(M, N) if split > 1 else 0
    dst = y if split == 1 else torch.empty(split, stride_s, dtype=torch.float32, device=x.device)
    num_sms, pdl_on = _num_sms_pdl(x.device)
    mode, pf_row_bytes = prefetch_plan(cfg, weight, n_tiles, split, pdl_on, num_sms)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl_on else {}))
    args = (x, weight, dst, y, dst if sem is None else sem, M, N, K, k_split, pf_row_bytes, x.stride(0),
            x.stride(1), weight.stride(0), stride_s, N)
    consts = {"BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "EVEN_K": K % cfg.block_k == 0,
              "REDUCE_SPLITS": 1 if sem is None else split, "PREFETCH": mode, "PDL": pdl_on}
    grid = (n_tiles, split)
    if cfg.kind == "dot":
        _gemv_dot_kernel[grid](*args, BLOCK_M=max(16, triton.next_power_of_2(M)), IEEE=x.dtype == torch.float32,
                               **consts, **launch)
    else:
        _gemv_fma_kernel[grid](*args, BLOCK_M=triton.next_power_of_2(M), **consts, **launch)
    if split > 1 and sem is None:  # the two-launch reduction
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](dst, y, M * N, stride_s, SPLIT_K=split, BLOCK=block,
                                                            PDL=pdl_on, num_warps=4,
                                                            **({"launch_pdl": True} if pdl_on else {}))
    return y
