"""The direct mode's two expert GEMMs in one persistent launch (decode: T <= `ExpertsConfig.direct_max_tokens`).

Why: in the direct mode gate_up and down are two launches, so down's weight stream cannot start before the last
gate_up program ends, and gate_up's last partial wave streams at a fraction of the HBM rate (kimi-linear-48b-a3b
at T = 1: 288 gate_up programs on 264 resident slots). Here G resident programs walk one list of work items in
round-robin order (program g takes items g, g + G, ...):

    items 0 .. P * n1 - 1          gate_up tile (pair p = i // n1, N tile i % n1): `_gate_up_rows`, DIRECT
    items P * n1 .. + P * n2 - 1   down tile (pair p = j // n2, N tile j % n2): `_down_rows`, DIRECT

A gate_up item stores its h tile, then bumps its pair's counter (a CTA barrier, then an atomic add with release
semantics at GPU scope). A down item of pair p first spins until p's counter reaches n1 (acquire), then reads h
through L2 (`.cg`: L1 is not coherent). Items are pair-major, so the down items of the first pairs come due as
soon as the programs finish their first gate_up item: the W2 stream follows the W1 / W3 stream without a gap.

Deadlock freedom: every program's items are increasing, and every gate_up item precedes every down item, so a
program only waits after it has done all its own gate_up items; it waits for gate_up items of other programs,
which wait on nothing. That needs all G programs resident at once: G <= SMs x the programs that fit an SM by
registers, shared memory and threads (`resident_programs`, from the compiled kernel), at most PROGRAMS_PER_SM.
Under PDL our programs trigger their dependents only after their wait, so a dependent cannot take an SM slot
before all of ours hold one; the launch before ours never waits on us. The Triton interpreter runs programs one
after another: there G = 1 (every wait is already met).

The counters ([2 + P] int32 per device: the exit count, the ticket of DYNAMIC's work queue, then one per pair)
start at zero and are zeroed by the last program to leave (the exit count, acq_rel), so the buffer is ready for the next call without a memset launch
(graph-safe, PDL chain unbroken). The next call on the device runs after this one has completed (it is at least
two launches later and waits for its predecessor). Contract: calls on one device do not overlap in time (one
stream, as the engine's decode runs). Results: every h and buffer element is computed by the same functions
with the same tiles as the two-launch direct mode, so the output is the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton.moe_config import ExpertsConfig
from tokenspeed.ops.triton.moe_experts import _down_rows, _gate_up_rows
from tokenspeed.ops.triton.moe_pdl import _pdl_sync, _prefetch_rows_l2, _sm_count

ENV = "TOKENSPEED_MOE_FUSED"
# Whether decode calls in the direct mode take the fused launch unless ENV says otherwise.
FUSED = False
# Most programs a SM the grid may hold (also capped by what fits an SM).
PROGRAMS_PER_SM = 2
# Pairs the counter buffer holds (direct calls: T <= direct_max_tokens, so T * k is small).
MAX_PAIRS = 1022
# Work order: round-robin (False) or a ticket counter (True), and the down items' W2 L2 prefetch before their wait.
DYNAMIC = False
PREFETCH_W2 = False
SYNC_PAIRS = tl.constexpr(2)  # Sync[0] the exit count, Sync[1] the ticket, then the pairs' counters

_sync: dict[int, Tensor] = {}
_resident: dict[tuple, int] = {}


def fused_on() -> bool:
    """FUSED, or TOKENSPEED_MOE_FUSED when set ("0" / "1"). Raises ValueError on another value."""
    import os

    v = os.environ.get(ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1; got {v!r}")
    return v == "1" if v else FUSED


@triton.jit
def _wait_count(Counter, target):
    """Spin until *Counter >= target (acquire at GPU scope), then a CTA barrier so every thread's later loads
    come after it."""
    while tl.atomic_add(Counter, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _signal(Counter):
    """Publish this program's stores (CTA barrier, then a release add at GPU scope) by bumping *Counter."""
    tl.debug_barrier()
    tl.atomic_add(Counter, 1, sem="release", scope="gpu")


