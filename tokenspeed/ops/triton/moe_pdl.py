"""Programmatic dependent launch (PDL) in the MoE launches: what each may read before its wait, and why that is
safe; the wait itself and the down kernel's W2 prefetch.

The protocol is `tokenspeed.ops.triton.pdl`'s. The launches of a decode MoE layer are router GEMV -> `moe_route`
-> [`moe_experts`: the fused alignment or the torch sort] [gather_x] gate_up down combine, and everything
`moe_experts` is given (x, the routing ids and weights, `add`, the residual, the weights) was produced before its
first launch (`add`, computed by other kernels between the router and the experts, only moves further back).
Pre-wait reads rest on one fact: when any program of launch N runs, every program of launch N-1 has passed its own
wait (each triggers its dependents only after its wait, or exits after it), so launch N-2 has completed and its
writes are visible; a launch without the PDL attribute (torch, cuBLAS) starts only once everything before it has
completed. So launch N may read before its wait whatever the launch right before it did not write:
- `moe_route`, the fused alignment, gather_x, gate_up: wait first thing. Each one's input (logits, ids, the
  alignment) is the output of the launch right before it; gate_up cannot know its own expert before the wait. But
  a caller may name an expert every call uses (`prefetch_expert`: Kimi-Linear's folded shared expert, in every
  row): then the programs of M-block 0 L2-prefetch that expert's W1 / W3 rows of their N tile before the wait,
  while the router (direct mode) or the alignment still runs. A prefetch is only a hint: a wrong id costs bandwidth,
  never a result.
- down: reads its expert id before the wait (the direct mode: topk_ids from the router; aligned: block_expert and
  sorted_pair_ids from the alignment): gate_up always sits between their producer and down, so they are at least
  two launches back. With the id it L2-prefetches the W2 rows of its tile (`cp.async.bulk.prefetch.L2.global`, the
  rows' I columns, capped by PREFETCH_L2_BYTES; weights are never written by a kernel), so its weight stream starts
  while gate_up finishes. h, written by gate_up, is read after the wait; every store comes after it.
- combine: reads `add`, the residual and the norm weight (arguments, so at least gate_up and down launches back)
  before its wait, the per-pair buffer (down's output) after it.
Pre-wait loads of data a kernel wrote go through L2 only (`_load_pre_wait`). Every program of every one of these
kernels executes the wait on every path before it exits (a block with nothing to do, an invalid expert id), and
triggers its dependents right after its wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import l2_prefetch_bulk

# Bytes of W2 the down programs resident at once may L2-prefetch together before their wait (about a third of the
# H200's 50 MB L2, so prefetched lines survive until the loop reads them), and the programs counted resident per SM.
PREFETCH_L2_BYTES = 24 << 20
PREFETCH_CTAS_PER_SM = 2


@triton.jit
def _pdl_sync(PDL: tl.constexpr):
    """PDL launches: wait for the previous launch (its writes visible), then let our dependents launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _load_pre_wait(ptrs, PDL: tl.constexpr, mask=None, other=None):
    """A load issued before the PDL wait of data an earlier launch wrote (at least two launches back: completed and
    flushed to L2). With PDL it bypasses L1 (`.cg`): L1 is not coherent, and the caching allocator hands the same
    addresses to every layer's routing, so a line an earlier kernel read on this SM must not be served instead."""
    if PDL:
        return tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _prefetch_rows_l2(W, e, offs_n, N, stride_we, stride_wn, nbytes):
    """One `cp.async.bulk.prefetch.L2` per weight row of the tile (expert e of W [E, N, K], rows offs_n wrapped
    into [0, N) as the kernels' loads wrap them): nbytes from the row's start (a multiple of 16; the host
    guarantees 16-byte aligned rows). A hint, fire and forget: no registers held, nothing waited for, no effect on
    any result; a row held by several threads is prefetched by each (merged in L2)."""
    rows = (offs_n % N).to(tl.int64)
    ptrs = W + e.to(tl.int64) * stride_we + rows * stride_wn
    l2_prefetch_bulk(ptrs, nbytes + tl.zeros_like(offs_n))


_num_sms: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms:
        _num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms[idx]


def w2_prefetch_bytes(w2: Tensor, block_n: int, programs: int, wanted: bool) -> int:
    """Bytes of each W2 row ([E, D, I]) a down program of block_n rows L2-prefetches before its PDL wait (0: none):
    the row's I columns rounded down to 16 bytes, capped so the programs resident at once (PREFETCH_CTAS_PER_SM
    per SM, at most `programs`) prefetch at most PREFETCH_L2_BYTES together. 0 unless `wanted` (a PDL launch with
    pointer loads and the config's prefetch on) and every row starts 16-byte aligned (the instruction's rule)."""
    elt = w2.element_size()
    if not wanted or not pdl.l2_prefetch_on("down") or w2.data_ptr() % 16 or (w2.stride(0) * elt) % 16 \
            or (w2.stride(1) * elt) % 16 \
            or w2.stride(2) != 1:
        return 0
    resident = max(1, min(programs, PREFETCH_CTAS_PER_SM * _sm_count(w2.device)))
    cap = PREFETCH_L2_BYTES // (resident * block_n) // 16 * 16
    return min(w2.shape[2] * elt // 16 * 16, cap)


def rows_prefetch_bytes(w: Tensor, wanted: bool) -> int:
    """Bytes of each row of w [E, N, K] to L2-prefetch whole (K * elt rounded down to 16), or 0 unless `wanted` and
    every row starts 16-byte aligned."""
    elt = w.element_size()
    if not wanted or not pdl.l2_prefetch_on("gate_up") or w.data_ptr() % 16 or (w.stride(0) * elt) % 16 \
            or (w.stride(1) * elt) % 16 or w.stride(2) != 1:
        return 0
    return w.shape[2] * elt // 16 * 16
