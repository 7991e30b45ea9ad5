"""Batched training forms of the reference ops the Kimi model calls (same functions, computed differently).

A training batch is N sequences of the same length L, each starting from an empty cache. The reference ops
walk sequences (and KDA chunks, and experts) in Python loops with host syncs; these forms run all sequences at
once. `training_ops()` swaps them into `tokenspeed.ops` while the model's own forward (`KimiForCausalLM`) runs;
`check_training_ops()` verifies logits and gradients against the reference ops. The held-out numbers the model
ships with are measured with the reference ops.

- causal_conv1d: one grouped conv1d over [N, C, L] (zero initial state; the conv state is not written).
- kda_scan: the chunked (WY) form with chunks of 32, every chunk's intra-chunk terms at once, then the
  inter-chunk state recurrence over L / 32 steps for all sequences and heads together (zero initial state).
- moe_experts: every expert on every token, combined with a [T, E] weight matrix that is zero off the top-k.
- mla_attention_expanded / mla_gather_latent: one causal SDPA over [N, H, L, D] / one gather.
- moe_route: the reference, plus a per-layer count of the tokens each expert received (for the bias update).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenspeed import ops
from tokenspeed.ops.reference.activation import gated_activation

KDA_TRAIN_CHUNK = 32
_REF = {name: getattr(ops, name) for name in
        ("causal_conv1d", "kda_scan", "moe_experts", "mla_attention_expanded", "mla_gather_latent", "moe_route")}


def _equal_lengths(cu_seqlens: Tensor | list[int], n: int, total: int) -> int:
    """The common sequence length (callers guarantee equal lengths; this only checks the total)."""
    if n == 0 or total % n:
        raise ValueError(f"training ops need {n} sequences of equal length, got {total} tokens")
    return total // n


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor, cu_seqlens: Tensor,
                  activation: str | None = "silu") -> Tensor:
    n = state_indices.numel()
    t, c = x.shape
    length = _equal_lengths(cu_seqlens, n, t)
    w = weight.float()
    xb = x.float().view(n, length, c).transpose(1, 2)  # [N, C, L]
    y = F.conv1d(F.pad(xb, (w.shape[1] - 1, 0)), w.unsqueeze(1), groups=c)  # cross-correlation, zero history
    y = y.transpose(1, 2).reshape(t, c)
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype)


def kda_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float, state: Tensor,
             state_indices: Tensor, cu_seqlens: Tensor, form: str = "auto") -> Tensor:
    n = state_indices.numel()
    t, h, dk = q.shape
    dv = v.shape[-1]
    length = _equal_lengths(cu_seqlens, n, t)
    c = KDA_TRAIN_CHUNK
    padded = -(-length // c) * c

    def heads_major(x: Tensor) -> Tensor:  # [T, H, D] -> [N, H, chunks, C, D], zero-padded at the end
        x = x.float().view(n, length, h, -1).permute(0, 2, 1, 3)
        if padded != length:
            x = F.pad(x, (0, 0, 0, padded - length))
        return x.reshape(n, h, padded // c, c, x.shape[-1])

    qc, kc, vc, gc = heads_major(q) * scale, heads_major(k), heads_major(v), heads_major(g)
    bc = heads_major(beta.unsqueeze(-1)).squeeze(-1)  # [N, H, chunks, C]
    gamma = gc.cumsum(-2)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]
    decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()  # [N, H, n, C, C, K], entries in [0, 1]
    kk = torch.einsum("...id,...jd,...ijd->...ij", kc, kc, decay)
    lower = bc[..., :, None] * kk * causal.tril(-1)
    eye = torch.eye(c, dtype=torch.float32, device=q.device)
    rhs = bc[..., None] * torch.cat([vc, gamma.exp() * kc], dim=-1)
    uw = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    u, w = uw.split([dv, dk], dim=-1)
    qk = torch.einsum("...id,...jd,...ijd->...ij", qc, kc, decay)
    q_decayed = gamma.exp() * qc
    k_to_end = decay[..., -1, :, :] * kc  # [N, H, n, C, K]
    g_end = gamma[..., -1, :].exp()  # [N, H, n, K]
    s = torch.zeros(n, h, dk, dv, dtype=torch.float32, device=q.device)
    outs = []
    for i in range(padded // c):
        nu = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_decayed[:, :, i] @ s + qk[:, :, i] @ nu)
        s = g_end[:, :, i, :, None] * s + k_to_end[:, :, i].transpose(-1, -2) @ nu
    o = torch.stack(outs, dim=2).reshape(n, h, padded, dv)[:, :, :length]
    return o.permute(0, 2, 1, 3).reshape(t, h, dv).to(v.dtype)


def moe_experts(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, act
                ) -> Tensor:
    e = w1.shape[0]
    dense = torch.zeros(x.shape[0], e, dtype=torch.float32, device=x.device)
    dense = dense.scatter_add(1, topk_ids, topk_weights.float())  # [T, E], zero off the top-k
    a = gated_activation(torch.einsum("td,eid->eti", x, w1), torch.einsum("td,eid->eti", x, w3), act)
    y = torch.einsum("eti,edi->etd", a, w2).to(x.dtype).float()
    return torch.einsum("te,etd->td", dense, y).to(x.dtype)


def mla_attention_expanded(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: list[int], cu_seqlens_k: list[int],
                           scale: float) -> Tensor:
    n = len(cu_seqlens_q) - 1
    if list(cu_seqlens_q) != list(cu_seqlens_k):  # only prefill from an empty cache is batched here
        return _REF["mla_attention_expanded"](q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    length = _equal_lengths(cu_seqlens_q, n, q.shape[0])
    h = q.shape[1]

    def b(x: Tensor) -> Tensor:
        return x.float().reshape(n, length, h, -1).transpose(1, 2)

    o = F.scaled_dot_product_attention(b(q), b(k), b(v), is_causal=True, scale=scale)
    return o.transpose(1, 2).reshape(q.shape[0], h, v.shape[-1]).to(q.dtype)


def mla_gather_latent(cache: Tensor, page_table: Tensor, kv_lens: list[int], out_dtype: torch.dtype,
                      kv_scale: float = 1.0) -> Tensor:
    if len(set(kv_lens)) != 1:
        return _REF["mla_gather_latent"](cache, page_table, kv_lens, out_dtype, kv_scale)
    page_size = cache.shape[1]
    pos = torch.arange(kv_lens[0], device=cache.device)
    rows = page_table[:, pos // page_size].long() * page_size + pos % page_size  # [N, L]
    latent = cache.view(-1, cache.shape[-1])[rows.reshape(-1)]
    return (latent.float() * kv_scale).to(out_dtype)


class ExpertLoad:
    """Per moe_route call (one per MoE layer, in forward order): tokens each expert received."""

    def __init__(self) -> None:
        self.counts: list[Tensor] = []

    def moe_route(self, router_logits: Tensor, correction_bias, top_k: int, **kw):
        weights, ids = _REF["moe_route"](router_logits, correction_bias, top_k, **kw)
        self.counts.append(torch.bincount(ids.reshape(-1), minlength=router_logits.shape[-1]).float())
        return weights, ids


@contextlib.contextmanager
def training_ops(load: ExpertLoad | None = None) -> Iterator[None]:
    """Swap the batched forms into `tokenspeed.ops` (restored on exit)."""
    new = {"causal_conv1d": causal_conv1d, "kda_scan": kda_scan, "moe_experts": moe_experts,
           "mla_attention_expanded": mla_attention_expanded, "mla_gather_latent": mla_gather_latent}
    if load is not None:
        new["moe_route"] = load.moe_route
    try:
        for name, fn in new.items():
            setattr(ops, name, fn)
        yield
    finally:
        for name, fn in _REF.items():
            setattr(ops, name, fn)