@triton.jit
def _item(it, X, W1, W3, W2, H, Buf, Ids, Sync,
          P, D, DI, E, n1, first_down, stride_xt,
          stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d,
          stride_w2e, stride_w2d, stride_w2i, beta, linear_beta, pf_bytes,
          TOP_K: tl.constexpr, BM1: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
          BM2: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
          SITU: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_K2: tl.constexpr, IEEE: tl.constexpr,
          PREFETCH2: tl.constexpr):
    """Work item `it` (see the module docstring). PREFETCH2: a down item L2-prefetches pf_bytes of each of its W2
    rows before it waits for h (a hint; compiled code only)."""
    if it < first_down:
        p = it // n1
        e = tl.load(Ids + p)
        if (e >= 0) & (e < E):
            _gate_up_rows(X, W1, W3, H, Ids, p, e, it % n1, P, D, DI, stride_xt,
                          stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d, beta,
                          linear_beta, TOP_K, BM1, BN1, BK1, SITU, EVEN_K1, IEEE, False, False, True)
        _signal(Sync + SYNC_PAIRS + p)
    else:
        n2 = tl.cdiv(D, BN2)
        j = it - first_down
        p = j // n2
        e = tl.load(Ids + p)
        e = tl.where((e >= 0) & (e < E), e, E)  # invalid ids: the zero-storing branch of _down_rows
        if PREFETCH2:  # noqa: SIM102 - a compile-time branch around a runtime one
            if e < E:
                _prefetch_rows_l2(W2, e, (j % n2) * BN2 + tl.arange(0, BN2), D, stride_w2e, stride_w2d, pf_bytes)
        _wait_count(Sync + SYNC_PAIRS + p, n1)
        _down_rows(H, W2, Buf, Ids, p, e, j % n2, P, D, DI, E, stride_w2e, stride_w2d, stride_w2i, 0,
                   BM2, BN2, BK2, EVEN_K2, IEEE, False, True, False, False, True)


