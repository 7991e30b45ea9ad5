"""Every op the models call, behind one public function each.

Models import `tokenspeed.ops` only, never a concrete kernel. Each function runs its plain torch reference
(`tokenspeed.ops.reference.*`, the ground truth and the CPU path) or, for CUDA tensors, the Triton kernel of the
same contract in `tokenspeed.ops.triton` (`rms_norm`, `gated_rms_norm`, `add_rms_norm`, `gated_activation`,
`gated_activation_merged`, `attn_res_mix`, `attn_res_mix_rms_norm`, `moe_route`, `kda_decode`, `kda_replay_layers`,
`moe_experts`, `mla_decode`, `mla_norm_store_latent`, and `linear` where the GEMV routing table picks it).
`TOKENSPEED_OPS=reference` forces the reference; `tokenspeed.ops.dispatch` has the rule.
"""

from __future__ import annotations

import itertools
import os

import torch
from torch import Tensor

from tokenspeed.ops import dispatch as _dispatch
from tokenspeed.ops.kda_layers import KdaLayerTable, KdaLayerTensors
from tokenspeed.ops.reference import activation as _ref_act
from tokenspeed.ops.reference import attn_res as _ref_attn_res
from tokenspeed.ops.reference import conv as _ref_conv
from tokenspeed.ops.reference import mla as _ref_mla
from tokenspeed.ops.reference import moe as _ref_moe
from tokenspeed.ops.reference import norm as _ref_norm
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.kda import kda_chunk, kda_gate, kda_recurrent, l2_normalize
from tokenspeed.ops.reference.mla import (
    mla_attention_paged,
    mla_gather_latent,
    mla_store_latent,
)
from tokenspeed.ops.reference.rope import apply_rope, rope_cos_sin, yarn_mscale


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor, cu_seqlens: Tensor,
                  activation: str | None = "silu", *, out: Tensor | None = None) -> Tensor:
    """Causal depthwise conv1d over a flat variable-length batch, carrying per-slot state (KDA's short conv).

    Contract: `tokenspeed.ops.reference.conv.causal_conv1d` (x [T, C], weight [C, W], conv_state [S, C, W-1]
    updated in place for sequences with >= 1 token, state_indices [N], cu_seqlens [N+1]; y [T, C] in x.dtype,
    computed in fp32). The Triton path (`_dispatch.conv_supported`: 2-D x with unit column stride, W <= 4,
    silu / None, index tensors on x's device) never synchronises with the host (CUDA-graph safe), does not
    validate cu_seqlens, and also accepts state_indices[n] < 0 as "no state: zero history, nothing stored"
    (padding rows); the reference requires valid slots. `out` (optional, written and returned): [T, C], or
    [T, G, C // G] with unit last stride, e.g. a [G, T, C // G] buffer permuted so each channel group (KDA's q, k,
    v) comes out contiguous.
    """
    if _dispatch.use_triton(x, weight, conv_state, state_indices, cu_seqlens) and _dispatch.conv_supported(
        x, weight, conv_state, state_indices, cu_seqlens, activation
    ):
        return _dispatch.kernels("conv").causal_conv1d(x, weight, conv_state, state_indices, cu_seqlens, activation,
                                                       out=out)
    return _ref_conv.causal_conv1d(x, weight, conv_state, state_indices, cu_seqlens, activation, out=out)


def linear(x: Tensor, weight: Tensor, *, out_dtype: torch.dtype | None = None) -> Tensor:
    """y = x @ weight^T, the function of `torch.nn.functional.linear(x, weight)` (no bias): x [..., K],
    weight [N, K] -> [..., N] in out_dtype.

    out_dtype: None (x.dtype) or torch.float32; fp32 with bf16 / fp16 inputs gives the fp32 accumulation without
    rounding it to 16 bits (the MoE router's logits; torch: `torch.mm(..., out_dtype=torch.float32)` on CUDA, the
    fp32 product of the values elsewhere).
    Small-M projections (M = rows of x, 1..16) on CUDA run the Triton GEMV (fp32 accumulation, one rounding) when
    the routing table (`tokenspeed/ops/gemv_table.json`, measured with a cold L2 by benchmarks/gemv_h200.py) says
    it beats torch for that (M bucket, N, K) and dtype; widening calls also where the table has no entry
    (`dispatch.linear_config`); everything else is torch (CPU calls too, unless TOKENSPEED_OPS=triton forces the
    kernel in the interpreter). The choice is made on the host from shapes and dtypes only (safe inside CUDA-graph
    capture). Raises ValueError for another out_dtype.
    """
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, x.dtype or torch.float32; got {out_dtype}")
    cfg = _dispatch.linear_config(x, weight, out_dtype)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if cfg is not None:
        y = _dispatch.kernels("gemv").gemv(x2, weight, out_dtype=out_dtype, **cfg)
    elif out_dtype is None or out_dtype == x.dtype:
        return torch.nn.functional.linear(x, weight)
    elif x.is_cuda and _dispatch.linear_widens(x, out_dtype) and weight.dtype == x.dtype:
        y = torch.mm(x2, weight.t(), out_dtype=out_dtype)  # cuBLAS, fp32 accumulation and output
    else:
        y = torch.nn.functional.linear(x2.to(out_dtype), weight.to(out_dtype))
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


