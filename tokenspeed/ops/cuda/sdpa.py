"""Causal attention over a varlen batch through PyTorch's fused scaled_dot_product_attention (CUDA).

Same contract as `tokenspeed.ops.mla_attention_expanded` (bottom-right aligned causal mask, q_len <= k_len);
runs in q.dtype with the fused kernels' fp32 softmax. One SDPA call per sequence (prefill chunks are few and long).

A chunk of L new tokens behind a cached history of P = k_len - L rows needs a bottom-right causal mask. Built as an
explicit [L, k_len] boolean mask it takes SDPA off its fast path: one layer of Kimi-Linear's MLA (32 heads,
192 / 128) for 1300 new tokens on a 64K history ran at 308 TFLOP/s. Where the work is large
(`split_worth`), the chunk runs as two unmasked calls through cuDNN, the history (no mask) and the chunk's own
square (is_causal), each returning its log-sum-exp, merged in fp32 (`merge_partials`): 513 TFLOP/s on the same
shape, 583 for an 8K chunk on a 40K history (`benchmarks/results/mla_expanded_h200_*.json`). Keys and values are
best passed head-major (a [S, H, D] view of a contiguous [H, S, D] tensor): SDPA's [1, H, S, D] view of them is
then contiguous and nothing is copied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

# Split a chunk with a history when L * P is at least this (query rows x history rows): below it the extra launch
# and the merge cost more than the mask (H200: 300 new tokens on 3.8K rows 0.64 ms split vs 0.43 ms masked;
# 256 on 64K 2.58 vs 4.12 ms; 1300 on 16K 1.30 vs 2.05 ms, each with its expansion).
SPLIT_MIN_WORK = 1 << 22

# (q, k, v [1, H, *, D]; causal) -> (o [1, H, L, Dv] in q.dtype, lse [1, H, L] fp32, natural log)
Attend = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]


_log = logging.getLogger(__name__)
# Set False (with a warning) the first time cuDNN refuses a split call: every later chunk takes the masked form.
_split_ok = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cudnn.is_available()


def split_worth(q_len: int, history: int) -> bool:
    """Whether a chunk of q_len new tokens on `history` cached rows runs split (`SPLIT_MIN_WORK`)."""
    return _split_ok and history > 0 and q_len * history >= SPLIT_MIN_WORK


def cudnn_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """cuDNN's fused attention with its log-sum-exp (the op behind SDPA's cuDNN backend; is_causal is top-left,
    so callers pass causal only for square calls)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[0], q.shape[1], q.shape[2])


def merge_partials(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Softmax-weighted merge of two attentions of the same queries over disjoint key sets: o [..., L, Dv] with
    lse [..., L] (natural log). Returns o1's dtype, merged in fp32."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    o = o1.float() * w1.unsqueeze(-1) + o2.float() * w2.unsqueeze(-1)
    return (o / (w1 + w2).unsqueeze(-1)).to(o1.dtype)


def attend_split(qn: Tensor, kn: Tensor, vn: Tensor, scale: float, attend: Attend | None = None) -> Tensor:
    """Bottom-right causal attention of qn [1, H, L, D] over kn / vn [1, H, S, D] (S > L) as the history part
    (keys 0..S-L-1, every query sees all of them) and the square part (is_causal), merged. Returns [1, H, L, Dv].
    `attend` defaults to `cudnn_attend`."""
    attend = attend or cudnn_attend
    L, S = qn.shape[2], kn.shape[2]
    o_hist, lse_hist = attend(qn, kn[:, :, : S - L], vn[:, :, : S - L], False, scale)
    o_tail, lse_tail = attend(qn, kn[:, :, S - L:], vn[:, :, S - L:], True, scale)
    return merge_partials(o_hist, lse_hist, o_tail, lse_tail)


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
            o = _attend_with_history(qn, kn, vn, scale)
        out[qs:qe] = o.squeeze(0).transpose(0, 1)
    return out


def _attend_with_history(qn: Tensor, kn: Tensor, vn: Tensor, scale: float) -> Tensor:
    """Bottom-right causal attention of qn [1, H, L, D] over kn / vn [1, H, S, D], S > L: split where it pays,
    else one SDPA call with an explicit mask."""
    global _split_ok
    ql, kl = qn.shape[2], kn.shape[2]
    if split_worth(ql, kl - ql):
        try:
            return attend_split(qn.contiguous(), kn, vn, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a cuDNN build or GPU without this fused attention: fall back, once, loudly
            _split_ok = False
            _log.warning("cuDNN attention with log-sum-exp refused (%s); chunks with a history now use one masked "
                         "SDPA call", e)
    pos = torch.arange(ql, device=qn.device)[:, None] + (kl - ql)
    mask = torch.arange(kl, device=qn.device)[None, :] <= pos
    return F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, scale=scale)