@triton.jit(do_not_specialize=["P", "G"])  # per-step counts and the grid size: no recompile per value
def _fused_direct_kernel(
    X, W1, W3, W2, H, Buf, Ids, Sync,
    P, D, DI, E, G, n1, n2,
    stride_xt,
    stride_w1e, stride_w1i, stride_w1d,
    stride_w3e, stride_w3i, stride_w3d,
    stride_w2e, stride_w2d, stride_w2i,
    beta, linear_beta, pf_bytes,
    TOP_K: tl.constexpr,
    BM1: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
    BM2: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
    SITU: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_K2: tl.constexpr, IEEE: tl.constexpr,
    DYNAMIC: tl.constexpr = False, PREFETCH2: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (G,): see the module docstring. Ids: topk_ids flattened [P]; H [P, DI], Buf [P, D] (x.dtype); Sync
    int32 [SYNC_PAIRS + P] (exit count, ticket, then a counter a pair), zero on entry and on exit. DYNAMIC: each
    program takes its next item from the ticket counter (an atomic add) instead of round-robin. PDL: waits first
    thing (the ids come from the launch before)."""
    _pdl_sync(PDL)
    first_down = P * n1
    total = first_down + P * n2
    if DYNAMIC:
        it = tl.atomic_add(Sync + 1, 1, sem="relaxed", scope="gpu")
        while it < total:
            _item(it, X, W1, W3, W2, H, Buf, Ids, Sync, P, D, DI, E, n1, first_down, stride_xt,
                  stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d,
                  stride_w2e, stride_w2d, stride_w2i, beta, linear_beta, pf_bytes,
                  TOP_K, BM1, BN1, BK1, BM2, BN2, BK2, SITU, EVEN_K1, EVEN_K2, IEEE, PREFETCH2)
            it = tl.atomic_add(Sync + 1, 1, sem="relaxed", scope="gpu")
    else:
        for it in range(tl.program_id(0), total, G):
            _item(it, X, W1, W3, W2, H, Buf, Ids, Sync, P, D, DI, E, n1, first_down, stride_xt,
                  stride_w1e, stride_w1i, stride_w1d, stride_w3e, stride_w3i, stride_w3d,
                  stride_w2e, stride_w2d, stride_w2i, beta, linear_beta, pf_bytes,
                  TOP_K, BM1, BN1, BK1, BM2, BN2, BK2, SITU, EVEN_K1, EVEN_K2, IEEE, PREFETCH2)
    tl.debug_barrier()
    if tl.atomic_add(Sync, 1, sem="acq_rel", scope="gpu") == G - 1:  # the last program out zeroes the counters
        for q in range(0, P):
            tl.store(Sync + SYNC_PAIRS + q, 0)
        tl.store(Sync + 1, 0)
        tl.store(Sync, 0)


def sync_buffer(device: torch.device, pairs: int) -> Tensor | None:
    """The device's zeroed counter buffer [2 + MAX_PAIRS] int32 (made on first use), or None when `pairs` exceeds
    it or it does not exist yet while a CUDA graph is being captured (the caller then takes the two launches)."""
    if pairs > MAX_PAIRS:
        return None
    key = device.index if device.type == "cuda" and device.index is not None else -1
    if device.type == "cuda" and key < 0:
        key = torch.cuda.current_device()
    buf = _sync.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _sync[key] = torch.zeros(2 + MAX_PAIRS, dtype=torch.int32, device=device)
    return buf


def programs_per_sm(n_regs: int, shared: int, num_warps: int, cap: int | None = None) -> int:
    """Programs of this kernel one H100 / H200 SM holds at once (64K registers, 227 KB of shared memory, 2048
    threads, registers allocated per warp in units of 256), at least 1 and at most cap."""
    cap = PROGRAMS_PER_SM if cap is None else cap
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_smem = (227 * 1024) // (shared + 1024) if shared else cap
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(cap, by_regs, by_smem, by_threads))


def _note_residency(compiled, key: tuple, num_warps: int) -> None:
    """Record how many programs of the compiled kernel fit an SM (from its registers and shared memory; 1 when
    the launch did not return them), for the grid of the next calls with the same key."""
    n_regs = getattr(compiled, "n_regs", None)
    shared = getattr(getattr(compiled, "metadata", None), "shared", None)
    ok = isinstance(n_regs, int) and n_regs > 0 and isinstance(shared, int)
    _resident[key] = programs_per_sm(n_regs, shared, num_warps) if ok else 1


def experts_direct_fused(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, pair_ids: Tensor, top_k: int,
                         act: Activation, cfg: ExpertsConfig) -> Tensor | None:
    """The direct mode's per-pair buffer [P, D] (x.dtype) from one launch: bit for bit `down_direct(
    gate_up_direct(...))` with the same cfg (its tiles, warps and stages; tail_m1 / tail_m2 halve the tile
    heights as there). pair_ids: topk_ids flattened, [P] contiguous. None when the counter buffer cannot be used
    (see `sync_buffer`): the caller runs the two launches. Mutates only the device's counter buffer (zero again
    when the launch ends)."""
    P = pair_ids.numel()
    sync = sync_buffer(x.device, P)
    if sync is None:
        return None
    D = x.shape[1]
    E, DI, _ = w1.shape
    bm1 = cfg.block_m // 2 if cfg.tail_m1 else cfg.block_m
    bm2 = cfg.block_m2 or cfg.block_m
    bm2 = bm2 // 2 if cfg.tail_m2 else bm2
    n1, n2 = triton.cdiv(DI, cfg.block_n1), triton.cdiv(D, cfg.block_n2)
    h = torch.empty(P, DI, dtype=x.dtype, device=x.device)
    buf = torch.empty(P, D, dtype=x.dtype, device=x.device)
    kw = pdl.kernel_kwargs(x.device, "moe")
    prefetch = PREFETCH_W2 and x.device.type == "cuda" and w2.data_ptr() % 16 == 0 and \
        (w2.stride(1) * w2.element_size()) % 16 == 0 and (w2.stride(0) * w2.element_size()) % 16 == 0 and \
        w2.stride(2) == 1
    pf_bytes = DI * w2.element_size() // 16 * 16 if prefetch else 0
    consts = dict(DYNAMIC=DYNAMIC, PREFETCH2=pf_bytes > 0, TOP_K=top_k, BM1=bm1, BN1=cfg.block_n1, BK1=cfg.block_k1, BM2=bm2, BN2=cfg.block_n2,
                  BK2=cfg.block_k2, SITU=act.kind == "situ", EVEN_K1=D % cfg.block_k1 == 0,
                  EVEN_K2=DI % cfg.block_k2 == 0, IEEE=x.dtype == torch.float32,
                  num_warps=cfg.num_warps1, num_stages=cfg.num_stages1, **kw)

    def args(G: int) -> tuple:
        return (x, w1, w3, w2, h, buf, pair_ids, sync, P, D, DI, E, G, n1, n2, x.stride(0),
                w1.stride(0), w1.stride(1), w1.stride(2), w3.stride(0), w3.stride(1), w3.stride(2),
                w2.stride(0), w2.stride(1), w2.stride(2), float(act.beta), float(act.linear_beta), pf_bytes)

    items = P * (n1 + n2)
    if x.device.type != "cuda":  # the interpreter runs programs one after another: one program, no waiting
        _fused_direct_kernel[(1,)](*args(1), **consts)
        return buf
    # The first call of a variant runs one program a SM (always resident); later calls use the compiled
    # kernel's residency. G is not specialized on, so its value never recompiles.
    key = (x.device.index, x.dtype, D, DI, tuple(sorted(consts.items())))
    per_sm = _resident.get(key)
    G = max(1, min(items, (per_sm or 1) * _sm_count(x.device)))
    compiled = _fused_direct_kernel[(G,)](*args(G), **consts)
    if per_sm is None:
        _note_residency(compiled, key, cfg.num_warps1)
    return buf
