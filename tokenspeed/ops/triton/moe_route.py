"""MoE router in one launch: scores (sigmoid or softmax), top-k of score + correction bias, renormalise, scale.

One program per token (one warp for E <= 1024, so every reduction stays inside the warp: no shared memory, no
barriers) holds all E scores in registers (E <= 8192) and selects the top k by k rounds of max-with-index (ties go
to the lower expert id, like the reference's stable descending sort), so ids come out in descending order of
selection score. Weights are the selected raw scores, divided by (their sum + 1e-20) when
`renormalize`, times `routed_scaling_factor`. Same contract as `tokenspeed.ops.reference.moe.moe_route`.

Beyond the public contract (Triton-only keywords): `out` (write into given tensors) and `shared_expert_id` (a
shared expert folded into the routed ones as an always-selected (k+1)-th expert, its weights stacked after the E
routed ones: id E): each row gets one more column, (shared_expert_id, 1.0), written by the same program after the
routed k, whose values (selection, renormalisation, scaling) are the same as without it; the reference of that is
`tokenspeed.ops.reference.moe.with_shared_expert` applied to the routed output.

PDL (`tokenspeed.ops.triton.pdl`): on Hopper the kernel launches as a programmatic dependent and waits first
thing: its logits come from the launch right before it (the router GEMV), and the correction bias, though a
weight, is a caller's argument whose producer is not known here, so nothing is read before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.reference.moe import check_shared_expert_id
from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2

MAX_EXPERTS = 8192


@triton.jit
def _moe_route_kernel(
    L, Bias, Wout, Iout,
    E, stride_l,
    scaling,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    OUT_K: tl.constexpr,
    SHARED_ID: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One token per program: Wout / Iout rows of OUT_K columns, the routed TOP_K first; SHARED_ID >= 0 (then
    OUT_K = TOP_K + 1): column TOP_K is (SHARED_ID, 1.0). PDL: wait for the logits' producer first."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t64 = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    emask = cols < E
    x = tl.load(L + t64 * stride_l + cols, mask=emask, other=-float("inf")).to(tl.float32)
    if SOFTMAX:
        mx = tl.max(x, axis=0)
        e = tl.where(emask, tl.exp(x - mx), 0.0)
        denom = tl.sum(e, axis=0)
        scores = e / denom
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    if HAS_BIAS:
        choice = scores + tl.load(Bias + cols, mask=emask, other=0.0).to(tl.float32)
    else:
        choice = scores
    choice = tl.where(emask, choice, -float("inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        # One reduction per round: the max and its (lowest) index together.
        _, best = tl.max(choice, axis=0, return_indices=True, return_indices_tie_break_left=True)
        ids = tl.where(kk == j, best, ids)
        choice = tl.where(cols == best, -float("inf"), choice)
    # The selected raw scores, recomputed from their logits with the same formula (bitwise the same values).
    kmask = kk < TOP_K
    xs = tl.load(L + t64 * stride_l + ids, mask=kmask, other=0.0).to(tl.float32)
    if SOFTMAX:
        w = tl.exp(xs - mx) / denom
    else:
        w = 1.0 / (1.0 + tl.exp(-xs))
    w = tl.where(kmask, w, 0.0)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    w = w * scaling
    tl.store(Wout + t64 * OUT_K + kk, w, mask=kmask)
    tl.store(Iout + t64 * OUT_K + kk, ids.to(tl.int64), mask=kmask)
    if SHARED_ID >= 0:
        tl.store(Wout + t64 * OUT_K + TOP_K, 1.0)
        tl.store(Iout + t64 * OUT_K + TOP_K, tl.full([], SHARED_ID, tl.int64))


def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    *,
    scoring: str = "sigmoid",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    shared_expert_id: int | None = None,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton `ops.moe_route` (same contract): returns (weights [T, n] fp32, ids [T, n] int64), n = top_k, or
    top_k + 1 with `shared_expert_id` (>= E; the last column (shared_expert_id, 1.0)). `out`: the two tensors to
    write, contiguous [T, n] (returned as they are)."""
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"unknown router scoring {scoring!r}; supported: 'sigmoid', 'softmax'")
    T, E = router_logits.shape
    if not 1 <= top_k <= E or E > MAX_EXPERTS:
        raise ValueError(f"need 1 <= top_k <= E <= {MAX_EXPERTS}; got top_k={top_k}, E={E}")
    check_shared_expert_id(shared_expert_id, E)
    n = top_k + (shared_expert_id is not None)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    if out is None:
        weights = torch.empty(T, n, dtype=torch.float32, device=logits.device)
        ids = torch.empty(T, n, dtype=torch.int64, device=logits.device)
    else:
        weights, ids = out
        if weights.shape != (T, n) or ids.shape != (T, n) or weights.dtype != torch.float32 \
                or ids.dtype != torch.int64 or not (weights.is_contiguous() and ids.is_contiguous()):
            raise ValueError(f"out must be contiguous (weights fp32, ids int64), both [T, {n}]")
    if T == 0:
        return weights, ids
    block_e = next_pow2(E)
    _moe_route_kernel[(T,)](
        logits, correction_bias if correction_bias is not None else logits, weights, ids,
        E, logits.stride(0), float(routed_scaling_factor),
        BLOCK_E=block_e, TOP_K=top_k, BLOCK_K=next_pow2(top_k), SOFTMAX=scoring == "softmax",
        HAS_BIAS=correction_bias is not None, RENORM=bool(renormalize), OUT_K=n,
        SHARED_ID=-1 if shared_expert_id is None else int(shared_expert_id),
        num_warps=1 if block_e <= 1024 else (2 if block_e <= 4096 else 4), **pdl.kernel_kwargs(logits.device, "moe"),
    )
    return weights, ids


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (uint32 arithmetic wraps)."""
    h = h ^ (h >> 16)
    h = h * tl.full([], 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full([], 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["salt"])  # one compiled variant for every layer's salt
def _simulate_routing_kernel(W, Iout, stride_w, stride_i, salt, E, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row t: ids[t, :K] = (hash(bits of W[t, 0], t, salt) + j) mod E (`simulate_uniform_routing`)."""
    t = tl.program_id(0)
    bits = tl.load(W + t.to(tl.int64) * stride_w).to(tl.uint32, bitcast=True)
    row = t.to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32)
    h = _fmix32(bits ^ row ^ salt.to(tl.uint32))
    start = (h % E.to(tl.uint32)).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    tl.store(Iout + t.to(tl.int64) * stride_i + j, (start + j) % E, mask=j < K)


def simulate_uniform_routing(weights: Tensor, ids: Tensor, num_routed: int, num_experts: int, salt: int) -> Tensor:
    """Triton `ops.moe_simulate_routing` (the reference's contract): ids[:, :num_routed] overwritten in place, in
    one launch (no PDL: the launches around it wait for its completion)."""
    T = ids.shape[0]
    if T:
        _simulate_routing_kernel[(T,)](
            weights, ids, weights.stride(0), ids.stride(0), (salt * 0x27D4EB2F) & 0xFFFFFFFF, num_experts,
            K=num_routed, BLOCK_K=next_pow2(num_routed), num_warps=1,
        )
    return ids