STACKED_GEMV_ENV = "TOKENSPEED_STACKED_GEMV"


def stacked_linear(x: Tensor, weight: Tensor, *, out: Tensor | None = None) -> Tensor:
    """G independent projections y[g] = x[:, g] @ weight[g]^T: x [T, G * K] (G adjacent column groups) or
    [T, G, K], any strides with a unit last one; weight [G, N, K], any strides -> y [G, T, N] in x.dtype (fp32
    accumulation, one rounding), written into `out` when given ([G, T, N], unit last stride) and returned.
    On the Triton path and for at most `stacked_gemv.MAX_ROWS` rows, one PDL launch of `ops.triton.stacked_gemv`
    (which keeps a decode step's chain of dependent launches unbroken: the H200 batch-1 / 2 step 3-4% faster than
    with cuBLAS); otherwise, or when TOKENSPEED_STACKED_GEMV=0 (read per call), `torch.bmm`."""
    if (os.environ.get(STACKED_GEMV_ENV, "1").strip() != "0" and _dispatch.use_triton(x, weight, out)
            and _dispatch.kernels("stacked_gemv").supported(x, weight, out)):
        return _dispatch.kernels("stacked_gemv").stacked_linear(x, weight, out)
    g, _, k = weight.shape
    xg = x.view(x.shape[0], g, k) if x.dim() == 2 else x
    return torch.bmm(xg.transpose(0, 1), weight.transpose(1, 2), out=out)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _dispatch.use_triton(x, weight) and _dispatch.norm_supported(x):
        return _dispatch.kernels("norm").rms_norm(x, weight, eps)
    return _ref_norm.rms_norm(x, weight, eps)


# Rows up to which `add_rms_norm` runs the fused kernel. Above, torch's add then the Triton norm (the same
# numbers): on the H200 at 2304 wide the fused kernel took 1.8-2.0 us against 3.0-3.2 us in a graph at 1 and 64
# rows, but 92 against 78 us at 8192 rows (benchmarks/results/fusions_h200.json).
ADD_NORM_FUSED_MAX_ROWS = 256


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if _dispatch.use_triton(x, residual, weight) and _dispatch.add_norm_supported(x, residual):
        if x.numel() <= ADD_NORM_FUSED_MAX_ROWS * x.shape[-1]:
            return _dispatch.kernels("norm").add_rms_norm(x, residual, weight, eps)
        summed = residual + x
        return _dispatch.kernels("norm").rms_norm(summed, weight, eps), summed
    return _ref_norm.add_rms_norm(x, residual, weight, eps)


def gated_activation(gate: Tensor, up: Tensor, act: Activation) -> Tensor:
    if _dispatch.use_triton(gate, up) and _dispatch.activation_supported(gate, up, act):
        return _dispatch.kernels("activation").gated_activation(gate, up, act)
    return _ref_act.gated_activation(gate, up, act)


def gated_activation_merged(gate_up: Tensor, act: Activation) -> Tensor:
    if _dispatch.use_triton(gate_up) and _dispatch.activation_merged_supported(gate_up, act):
        return _dispatch.kernels("activation").gated_activation_merged(gate_up, act)
    return _ref_act.gated_activation_merged(gate_up, act)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _dispatch.use_triton(x, gate, weight) and _dispatch.norm_supported(x) and gate.shape == x.shape:
        return _dispatch.kernels("norm").gated_rms_norm(x, gate, weight, eps)
    return _ref_norm.gated_rms_norm(x, gate, weight, eps)


def attn_res_mix(blocks: Tensor, partial: Tensor, query: Tensor, eps: float) -> Tensor:
    if _dispatch.use_triton(blocks, partial, query) and _dispatch.attn_res_supported(blocks, partial):
        return _dispatch.kernels("attn_res").attn_res_mix(blocks, partial, query, eps)
    return _ref_attn_res.attn_res_mix(blocks, partial, query, eps)


def attn_res_mix_rms_norm(
    blocks: Tensor, partial: Tensor, query: Tensor, eps: float, norm_weight: Tensor, norm_eps: float
) -> Tensor:
    if _dispatch.use_triton(blocks, partial, query, norm_weight) and _dispatch.attn_res_supported(blocks, partial):
        return _dispatch.kernels("attn_res").attn_res_mix_rms_norm(blocks, partial, query, eps, norm_weight,
                                                                   norm_eps)
    return _ref_attn_res.attn_res_mix_rms_norm(blocks, partial, query, eps, norm_weight, norm_eps)


