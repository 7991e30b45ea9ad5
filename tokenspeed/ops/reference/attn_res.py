"""Block Attention Residuals: a softmax over depth of block snapshots and the current partial sum.

Each mixer owns a pseudo-query `query = gamma * w` (the RMSNorm gain folded into the projection, fp32).
For candidates v_0..v_n (snapshots, then the partial sum):
    z_i = sum_d query[d] * v_i[d] / sqrt(mean_d(v_i^2) + eps);  alpha = softmax(z);  mix = sum_i alpha_i v_i
computed in fp32 and cast to the activation dtype; the values are the raw (un-normed) candidates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenspeed.ops.reference.norm import rms_norm


def attn_res_mix(blocks: Tensor, partial: Tensor, query: Tensor, eps: float) -> Tensor:
    """Depth mix of `blocks` [n, T, D] (n >= 0 snapshots) and `partial` [T, D].

    query: [D] fp32. Returns [T, D] in partial.dtype; with n == 0 it returns `partial` itself.
    """
    if blocks.shape[0] == 0:
        return partial
    cands = torch.cat([blocks, partial.unsqueeze(0)], dim=0).float()  # [n+1, T, D]
    inv_rms = torch.rsqrt(cands.pow(2).mean(-1) + eps)  # [n+1, T]
    logits = (cands @ query.float()) * inv_rms  # [n+1, T]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * cands).sum(0).to(partial.dtype)


def attn_res_mix_rms_norm(
    blocks: Tensor, partial: Tensor, query: Tensor, eps: float, norm_weight: Tensor, norm_eps: float
) -> Tensor:
    """rms_norm(attn_res_mix(...)): the mix followed by the sublayer's input norm (the mix feeds only it)."""
    return rms_norm(attn_res_mix(blocks, partial, query, eps), norm_weight, norm_eps)
