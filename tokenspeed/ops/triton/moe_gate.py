"""The MoE gate in one launch: residual add + RMSNorm, the fp32 router GEMV and the router's top-k, for decode.

Replaces three launches of a MoE layer's junction after attention (`add_rms_norm`, the router GEMV with fp32
output, `moe_route`) by one. Same contract as `tokenspeed.ops.reference.moe_gate.moe_gate`:

    summed = cast(residual + attn_out)                     (torch's `+`: one rounding to the model dtype)
    x      = rms_norm(summed, norm_weight, eps)            (the rounding of `ops.rms_norm`: gain after the downcast)
    logits = x @ router_weight^T                           (fp32 accumulation of the model-dtype products)
    weights, ids = moe_route(logits, bias, top_k, ...)     (sigmoid scoring; optional shared-expert column)

Grid: one program per block of BLOCK_N experts (E / BLOCK_N programs, e.g. 128 for Kimi-Linear's 256 experts).
Every program
1. loads its [BLOCK_N, K] router-weight rows and the norm gain into registers (before its PDL wait: weights);
2. recomputes the add and the norm of every token row (K = 2304 elements per row: cheaper than a second launch),
   BLOCK_T rows at a time, with the operation order and roundings of `triton.norm.add_rms_norm`; program 0 alone
   stores `summed` and `x` (the experts read x, the combine adds to summed);
3. dots the normed rows with its weight rows in fp32 and stores its [T, BLOCK_N] slice of the fp32 logits;
4. counts itself in on a per-device int32 counter (acq_rel, gpu scope, after a CTA barrier so every thread's
   logits store precedes the release): the program that arrives last resets the counter to 0 (for the next launch
   and the next graph replay) and routes all T tokens from the logits in L2 (.cg loads), by the math of
   `triton.moe_route` with sigmoid scoring, so the weights and ids are those `moe_route` gives on these logits.
Nobody waits for anybody (no spin), so the scheme cannot deadlock whatever the residency.

Why one counter per device is safe for every launch of this kernel (graph replays included): a program touches it
only after its `gdc_wait`, which returns once the previous kernel of the stream has completed; every PDL kernel
of this repository waits before it exits, so completion is ordered along the stream and the previous moe_gate
launch has finished (and reset the counter) before any program of the next one counts in. Without PDL, plain
stream order. Two launches on concurrent streams of one device would share it: not supported.

Bit-identity with `triton.moe_route`: the selection (max with lowest-index ties), sigmoid and scaling are
elementwise or exact; the renormalising sum of the k selected weights is a tree reduction whose order is fixed by
Triton's layout of a [.., BLOCK_K] tile, the same shape in both kernels; the CUDA test checks it bit for bit on
the GPU. `summed` / `x` equal `triton.norm.add_rms_norm`'s up to the order of the fp32 sum of squares (bit for bit
in the interpreter and, where the reductions associate alike, on the GPU).

PDL (`tokenspeed.ops.triton.pdl`, family "moe"): only the router weight and the norm gain are read before
`gdc_wait()` (model weights: no kernel of the last two launches writes them); attn_out, the residual and the
correction bias after it; `gdc_launch_dependents()` right after the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.ops.reference.moe import check_shared_expert_id
from tokenspeed.ops.triton import pdl
from tokenspeed.ops.triton._utils import next_pow2

MAX_TOKENS = 16  # rows (tokens) per call: each program recomputes the norm of every row
MAX_K = 8192  # hidden size: a program holds BLOCK_N full rows of the router weight in registers
MAX_EXPERTS = 1024  # the last program holds a [T, next_pow2(E)] tile of logits
MAX_TOP_K = 64


@dataclass(frozen=True)
class GateConfig:
    """Launch configuration: block_n experts per program (power of two), block_t token rows per step of the
    prologue (power of two), num_warps per program."""

    block_n: int = 2
    block_t: int = 1
    num_warps: int = 8


def default_config(T: int, E: int, K: int) -> GateConfig:
    """128 programs of 2 experts at Kimi-Linear's E = 256 (one wave on 132 SMs, 9 KB of weight each); token rows
    two at a time from T = 2 so a step's loads overlap (the prologue is a latency chain per step)."""
    block_n = max(1, min(2, next_pow2(E)))
    return GateConfig(block_n=block_n, block_t=1 if T <= 1 else 2, num_warps=8 if K > 1024 else 4)


