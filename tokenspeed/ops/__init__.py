"""Every op the models call, behind one public function each.

Models import `tokenspeed.ops` only, never a concrete kernel. Today each function runs its plain torch reference
(`tokenspeed.ops.reference.*`, the ground truth and the CPU path); GPU kernels register behind the same names.
"""

from __future__ import annotations

from torch import Tensor

from tokenspeed.ops.reference.activation import Activation, gated_activation
from tokenspeed.ops.reference.attn_res import attn_res_mix, attn_res_mix_rms_norm
from tokenspeed.ops.reference.conv import causal_conv1d
from tokenspeed.ops.reference.kda import kda_chunk, kda_gate, kda_recurrent, l2_normalize
from tokenspeed.ops.reference.mla import (
    mla_attention_expanded,
    mla_attention_paged,
    mla_gather_latent,
    mla_store_latent,
)
from tokenspeed.ops.reference.moe import moe_experts, moe_route
from tokenspeed.ops.reference.norm import gated_rms_norm, rms_norm
from tokenspeed.ops.reference.rope import apply_rope, rope_cos_sin, yarn_mscale

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
    states (mutated in place); cu_seqlens: [N+1]. form: "auto" | "chunk" | "recurrent".
    Returns o [T, H, V] in v.dtype.
    """
    if form == "auto":
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        form = "chunk" if lens.numel() and int(lens.max()) > KDA_CHUNK_MIN_TOKENS else "recurrent"
    fn = {"chunk": kda_chunk, "recurrent": kda_recurrent}[form]
    o, final = fn(q, k, v, g, beta, scale=scale, initial_state=state[state_indices], cu_seqlens=cu_seqlens)
    state[state_indices] = final
    return o


__all__ = [
    "Activation",
    "apply_rope",
    "attn_res_mix",
    "attn_res_mix_rms_norm",
    "causal_conv1d",
    "gated_activation",
    "gated_rms_norm",
    "kda_chunk",
    "kda_gate",
    "kda_recurrent",
    "kda_scan",
    "l2_normalize",
    "mla_attention_expanded",
    "mla_attention_paged",
    "mla_gather_latent",
    "mla_store_latent",
    "moe_experts",
    "moe_route",
    "rms_norm",
    "rope_cos_sin",
    "yarn_mscale",
]
