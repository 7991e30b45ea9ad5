"""Causal attention over a varlen batch through PyTorch's fused scaled_dot_product_attention (CUDA).

Same contract as `tokenspeed.ops.mla_attention_expanded` (bottom-right aligned causal mask, q_len <= k_len);
runs in q.dtype with the fused kernels' fp32 softmax. One SDPA call per sequence (prefill chunks are few and long).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def attention_expanded(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: list[int], cu_seqlens_k: list[int],
                       scale: float) -> Tensor:
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for n in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = cu_seqlens_q[n], cu_seqlens_q[n + 1], cu_seqlens_k[n], cu_seqlens_k[n + 1]
        if qe == qs:
            continue
        # [1, H, L, D]: the fused (flash / memory-efficient) kernels take 4-D inputs only
        qn, kn, vn = (t.transpose(0, 1).unsqueeze(0).to(q.dtype) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        ql, kl = qe - qs, ke - ks
        if ql == kl:
            o = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True, scale=scale)
        else:
            pos = torch.arange(ql, device=q.device)[:, None] + (kl - ql)
            mask = torch.arange(kl, device=q.device)[None, :] <= pos
            o = F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, scale=scale)
        out[qs:qe] = o.squeeze(0).transpose(0, 1)
    return out
