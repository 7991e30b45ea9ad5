"""L2 prefetch of whole tensors: a Triton kernel that issues `cp.async.bulk.prefetch.L2.global` over a tensor's
bytes, and nothing else.

Use (`tokenspeed.models.weight_prefetch`): launched on a side stream of a decode graph while the main stream runs
latency-bound kernels (the KDA recurrence, MLA attention, the MoE router), it pulls the weights of the projections
that come next into L2, so they stream from L2 instead of HBM when their turn comes. HBM is idle during those
kernels, so the prefetch costs the critical path nothing but the SM slots of a few short programs.

Contract: the tensor's bytes [0, nbytes) are prefetched in PIECE-byte requests (the last one rounded down to 16
bytes: at most 15 bytes are left out); the tensor must be contiguous and 16-byte aligned (`prefetchable`). A
prefetch is a hint: it reads nothing into the SM, writes nothing, waits for nothing and changes no result.
Compiled code only (sm_90 inline PTX): the interpreter and older GPUs do not run it (`l2_prefetch` is then a no-op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.triton._utils import l2_prefetch_bulk
from tokenspeed.ops.triton.pdl import hopper

PIECE = 4096  # bytes per prefetch request
PIECES = 64  # requests per program: 256 KiB a program, one warp


@triton.jit(do_not_specialize=["nbytes"])
def _l2_prefetch_kernel(base, nbytes, PIECE: tl.constexpr, PIECES: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (PIECE * PIECES) + tl.arange(0, PIECES).to(tl.int64) * PIECE
    size = tl.minimum(tl.maximum(nbytes - start, 0), PIECE).to(tl.int32) // 16 * 16
    l2_prefetch_bulk(base + start, size)


def prefetchable(t: Tensor) -> bool:
    """Whether `l2_prefetch` prefetches `t`: a contiguous, 16-byte aligned tensor on a Hopper (sm_90+) GPU."""
    return t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() > 0 and hopper(t.device)


def l2_prefetch(t: Tensor) -> int:
    """Prefetch `t`'s bytes into L2 on the current stream (one launch). Returns the bytes requested (0, and no
    launch, where `prefetchable(t)` is False). Mutates nothing."""
    if not prefetchable(t):
        return 0
    nbytes = t.numel() * t.element_size()
    grid = (triton.cdiv(nbytes, PIECE * PIECES),)
    _l2_prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, PIECE=PIECE, PIECES=PIECES,
                              num_warps=1)
    return nbytes // 16 * 16