@triton.jit
def _norm_rows(A, R, nw, trow, cols, T, K, stride_a, stride_r, eps, DTYPE: tl.constexpr):
    """Rows trow ([BLOCK_T]) of summed = cast(residual + attn_out) and x = cast(nw * cast(summed * rsqrt(mean(
    summed^2) + eps))), both [BLOCK_T, BLOCK_D] in DTYPE (the model dtype), padded rows / columns zero: the
    operation order and roundings of `triton.norm.add_rms_norm`."""
    t64 = trow.to(tl.int64)
    mask = (trow < T)[:, None] & (cols < K)[None, :]
    a = tl.load(A + t64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0)
    r = tl.load(R + t64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    h = (r.to(tl.float32) + a.to(tl.float32)).to(DTYPE)  # torch's `+`: one rounding
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)
    normed = (hf * inv[:, None]).to(DTYPE).to(tl.float32)  # rms_norm rounds before the gain
    return h, (nw[None, :] * normed).to(DTYPE)


@triton.jit
def _route_all(L, Bias, Wout, Iout, T, E, scaling,
               BLOCK_RT: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, OUT_K: tl.constexpr, SHARED_ID: tl.constexpr):
    """`triton.moe_route`'s sigmoid routing of all T rows of the fp32 logits L [T, E] at once (read through L2:
    other programs wrote them): Wout fp32 / Iout int64 [T, OUT_K], the routed TOP_K first (ids in descending order
    of score + bias, ties to the lower id), then (SHARED_ID, 1.0) when SHARED_ID >= 0."""
    rt = tl.arange(0, BLOCK_RT)
    rmask = rt < T
    r64 = rt.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    emask = cols < E
    lg = tl.load(L + r64[:, None] * E + cols[None, :], mask=rmask[:, None] & emask[None, :], other=-float("inf"),
                 cache_modifier=".cg")
    choice = 1.0 / (1.0 + tl.exp(-lg))
    if HAS_BIAS:
        choice = choice + tl.load(Bias + cols, mask=emask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(emask[None, :], choice, -float("inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_RT, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        _, best = tl.max(choice, axis=1, return_indices=True, return_indices_tie_break_left=True)
        ids = tl.where(kk[None, :] == j, best[:, None], ids)
        choice = tl.where(cols[None, :] == best[:, None], -float("inf"), choice)
    kmask = kk < TOP_K
    m2 = rmask[:, None] & kmask[None, :]
    xs = tl.load(L + r64[:, None] * E + ids, mask=m2, other=0.0, cache_modifier=".cg")
    w = 1.0 / (1.0 + tl.exp(-xs))  # the selected raw scores, recomputed from their logits: the same bits
    w = tl.where(kmask[None, :], w, 0.0)
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scaling
    tl.store(Wout + r64[:, None] * OUT_K + kk[None, :], w, mask=m2)
    tl.store(Iout + r64[:, None] * OUT_K + kk[None, :], ids.to(tl.int64), mask=m2)
    if SHARED_ID >= 0:
        tl.store(Wout + r64 * OUT_K + TOP_K, tl.full([BLOCK_RT], 1.0, tl.float32), mask=rmask)
        tl.store(Iout + r64 * OUT_K + TOP_K, tl.full([BLOCK_RT], SHARED_ID, tl.int64), mask=rmask)


@triton.jit(do_not_specialize=["T"])  # per-step counts: no recompile per value
def _moe_gate_kernel(
    A, R, NW, W, Bias, X, S, L, Wout, Iout, CNT,
    T, K, E,
    stride_a, stride_r, stride_w,
    eps, scaling,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_RT: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, OUT_K: tl.constexpr, SHARED_ID: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, E - 1).to(tl.int64)  # clamped: loads need no row mask; stores are masked
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < K
    # Weights only before the wait (PDL rule 1): this program's router rows and the norm gain.
    w = tl.load(W + rows[:, None] * stride_w + cols[None, :], mask=cmask[None, :], other=0.0)  # model dtype
    nw = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
    if PDL:  # attn_out / residual come from the previous kernels
        gdc_wait()
        gdc_launch_dependents()
    for t0 in range(0, T, BLOCK_T):
        trow = t0 + tl.arange(0, BLOCK_T)
        h, x = _norm_rows(A, R, nw, trow, cols, T, K, stride_a, stride_r, eps, X.dtype.element_ty)
        if pid == 0:  # one program stores the new residual stream and the normed rows (contiguous [T, K])
            offs = trow.to(tl.int64)[:, None] * K + cols[None, :]
            smask = (trow < T)[:, None] & cmask[None, :]
            tl.store(S + offs, h, mask=smask)
            tl.store(X + offs, x, mask=smask)
        acc = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_T, BLOCK_N]
        lmask = (trow < T)[:, None] & (offs_n < E)[None, :]
        tl.store(L + trow.to(tl.int64)[:, None] * E + offs_n[None, :], acc, mask=lmask)
    tl.debug_barrier()  # every thread's logits stores are issued before the (single-thread) release below
    arrived = tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:  # the last program: every slice of the logits is visible in L2
        tl.store(CNT, 0)  # ready for the next launch / graph replay
        _route_all(L, Bias, Wout, Iout, T, E, scaling, BLOCK_RT, BLOCK_E, TOP_K, BLOCK_K, HAS_BIAS, RENORM,
                   OUT_K, SHARED_ID)


# One arrival counter per device (int32, zero between launches), never freed: CUDA graphs keep its address.
_counters: dict[torch.device, Tensor] = {}


def counter(device: torch.device) -> Tensor | None:
    """The device's arrival counter (one int32 zero, restored to zero by every launch); created on first use, or
    None when that first use is inside a CUDA-graph capture (a capture would only record the zero fill): the
    caller then takes the unfused launches."""
    cnt = _counters.get(device)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = torch.zeros(1, dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the zero visible to every stream before any kernel counts in
        _counters[device] = cnt
    return cnt


def supported(attn_out: Tensor, residual: Tensor, norm_weight: Tensor, router_weight: Tensor, top_k: int,
              scoring: str) -> bool:
    """Whether the fused kernel covers the call (else the caller composes the three ops): 2-D [T, K] attn_out and
    residual of one shape and dtype (bf16 / fp16 / fp32) with unit column stride, 1 <= T <= MAX_TOKENS, K <= MAX_K,
    a [K] norm gain, a row-major [E, K] router weight of the same dtype, E <= MAX_EXPERTS, 1 <= top_k <=
    min(E, MAX_TOP_K), sigmoid scoring."""
    if attn_out.dim() != 2 or residual.shape != attn_out.shape or residual.dtype != attn_out.dtype:
        return False
    T, K = attn_out.shape
    E = router_weight.shape[0] if router_weight.dim() == 2 else 0
    return (scoring == "sigmoid" and 1 <= T <= MAX_TOKENS and 1 <= K <= MAX_K and 1 <= E <= MAX_EXPERTS
            and 1 <= top_k <= min(E, MAX_TOP_K) and attn_out.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and router_weight.shape == (E, K) and router_weight.dtype == attn_out.dtype
            and router_weight.stride(1) == 1 and norm_weight.shape == (K,)
            and attn_out.stride(1) == 1 and residual.stride(1) == 1)


def _outputs(T: int, K: int, n: int, like: Tensor, out: tuple[Tensor, ...] | None) -> tuple[Tensor, ...]:
    """(x, summed [T, K] like's dtype, weights fp32, ids int64 [T, n]): `out` checked (contiguous), or new."""
    if out is None:
        dev = like.device
        return (torch.empty(T, K, dtype=like.dtype, device=dev), torch.empty(T, K, dtype=like.dtype, device=dev),
                torch.empty(T, n, dtype=torch.float32, device=dev), torch.empty(T, n, dtype=torch.int64, device=dev))
    want = ((T, K, like.dtype), (T, K, like.dtype), (T, n, torch.float32), (T, n, torch.int64))
    if len(out) != 4 or any(o.shape != (r, c) or o.dtype != dt or not o.is_contiguous()
                            for o, (r, c, dt) in zip(out, want, strict=False)):
        raise ValueError(f"out must be contiguous (x, summed [{T}, {K}] {like.dtype}, weights fp32, ids int64 "
                         f"[{T}, {n}])")
    return out


def _unfused(attn_out: Tensor, residual: Tensor, norm_weight: Tensor, norm_eps: float, router_weight: Tensor,
             correction_bias: Tensor | None, top_k: int, route_kw: dict, outs: tuple[Tensor, ...],
             logits: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The three Triton launches the fused kernel replaces (`add_rms_norm`, the fp32-output GEMV, `moe_route`),
    into the same outputs: for a first call inside a CUDA-graph capture (no counter yet)."""
    from tokenspeed.ops.triton import gemv, moe_route, norm

    x, summed, weights, ids = outs
    norm.add_rms_norm(attn_out, residual, norm_weight, norm_eps, out=x, summed=summed)
    gemv.gemv(x, router_weight, out_dtype=torch.float32, out=logits)
    moe_route.moe_route(logits, correction_bias, top_k, out=(weights, ids), **route_kw)
    return x, summed, weights, ids


def moe_gate(
    attn_out: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    router_weight: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    *,
    scoring: str = "sigmoid",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    shared_expert_id: int | None = None,
    config: GateConfig | None = None,
    out: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    logits: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton `ops.moe_gate` (same contract, `supported` region): returns (x [T, K], summed [T, K] in attn_out's
    dtype, weights [T, n] fp32, ids [T, n] int64), n = top_k (+ 1 with `shared_expert_id`: the last column
    (shared_expert_id, 1.0)). Inputs are only read. Triton-only keywords: `config` (launch configuration; default
    `default_config`), `out` (the four tensors to write, contiguous, returned as they are), `logits` (a contiguous
    [T, E] fp32 tensor that receives the router logits; else a scratch buffer). CUDA-graph safe: no host
    synchronisation (except the counter's creation on the first call, which must not be inside a capture: a first
    call inside one runs the three unfused launches instead). Raises ValueError outside `supported`."""
    if not supported(attn_out, residual, norm_weight, router_weight, top_k, scoring):
        raise ValueError("moe_gate: unsupported call (see tokenspeed.ops.triton.moe_gate.supported)")
    T, K = attn_out.shape
    E = router_weight.shape[0]
    check_shared_expert_id(shared_expert_id, E)
    n = top_k + (shared_expert_id is not None)
    outs = _outputs(T, K, n, attn_out, out)
    if logits is None:
        logits = torch.empty(T, E, dtype=torch.float32, device=attn_out.device)
    elif logits.shape != (T, E) or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous [{T}, {E}] fp32 tensor")
    route_kw = {"scoring": scoring, "renormalize": renormalize, "routed_scaling_factor": routed_scaling_factor,
                "shared_expert_id": shared_expert_id}
    cnt = counter(attn_out.device)
    if cnt is None:
        return _unfused(attn_out, residual, norm_weight, norm_eps, router_weight, correction_bias, top_k, route_kw,
                        outs, logits)
    cfg = config or default_config(T, E, K)
    if any(v < 1 or v & (v - 1) for v in (cfg.block_n, cfg.block_t, cfg.num_warps)):
        raise ValueError(f"GateConfig fields must be powers of two; got {cfg}")
    x, summed, weights, ids = outs
    _moe_gate_kernel[(triton.cdiv(E, cfg.block_n),)](
        attn_out, residual, norm_weight, router_weight,
        correction_bias if correction_bias is not None else logits,
        x, summed, logits, weights, ids, cnt,
        T, K, E, attn_out.stride(0), residual.stride(0), router_weight.stride(0),
        float(norm_eps), float(routed_scaling_factor),
        BLOCK_T=min(cfg.block_t, next_pow2(T)), BLOCK_N=cfg.block_n, BLOCK_D=next_pow2(K),
        BLOCK_RT=next_pow2(T), BLOCK_E=next_pow2(E), TOP_K=top_k, BLOCK_K=next_pow2(top_k),
        HAS_BIAS=correction_bias is not None, RENORM=bool(renormalize), OUT_K=n,
        SHARED_ID=-1 if shared_expert_id is None else int(shared_expert_id),
        num_warps=cfg.num_warps, **pdl.kernel_kwargs(attn_out.device, "moe"),
    )
    return x, summed, weights, ids
