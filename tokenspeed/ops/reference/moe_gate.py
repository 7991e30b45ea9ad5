"""The MoE gate after attention (reference): residual add + RMSNorm, the fp32 router projection, the routing."""

from __future__ import annotations

import torch
from torch import Tensor

from tokenspeed.ops.reference.moe import moe_route
from tokenspeed.ops.reference.norm import add_rms_norm


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The junction after a MoE layer's attention and the routing of its FFN, composed of the reference ops:

        x, summed = add_rms_norm(attn_out, residual, norm_weight, norm_eps)
        logits    = x.float() @ router_weight.float()^T          (fp32 [T, E]: the model's CPU `Router`)
        weights, ids = moe_route(logits, correction_bias, top_k, scoring=, renormalize=, routed_scaling_factor=,
                                 shared_expert_id=)

    attn_out, residual: [T, K] of one dtype; norm_weight [K]; router_weight [E, K]; correction_bias [E] fp32 or
    None. Returns (x [T, K], summed [T, K] (the new residual stream), weights [T, n] fp32, ids [T, n] int64), n =
    top_k (+ 1 with shared_expert_id: the column (shared_expert_id, 1.0)). Nothing is mutated.
    """
    x, summed = add_rms_norm(attn_out, residual, norm_weight, norm_eps)
    logits = torch.nn.functional.linear(x.float(), router_weight.float())
    weights, ids = moe_route(logits, correction_bias, top_k, scoring=scoring, renormalize=renormalize,
                             routed_scaling_factor=routed_scaling_factor, shared_expert_id=shared_expert_id)
    return x, summed, weights, ids
