"""Mixture-of-experts routing and routed experts (reference: a clear loop over experts)."""

from __future__ import annotations

import torch
from torch import Tensor

from tokenspeed.ops.reference.activation import Activation, gated_activation
from tokenspeed.ops.reference.norm import add_rms_norm


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
    """Select `top_k` experts per token ("noaux_tc": the bias steers selection only).

    router_logits: [T, E] (upcast to fp32); correction_bias: [E] fp32 or None.
    scores = sigmoid(logits) (or softmax); selection = top-k of scores + bias, ties to the lower expert id;
    weights = the selected raw scores, renormalised to sum 1 if `renormalize`, times the scaling factor.
    Returns (weights [T, k] fp32, expert ids [T, k] int64), ids in descending order of selection score.
    shared_expert_id (an int >= E, or None): a shared expert folded in as an always-selected expert
    (`with_shared_expert`): [T, k + 1], the last column (shared_expert_id, 1.0), the routed k columns unchanged.
    """
    check_shared_expert_id(shared_expert_id, router_logits.shape[-1])
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    elif scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"unknown router scoring {scoring!r}; supported: 'sigmoid', 'softmax'")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    # A stable descending sort keeps the lower expert id first among equal scores.
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    if shared_expert_id is not None:
        return with_shared_expert(weights, ids, shared_expert_id)
    return weights, ids


def with_shared_expert(weights: Tensor, ids: Tensor, shared_expert_id: int) -> tuple[Tensor, Tensor]:
    """A shared expert folded into `moe_route`'s output as an always-selected expert (its weights stacked after
    the E routed ones, e.g. id E of [E + 1, ...] expert weights, so `moe_experts` runs it with the routed ones):
    returns new (weights [T, k + 1] fp32, ids [T, k + 1] int64), the routed k columns as given (renormalised and
    scaled among themselves only) and the last column (shared_expert_id, 1.0). The reference of the Triton
    `moe_route(..., shared_expert_id=)`; the inputs are not mutated."""
    T = weights.shape[0]
    return (torch.cat([weights, weights.new_ones(T, 1)], 1),
            torch.cat([ids, ids.new_full((T, 1), shared_expert_id)], 1))


_MASK32 = 0xFFFFFFFF


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values (products wrapped to 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def simulate_uniform_routing(weights: Tensor, ids: Tensor, num_routed: int, num_experts: int, salt: int) -> Tensor:
    """Benchmark routing (`ModelConfig.moe_routing_simulation`): overwrites ids[:, :num_routed] in place with
    num_routed consecutive experts (mod num_experts) starting at a 32-bit hash of (the bits of weights[t, 0], the
    row t, `salt`), and returns ids. Each expert is then chosen by a row with probability num_routed / E,
    independently across rows, as under uniform routing; the k ids of a row are distinct; columns past num_routed
    (a folded shared expert) and the weights are kept. weights: [T, >= 1] fp32; ids: [T, >= num_routed] int64."""
    T = ids.shape[0]
    bits = weights[:, 0].contiguous().view(torch.int32).long() & _MASK32
    rows = (torch.arange(T, device=ids.device) * 0x9E3779B9) & _MASK32
    h = _fmix32(bits ^ rows ^ ((salt * 0x27D4EB2F) & _MASK32))
    start = h % num_experts
    ids[:, :num_routed] = (start[:, None] + torch.arange(num_routed, device=ids.device)) % num_experts
    return ids


def check_shared_expert_id(shared_expert_id: int | None, num_experts: int) -> None:
    """A shared expert's id (`with_shared_expert`, the Triton `moe_route`) must be None or an int >= E, the routed
    experts' count (not a routed expert's id); ValueError otherwise."""
    if shared_expert_id is not None and (not isinstance(shared_expert_id, int) or shared_expert_id < num_experts):
        raise ValueError(f"shared_expert_id must be an int >= E = {num_experts} (id E: weights stacked as "
                         f"[E + 1, ...]) or None; got {shared_expert_id!r}")


def moe_experts(
    x: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    act: Activation,
    *,
    add: Tensor | None = None,
    residual: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    prefetch_expert: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Routed experts: out_t = sum_j w_tj * cast(W2_e act(W1_e x_t, W3_e x_t)), e = topk_ids[t, j].

    x: [T, D]; w1, w3: [E, I, D] (gate, up); w2: [E, D, I]; topk_weights: [T, k] fp32; topk_ids: [T, k].
    Each expert output is rounded to x.dtype, the weighted combine is fp32, the result is x.dtype [T, D].
    Expert ids outside [0, E) contribute nothing (used by expert parallelism for non-local experts).
    add: [T, D] in x.dtype (e.g. the shared experts' output), or None: returns cast(out) + add, i.e. the routed
    sum rounded to x.dtype first, then the add rounded again (torch's `+` of the two x.dtype tensors). Inputs are
    not mutated.
    residual ([T, D] in x.dtype) with norm_weight ([D]): the pre-norm residual junction after the FFN, fused on
    CUDA: returns (normed, summed) = `add_rms_norm(out, residual, norm_weight, norm_eps)` of the output above
    (rounded to x.dtype, `add` included), i.e. summed = residual + out, normed = rms_norm(summed); both or neither.
    prefetch_expert: an expert id the routing is known to use (e.g. a folded shared expert): a hint the CUDA path
    may use to fetch its weights early; no effect on the result.
    """
    check_add(add, x, w2.shape[1])
    check_norm(residual, norm_weight, x, w2.shape[1])
    if residual is not None:
        return add_rms_norm(moe_experts(x, w1, w3, w2, topk_weights, topk_ids, act, add=add), residual, norm_weight,
                            norm_eps)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < w1.shape[0]:
            continue
        token_idx, slot_idx = torch.nonzero(topk_ids == e, as_tuple=True)
        xe = x[token_idx]
        h = gated_activation(xe @ w1[e].t(), xe @ w3[e].t(), act) @ w2[e].t()
        weight = topk_weights[token_idx, slot_idx].unsqueeze(-1)
        out.index_add_(0, token_idx, weight * h.to(x.dtype).float())
    return out.to(x.dtype) if add is None else out.to(x.dtype) + add


def check_add(add: Tensor | None, x: Tensor, d: int) -> None:
    """`moe_experts`' add must be None or [T, d] in x.dtype on x's device (ValueError otherwise)."""
    if add is not None and (add.shape != (x.shape[0], d) or add.dtype != x.dtype or add.device != x.device):
        raise ValueError(f"add must be [{x.shape[0]}, {d}] {x.dtype} on {x.device}; got {tuple(add.shape)} "
                         f"{add.dtype} on {add.device}")


def check_norm(residual: Tensor | None, norm_weight: Tensor | None, x: Tensor, d: int) -> None:
    """`moe_experts`' fused junction: residual and norm_weight both None, or residual [T, d] in x.dtype and
    norm_weight [d] (floating), both on x's device (ValueError otherwise)."""
    if residual is None and norm_weight is None:
        return
    if residual is None or norm_weight is None:
        raise ValueError("residual and norm_weight go together")
    if residual.shape != (x.shape[0], d) or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual must be [{x.shape[0]}, {d}] {x.dtype} on {x.device}; got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if norm_weight.shape != (d,) or not norm_weight.is_floating_point() or norm_weight.device != x.device:
        raise ValueError(f"norm_weight must be a floating [{d}] tensor on {x.device}; got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype} on {norm_weight.device}")