def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    *,
    scoring: str = "sigmoid",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    shared_expert_id: int | None = None,
) -> tuple[Tensor, Tensor]:
    if _dispatch.use_triton(router_logits, correction_bias) and _dispatch.moe_route_supported(
        router_logits, top_k, scoring
    ):
        return _dispatch.kernels("moe_route").moe_route(
            router_logits, correction_bias, top_k, scoring=scoring, renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor, shared_expert_id=shared_expert_id,
        )
    return _ref_moe.moe_route(router_logits, correction_bias, top_k, scoring=scoring, renormalize=renormalize,
                              routed_scaling_factor=routed_scaling_factor, shared_expert_id=shared_expert_id)


def moe_simulate_routing(weights: Tensor, ids: Tensor, num_routed: int, num_experts: int, salt: int) -> Tensor:
    """Benchmark routing with random weights (`ModelConfig.moe_routing_simulation`): ids[:, :num_routed] of a
    routing (weights [T, >= 1] fp32, ids [T, >= num_routed] int64, as `moe_route` returns them) overwritten in
    place by num_routed consecutive experts (mod num_experts) from a hash of (weights[t, 0], t, salt), so each
    expert is picked by a row with probability num_routed / num_experts independently across rows (uniform
    routing's expert counts). Returns ids. Graph-safe (no host sync)."""
    if _dispatch.use_triton(weights, ids) and ids.stride(1) == 1 and num_routed <= 64:
        return _dispatch.kernels("moe_route").simulate_uniform_routing(weights, ids, num_routed, num_experts, salt)
    return _ref_moe.simulate_uniform_routing(weights, ids, num_routed, num_experts, salt)


def moe_variant_token_counts(k: int, num_experts: int, dim: int, inter: int, max_tokens: int,
                             dtype: torch.dtype) -> list[int]:
    """Token counts, up to max_tokens, at which the Triton routed-experts kernels (`moe_experts` with k routing
    columns over num_experts stacked experts of [inter, dim] gate/up) change launch variant: one call at each
    compiles them all, so a warm-up of these lengths leaves no experts kernel to compile mid-serve. Host-only."""
    from tokenspeed.ops.triton.moe_config import variant_token_counts

    return variant_token_counts(k, num_experts, dim, inter, max_tokens, dtype.itemsize)


def moe_experts(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                act: Activation, *, add: Tensor | None = None, residual: Tensor | None = None,
                norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
                prefetch_expert: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    triton_ok = _dispatch.use_triton(x, w1, w3, w2, topk_weights, topk_ids, add, residual, norm_weight) \
        and _dispatch.moe_experts_supported(x, w1, act)
    kernels = _dispatch.kernels("moe_experts") if triton_ok else None
    if residual is None and norm_weight is None:
        if kernels is not None:
            return kernels.moe_experts(x, w1, w3, w2, topk_weights, topk_ids, act, add=add,
                                       prefetch_expert=prefetch_expert)
        return _ref_moe.moe_experts(x, w1, w3, w2, topk_weights, topk_ids, act, add=add)
    # The junction: fused into the combine where `add_rms_norm` itself would run its one-row fused kernel (the
    # same bits), else the unfused pair; the reference composes the same two.
    _ref_moe.check_norm(residual, norm_weight, x, w2.shape[1])
    if kernels is None:
        return _ref_moe.moe_experts(x, w1, w3, w2, topk_weights, topk_ids, act, add=add, residual=residual,
                                    norm_weight=norm_weight, norm_eps=norm_eps)
    if x.shape[0] <= ADD_NORM_FUSED_MAX_ROWS and _dispatch.norm_supported(residual):
        return kernels.moe_experts(x, w1, w3, w2, topk_weights, topk_ids, act, add=add, residual=residual,
                                   norm_weight=norm_weight, norm_eps=norm_eps, prefetch_expert=prefetch_expert)
    out = kernels.moe_experts(x, w1, w3, w2, topk_weights, topk_ids, act, add=add, prefetch_expert=prefetch_expert)
    return add_rms_norm(out, residual, norm_weight, norm_eps)


def moe_gate_kernel_usable(attn_out: Tensor, residual: Tensor, norm_weight: Tensor, router_weight: Tensor,
                           correction_bias: Tensor | None, top_k: int, scoring: str = "sigmoid") -> bool:
    """Whether `moe_gate` with these arguments runs its one-launch Triton kernel (the dispatch rule, and the kernel's
    region `tokenspeed.ops.triton.moe_gate.supported`: T <= 16 rows, sigmoid scoring, ...). Host-only (no sync): a
    layer asks before choosing between `moe_gate` and its unfused ops (which it runs otherwise)."""
    return _dispatch.use_triton(attn_out, residual, norm_weight, router_weight, correction_bias) and \
        _dispatch.kernels("moe_gate").supported(attn_out, residual, norm_weight, router_weight, top_k, scoring)


def moe_gate(attn_out: Tensor, residual: Tensor, norm_weight: Tensor, norm_eps: float, router_weight: Tensor,
             correction_bias: Tensor | None, top_k: int, *, scoring: str = "sigmoid", renormalize: bool = True,
             routed_scaling_factor: float = 1.0, shared_expert_id: int | None = None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A MoE layer's junction after attention and its routing: (x, summed, weights, ids) with x, summed =
    add_rms_norm(attn_out, residual, norm_weight, norm_eps), the fp32 router logits of x, and `moe_route` of them.
    Contract: `tokenspeed.ops.reference.moe_gate.moe_gate`. One Triton launch where `moe_gate_kernel_usable`
    (decode-sized T; the routing equals `moe_route` on the kernel's logits, which equal the GEMV's up to the fp32
    summation order); otherwise the reference composition."""
    if moe_gate_kernel_usable(attn_out, residual, norm_weight, router_weight, correction_bias, top_k, scoring):
        return _dispatch.kernels("moe_gate").moe_gate(
            attn_out, residual, norm_weight, norm_eps, router_weight, correction_bias, top_k, scoring=scoring,
            renormalize=renormalize, routed_scaling_factor=routed_scaling_factor, shared_expert_id=shared_expert_id)
    from tokenspeed.ops.reference import moe_gate as _ref_gate

    return _ref_gate.moe_gate(attn_out, residual, norm_weight, norm_eps, router_weight, correction_bias, top_k,
                              scoring=scoring, renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
                              shared_expert_id=shared_expert_id)


def mla_attention_expanded(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: list[int], cu_seqlens_k: list[int],
                           scale: float) -> Tensor:
    if _dispatch.use_triton(q, k, v) and q.is_cuda:
        return _dispatch.cuda_module("sdpa").attention_expanded(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return _ref_mla.mla_attention_expanded(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)


def mla_expanded_warm_plans(heads: int, d_qk: int, d_v: int, max_q: int, max_kv: int, dtype: torch.dtype,
                            device: torch.device) -> int:
    """Build, where `mla_attention_expanded` runs on cuDNN with plans per length bucket, the plans of every chunk of
    up to max_q new tokens on up to max_kv keys (`tokenspeed.ops.cuda.sdpa.warm_plans`); returns the calls made
    (0 elsewhere: the reference and the CPU have no plans)."""
    probe = torch.empty(0, dtype=dtype, device=device)
    if device.type != "cuda" or not _dispatch.use_triton(probe):
        return 0
    return _dispatch.cuda_module("sdpa").warm_plans(heads, d_qk, d_v, max_q, max_kv, dtype, device)


def mla_decode(q: Tensor, cache: Tensor, page_table: Tensor, kv_lens: Tensor, scale: float, v_dim: int,
               kv_scale: float = 1.0, *, q_rope: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
               max_q: int | None = None, w_uv: Tensor | None = None) -> Tensor:
    """`tokenspeed.ops.reference.mla.mla_decode`; with w_uv [H, v_head, v_dim] (kv_b_proj's W_UV view) the output
    is multiplied per head by W_UV[h]^T ([..., H, v_head] in q's dtype): the composition of the latent output
    (rounded to q's dtype) and a bmm, fused into the Triton combine kernel where the kernel runs."""
    if _dispatch.use_triton(q, cache, page_table, kv_lens, q_rope, cu_seqlens_q, w_uv) and \
            _dispatch.mla_decode_supported(q, cache, v_dim, q_rope=q_rope, cu_seqlens_q=cu_seqlens_q) and \
            (w_uv is None or (w_uv.dim() == 3 and w_uv.shape[0] == q.shape[-2] and w_uv.shape[2] == v_dim
                              and w_uv.stride(-1) == 1 and w_uv.device == q.device)):
        return _dispatch.kernels("mla_decode").mla_decode(q, cache, page_table, kv_lens, scale, v_dim, kv_scale,
                                                          q_rope=q_rope, cu_seqlens_q=cu_seqlens_q, max_q=max_q,
                                                          w_uv=w_uv)
    o = _ref_mla.mla_decode(q, cache, page_table, kv_lens, scale, v_dim, kv_scale, q_rope=q_rope,
                            cu_seqlens_q=cu_seqlens_q, max_q=max_q)
    return o if w_uv is None else torch.einsum("...hr,hvr->...hv", o, w_uv.to(o.dtype))


def mla_decode_kernel_usable(cache: Tensor, v_dim: int, *tensors: Tensor) -> bool:
    """Whether `mla_decode` over `cache` (value width v_dim; `tensors`: its other tensor arguments) runs the Triton
    kernel rather than the torch reference, for queries of the matching width and form. Host-only (no sync): a
    layer asks before it builds its queries, to give the kernel batches the reference serves badly."""
    return _dispatch.use_triton(cache, *tensors) and _dispatch.mla_cache_supported(cache, v_dim)


def mla_norm_store_latent(kv_c: Tensor, k_pe: Tensor, weight: Tensor, eps: float, cache: Tensor,
                          slot_mapping: Tensor, kv_scale: float = 1.0) -> None:
    if _dispatch.use_triton(kv_c, k_pe, weight, cache, slot_mapping) and _dispatch.mla_norm_store_supported(
            kv_c, k_pe, weight, cache, slot_mapping):
        return _dispatch.kernels("mla_prep").mla_norm_store_latent(kv_c, k_pe, weight, eps, cache, slot_mapping,
                                                                   kv_scale)
    return _ref_mla.mla_norm_store_latent(kv_c, k_pe, weight, eps, cache, slot_mapping, kv_scale)


def mla_norm_store_absorb(kv_c: Tensor, k_pe: Tensor, weight: Tensor, eps: float, cache: Tensor,
                          slot_mapping: Tensor, kv_scale: float, q_nope: Tensor, w_uk: Tensor) -> Tensor:
    """`mla_norm_store_latent(kv_c, k_pe, weight, eps, cache, slot_mapping, kv_scale)` and the W_UK absorption
    q_lat [T, H, r] = q_nope [T, H, nope] @ W_UK[h] [H, nope, r] (w_uk cast to q_nope's dtype, the result in it):
    one Triton launch (`tokenspeed.ops.triton.mla_prep.mla_norm_store_absorb`) where the store's kernel runs and
    the operands fit it, else the two ops. Mutates cache rows slot_mapping only; returns q_lat."""
    if _dispatch.use_triton(kv_c, k_pe, weight, cache, slot_mapping, q_nope, w_uk) and \
            _dispatch.mla_norm_store_supported(kv_c, k_pe, weight, cache, slot_mapping) and q_nope.dim() == 3 and \
            q_nope.shape[0] == kv_c.shape[0] and q_nope.stride(-1) == 1 and \
            q_nope.dtype in (torch.float32, torch.bfloat16, torch.float16) and \
            w_uk.shape == (q_nope.shape[1], q_nope.shape[2], kv_c.shape[1]) and w_uk.stride(-1) == 1:
        return _dispatch.kernels("mla_prep").mla_norm_store_absorb(kv_c, k_pe, weight, eps, cache, slot_mapping,
                                                                   kv_scale, q_nope, w_uk)
    mla_norm_store_latent(kv_c, k_pe, weight, eps, cache, slot_mapping, kv_scale)
    return torch.einsum("thn,hnr->thr", q_nope, w_uk.to(q_nope.dtype))


for _fn, _ref in ((moe_experts, _ref_moe.moe_experts),
                  (mla_norm_store_latent, _ref_mla.mla_norm_store_latent),
                  (mla_attention_expanded, _ref_mla.mla_attention_expanded), (rms_norm, _ref_norm.rms_norm),
                  (gated_rms_norm, _ref_norm.gated_rms_norm), (add_rms_norm, _ref_norm.add_rms_norm),
                  (gated_activation, _ref_act.gated_activation),
                  (gated_activation_merged, _ref_act.gated_activation_merged),
                  (attn_res_mix, _ref_attn_res.attn_res_mix),
                  (attn_res_mix_rms_norm, _ref_attn_res.attn_res_mix_rms_norm), (moe_route, _ref_moe.moe_route)):
    _fn.__doc__ = _ref.__doc__


KDA_FUSED_GATES_ENV = "TOKENSPEED_KDA_FUSED_GATES"
# (sequence, head) pairs up to which a KDA decode step runs its low-rank gate up projections inside the fused kernel
# (the split schedule's region of kda_config.DECODE_TABLE at head dim 128): every program holds its head's rows of
# the up weights in registers from before its PDL wait and computes f (and its gate lanes) itself, which replaces a
# dependent GEMV launch. H200, kimi-linear-48b-a3b decode step, 4K, interleaved A/B (benchmarks/README.md, cf8ea04 and
# ef4b654): batch 1 (32 pairs, split) x1.006 / x1.010 / x1.008; batch 2 and 4 (64 / 128 pairs, the chunked schedule,
# whose one program a head computes all of f and the gate) x0.973-0.984: there the kernel's extra critical path is
# longer than the launch it saves.
KDA_FUSED_GATES_MAX_PAIRS = 32


def kda_fuses_gate_projections(x: Tensor, num_pairs: int) -> bool:
    """Whether a KDA decode step (one token per sequence) of `num_pairs` (sequence, head) pairs passes its low-rank
    gate inputs to `kda_decode` (`f_low_rank` / `gate_low_rank`) rather than running their up projections as a
    launch before it: on the Triton path up to KDA_FUSED_GATES_MAX_PAIRS pairs. TOKENSPEED_KDA_FUSED_GATES (read per
    call) "0": never, "1": always (on any device; the reference composes the same projections), else the default.
    A host decision from shapes (safe inside graph capture)."""
    env = os.environ.get(KDA_FUSED_GATES_ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    return _dispatch.use_triton(x) and num_pairs <= KDA_FUSED_GATES_MAX_PAIRS


def kda_decode(
    qkv: Tensor,
    f: Tensor | None,
    b: Tensor,
    conv_weight: Tensor,
    conv_state: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    *,
    lower_bound: float | None,
    scale: float,
    update_state: bool = True,
    step_states: Tensor | None = None,
    seq_lens: Tensor | None = None,
    norm_gate: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    state_v_first: bool = False,
    max_seq_tokens: int | None = None,
    f_low_rank: tuple[Tensor, Tensor] | None = None,
    gate_low_rank: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """KDA decode / k-token verify from the raw projections, fused on CUDA (one launch per layer).

    Equals `causal_conv1d(qkv, conv_weight, conv_state, state_indices, cu_seqlens, "silu")` split into q, k, v
    ([T, 3, H, D]), then `kda_recurrent(l2_normalize(q), l2_normalize(k), v, kda_gate(f, A_log, dt_bias,
    lower_bound), sigmoid(b), scale=scale)` from and into `state[state_indices]`.

    qkv: [T, 3*H*D] pre-conv projections (a strided slice of the merged projection is read in place);
    f: [T, H, D] or [T, H*D] gate logits; b: [T, H] beta logits; conv_weight [3*H*D, 4] fp32;
    conv_state [S, 3*H*D, 3]; A_log [H], dt_bias [H, D] fp32; state [S, H, D, D] fp32 pool;
    state_indices [N] (a slot < 0 marks a padding row: zero outputs, no state touched); cu_seqlens [N+1].
    update_state=True advances conv_state and state in place (decode); False leaves both pools untouched
    (verify) and, with `step_states` [T, H, D, D] fp32, writes the state after every token there.
    seq_lens [N] (device), if given: only the first min(seq_lens[n], q_len_n) tokens of sequence n are used (the
    KDA replay of accepted drafts reads the verify batch in place); the other rows of o are zeros.
    Returns o [T, H, D] in qkv.dtype.
    norm_gate ([T, H, D] or [T, H*D], unit last stride; may be a column view of a wider projection) with
    norm_weight [D]: o is returned as `gated_rms_norm(o, norm_gate, norm_weight, norm_eps)` (the KDA output norm),
    fused into the kernel's epilogue on CUDA, composed otherwise.
    state_v_first: `state` (and `step_states`) hold each head's state transposed, [V, K]: the layout of the model's
    pools (`models.batch.KDA_STATE_V_FIRST`), where the fused kernel's [K, block_v] tiles are contiguous rows.
    max_seq_tokens: a bound on every sequence's token count that the caller guarantees (the model passes its
    uniform verify length); the fused verify then compiles without its long-sequence path, so a sequence longer
    than the bound would get only its first tokens' outputs. None: no bound assumed.
    f_low_rank (a [T, R], unit column stride; w [H*D, R] contiguous, a's dtype), instead of f: f = cast(a @ w^T),
    the low-rank decay gate's up projection, computed inside the fused kernel on CUDA for decode launches of one
    token per sequence (T == N, bounded by max_seq_tokens=1) (one GEMV launch fewer a layer; `kda_fuses_gate_projections` says when the model asks for
    it), composed otherwise. gate_low_rank, the same for the output norm's gate instead of norm_gate (norm_weight
    still given).
    """
    if step_states is not None and update_state:
        raise ValueError("step_states is for verify (update_state=False)")
    if (f is None) == (f_low_rank is None):
        raise ValueError("kda_decode takes f or f_low_rank, exactly one")
    if gate_low_rank is not None and (norm_gate is not None or norm_weight is None):
        raise ValueError("gate_low_rank replaces norm_gate and needs norm_weight")
    if gate_low_rank is None and (norm_gate is None) != (norm_weight is None):
        raise ValueError("norm_gate and norm_weight go together")
    if _dispatch.use_triton(qkv, f, b, conv_state, state, state_indices, norm_gate) \
            and _dispatch.kda_decode_supported(qkv, conv_weight, dt_bias):
        return _dispatch.kernels("kda_decode").kda_decode(
            qkv, f, b, conv_weight, conv_state, A_log, dt_bias, state, state_indices, cu_seqlens,
            lower_bound=lower_bound, scale=scale, update_state=update_state, step_states=step_states,
            seq_lens=seq_lens, norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps,
            state_v_first=state_v_first, max_seq_tokens=max_seq_tokens, f_low_rank=f_low_rank,
            gate_low_rank=gate_low_rank,
        )
    if f_low_rank is not None:  # the reference: the up projections as the unfused model computes them
        f = linear(*f_low_rank)
    if gate_low_rank is not None:
        norm_gate = linear(*gate_low_rank)
    if state_v_first:  # the reference works on [K, V] views of the same memory (written through them)
        state = state.transpose(-1, -2)
        step_states = step_states.transpose(-1, -2) if step_states is not None else None
    o = _kda_decode_reference(qkv, f, b, conv_weight, conv_state, A_log, dt_bias, state, state_indices,
                              cu_seqlens, lower_bound=lower_bound, scale=scale, update_state=update_state,
                              step_states=step_states, seq_lens=seq_lens)
    if norm_gate is None:
        return o
    return gated_rms_norm(o, norm_gate.view(o.shape), norm_weight, norm_eps)


def kda_replay_layers(
    table: KdaLayerTable,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor | None,
    *,
    lower_bound: float | None,
    state_v_first: bool = False,
    max_seq_tokens: int | None = None,
) -> None:
    """`kda_decode(*layer, state_indices, cu_seqlens, lower_bound=lower_bound, update_state=True,
    seq_lens=seq_lens, state_v_first=state_v_first)` for every layer of `table`, outputs discarded: the KDA state
    replay of accepted drafts over all KDA layers of a model at once (`ops.kda_layers.KdaLayerTable`, built once per
    set of tensors).

    Shared by all layers: state_indices [N] (a slot < 0 is a padding row: nothing touched), cu_seqlens [N+1],
    seq_lens [N] int64 (tokens of each sequence to apply, clamped to 0..q_len_n; None: all). Mutates, per layer,
    conv_state and state at the batch's slots only; reads qkv / f / b / the weights in place.
    On CUDA (dispatch rule of `kda_decode`), uniform layers (`table.offsets` is not None) in the kernel's region
    (`dispatch.kda_replay_layers_unsupported`) take one Triton launch over all layers that skips the q path and
    the outputs, reading only device values (CUDA-graph safe with a prebuilt table); anything else launches
    `kda_decode` per layer (Triton or the reference, by the same rule). `max_seq_tokens`: a bound on every
    sequence's rows (cu_seqlens) the caller guarantees, as in `kda_decode`; with it the Triton path may take the
    two-launch WY replay (`kda_config.MULTI_TABLE`).
    """
    base = table.base
    if _dispatch.use_triton(base.qkv, base.f, base.b, base.conv_state, base.state, state_indices) \
            and _dispatch.kda_replay_layers_unsupported(table) is None:
        _dispatch.kernels("kda_decode").kda_replay_layers(table, state_indices, cu_seqlens, seq_lens,
                                                          lower_bound=lower_bound, state_v_first=state_v_first,
                                                          max_seq_tokens=max_seq_tokens)
        return
    for layer in table.layers:
        kda_decode(*layer, state_indices, cu_seqlens, lower_bound=lower_bound, scale=1.0, update_state=True,
                   seq_lens=seq_lens, state_v_first=state_v_first)


def _kda_decode_reference(qkv, f, b, conv_weight, conv_state, A_log, dt_bias, state, state_indices, cu_seqlens, *,
                          lower_bound, scale, update_state, step_states, seq_lens=None) -> Tensor:
    """The composition of the reference ops that `kda_decode` fuses (host-synchronising; the CPU path)."""
    T = qkv.shape[0]
    H, D = dt_bias.shape
    slots = state_indices.tolist()
    bounds = cu_seqlens.tolist()
    ends = bounds[1:] if seq_lens is None else [
        bounds[n] + max(0, min(int(m), bounds[n + 1] - bounds[n])) for n, m in enumerate(seq_lens.tolist())]
    o = torch.zeros(T, H, D, dtype=qkv.dtype, device=qkv.device)
    keep = [n for n, s in enumerate(slots) if s >= 0]  # padding rows (slot < 0) give zeros
    if not keep:
        return o
    tok = torch.cat([torch.arange(bounds[n], ends[n]) for n in keep]).to(device=qkv.device, dtype=torch.int64)
    lens = [ends[n] - bounds[n] for n in keep]
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(cu_seqlens.device)
    idx = torch.tensor([slots[n] for n in keep], dtype=torch.int64, device=state_indices.device)
    t = tok.numel()
    cs = conv_state if update_state else conv_state.clone()
    mixed = causal_conv1d(qkv[tok], conv_weight, cs, idx, cu, activation="silu")
    q, k, v = mixed.view(t, 3, H, D).unbind(1)
    g = kda_gate(f.reshape(T, H, D)[tok], A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b[tok].float())
    q, k = l2_normalize(q), l2_normalize(k)
    if step_states is None:
        out, final = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=state[idx], cu_seqlens=cu)
        if update_state:
            state[idx] = final
        o[tok] = out
        return o
    # Verify with per-token states: advance every sequence one token at a time (lockstep).
    cur = state[idx].clone()
    starts = cu[:-1]
    ln = torch.tensor(lens, device=cu.device)
    one = torch.arange(0, len(keep) + 1, dtype=torch.int64, device=cu.device)
    for j in range(max(lens)):
        seqs = torch.nonzero(ln > j).squeeze(1)
        tt = starts[seqs] + j
        out, new = kda_recurrent(q[tt], k[tt], v[tt], g[tt], beta[tt], scale=scale, initial_state=cur[seqs],
                                 cu_seqlens=one[: seqs.numel() + 1])
        cur[seqs] = new
        o[tok[tt]] = out
        step_states[tok[tt]] = new
    if update_state:
        state[idx] = cur
    return o


# Sequences with more new tokens than this take the chunked KDA form; shorter ones the recurrent form.
KDA_CHUNK_MIN_TOKENS = 16


def kda_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    state: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    form: str = "auto",
) -> Tensor:
    """Run the gated delta rule over a varlen batch, continuing each sequence from its state slot.

    q, k: [T, H, K] L2-normalised; v: [T, H, V]; g: [T, H, K] fp32 log decay; beta: [T, H] fp32;
    state: [S, H, K, V] fp32 pool, rows `state_indices` [N] are read and then overwritten with the final
    states (mutated in place); cu_seqlens: [N+1]. form: "auto" | "chunk" | "recurrent". On CUDA the chunked form
    runs fla-core's `chunk_kda` when it is installed.
    Returns o [T, H, V] in v.dtype.
    """
    if form == "auto":
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        form = "chunk" if lens.numel() and int(lens.max()) > KDA_CHUNK_MIN_TOKENS else "recurrent"
    if form == "chunk" and _dispatch.use_triton(q, k, v, state) and q.is_cuda and _dispatch.fla_available():
        return _dispatch.cuda_module("kda_chunk").kda_chunk_scan(q, k, v, g, beta, scale=scale, state=state,
                                                                 state_indices=state_indices, cu_seqlens=cu_seqlens)
    fn = {"chunk": kda_chunk, "recurrent": kda_recurrent}[form]
    o, final = fn(q, k, v, g, beta, scale=scale, initial_state=state[state_indices], cu_seqlens=cu_seqlens)
    state[state_indices] = final
    return o


def kda_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
    *,
    scale: float,
    state: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_host: list[int],
    state_v_first: bool = False,
) -> Tensor:
    """KDA over a varlen batch from the conv outputs and the raw gate / beta logits, continuing each sequence
    from its state slot: `kda_scan(l2_normalize(q), l2_normalize(k), v, kda_gate(f, A_log, dt_bias, lower_bound),
    sigmoid(b))`, the form chosen from the host copy of the lengths (no device sync).

    q, k: [T, H, K] (not normalised); v: [T, H, V]; f: [T, H, K] gate logits; b: [T, H] beta logits (any float
    dtype); A_log [H], dt_bias [H, K] fp32; state [S, H, K, V] fp32 pool, rows `state_indices` [N] are read and
    overwritten with the final states; cu_seqlens [N+1] on the device, cu_seqlens_host its host copy. On CUDA with
    fla-core, bf16/fp16 chunked forms run fla's `chunk_kda` with the L2 norm, gate and beta sigmoid inside its
    kernels (`dispatch.kda_fused_chunk_supported`); fp32 (validation) keeps the composed path.
    state_v_first: the pool holds each head's state as [V, K] (as `kda_decode`); the scan reads and writes it
    through a [K, V] view (its slots are gathered and scattered once per call).
    Returns o [T, H, V] in v.dtype.
    """
    if state_v_first:
        state = state.transpose(-1, -2)
    lens = [e - s for s, e in itertools.pairwise(cu_seqlens_host)]
    form = "chunk" if lens and max(lens) > KDA_CHUNK_MIN_TOKENS else "recurrent"
    if (form == "chunk" and _dispatch.use_triton(q, k, v, state) and q.is_cuda and _dispatch.fla_available()
            and _dispatch.kda_fused_chunk_supported(v, lower_bound)):
        return _dispatch.cuda_module("kda_chunk").kda_chunk_fused(
            q, k, v, f, b, A_log, dt_bias, lower_bound, scale=scale, state=state, state_indices=state_indices,
            cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host)
    return kda_scan(l2_normalize(q), l2_normalize(k), v, kda_gate(f, A_log, dt_bias, lower_bound),
                    torch.sigmoid(b.float()), scale=scale, state=state, state_indices=state_indices,
                    cu_seqlens=cu_seqlens, form=form)


__all__ = [
    "Activation",
    "KdaLayerTable",
    "KdaLayerTensors",
    "add_rms_norm",
    "apply_rope",
    "attn_res_mix",
    "attn_res_mix_rms_norm",
    "causal_conv1d",
    "gated_activation",
    "gated_activation_merged",
    "gated_rms_norm",
    "kda_chunk",
    "kda_decode",
    "kda_gate",
    "kda_prefill",
    "kda_recurrent",
    "kda_replay_layers",
    "kda_scan",
    "l2_normalize",
    "linear",
    "mla_attention_expanded",
    "mla_attention_paged",
    "mla_decode",
    "mla_decode_kernel_usable",
    "mla_expanded_warm_plans",
    "mla_gather_latent",
    "mla_norm_store_absorb",
    "mla_norm_store_latent",
    "mla_store_latent",
    "moe_experts",
    "moe_route",
    "moe_simulate_routing",
    "rms_norm",
    "rope_cos_sin",
    "yarn_mscale",
]
