"""Multi-head latent attention: the expanded form and the absorbed form over a paged latent cache.

The cache holds, per token, one latent row [c_kv (kv_lora_rank) ; k_pe (rope dim)] shared by all heads.
Pages are `page_size` rows; a sequence's row i lives at page_table[n, i // page_size] * page_size + i % page_size.
Attention is causal and bottom-right aligned: new query j of a sequence with q_len new tokens and kv_len total
tokens (cached + new) sits at position kv_len - q_len + j and sees keys 0..that position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenspeed.ops.reference.norm import rms_norm


def _causal_softmax_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q: [Q, H, Dk], k: [S, H|1, Dk], v: [S, H|1, Dv] -> [Q, H, Dv] fp32; query j at position S - Q + j."""
    scores = torch.einsum("qhd,shd->hqs", q.float(), k.float().expand(-1, q.shape[1], -1)) * scale
    q_pos = torch.arange(q.shape[0], device=q.device) + (k.shape[0] - q.shape[0])
    mask = torch.arange(k.shape[0], device=q.device)[None, :] > q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, v.float().expand(-1, q.shape[1], -1))


def mla_attention_expanded(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: list[int], cu_seqlens_k: list[int], scale: float
) -> Tensor:
    """Causal attention with per-head keys and values, over a flat batch of sequences.

    q: [T, H, Dqk]; k: [S, H, Dqk]; v: [S, H, Dv]; cu_seqlens_*: N+1 offsets (host ints), every sequence has
    k_len >= q_len. Returns [T, H, Dv] in q.dtype. Softmax in fp32.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for n in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = cu_seqlens_q[n], cu_seqlens_q[n + 1], cu_seqlens_k[n], cu_seqlens_k[n + 1]
        if qe > qs:
            out[qs:qe] = _causal_softmax_attention(q[qs:qe], k[ks:ke], v[ks:ke], scale).to(q.dtype)
    return out


def mla_cache_rows(page_table_row: Tensor, kv_len: int, page_size: int) -> Tensor:
    """Flat cache row index [kv_len] int64 of tokens 0..kv_len-1 of one sequence."""
    pos = torch.arange(kv_len, device=page_table_row.device)
    return page_table_row[pos // page_size].long() * page_size + pos % page_size


def mla_store_latent(latent: Tensor, cache: Tensor, slot_mapping: Tensor, kv_scale: float = 1.0) -> None:
    """Write latent rows [T, Dl] into `cache` [num_pages, page_size, Dl] at flat rows `slot_mapping` [T].

    Mutates `cache`. For an fp8 cache the rows are stored as latent / kv_scale.
    """
    flat = cache.view(-1, cache.shape[-1])
    rows = latent.float() / kv_scale if kv_scale != 1.0 else latent
    flat[slot_mapping] = rows.to(cache.dtype)


def mla_norm_store_latent(kv_c: Tensor, k_pe: Tensor, weight: Tensor, eps: float, cache: Tensor,
                          slot_mapping: Tensor, kv_scale: float = 1.0) -> None:
    """Normalise and store new latent rows: `mla_store_latent(cat([rms_norm(kv_c, weight, eps), k_pe], -1), cache,
    slot_mapping, kv_scale)` (the kv_a_layernorm of c_kv, then the cache write).

    kv_c: [T, kv_lora_rank] pre-norm c_kv; k_pe: [T, rope] (already rotated where the model rotates); weight:
    [kv_lora_rank] the norm gain. Mutates `cache` rows `slot_mapping` only; returns nothing (c_kv is read back from
    the cache by every consumer)."""
    mla_store_latent(torch.cat([rms_norm(kv_c, weight, eps), k_pe], dim=-1), cache, slot_mapping, kv_scale)


def mla_gather_latent(
    cache: Tensor, page_table: Tensor, kv_lens: list[int], out_dtype: torch.dtype, kv_scale: float = 1.0
) -> Tensor:
    """The cached rows of each sequence back to back: [sum(kv_lens), Dl] in out_dtype (dequantised)."""
    flat = cache.view(-1, cache.shape[-1])
    page_size = cache.shape[1]
    rows = [flat[mla_cache_rows(page_table[n], kv_len, page_size)] for n, kv_len in enumerate(kv_lens)]
    latent = torch.cat(rows) if rows else flat[:0]
    return (latent.float() * kv_scale).to(out_dtype)


def mla_attention_paged(
    q: Tensor,
    cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: list[int],
    kv_lens: list[int],
    scale: float,
    v_dim: int,
    kv_scale: float = 1.0,
) -> Tensor:
    """Absorbed MLA: MQA of absorbed queries over the paged latent cache.

    q: [T, H, Dl] absorbed queries [W_UK^T q_nope ; q_pe]; cache: [num_pages, page_size, Dl] (bf16/fp32/fp8);
    page_table: [N, max_pages]; cu_seqlens_q: N+1 host offsets; kv_lens: N host ints (cached + new, the new
    rows already stored). Keys are the full latent rows; values their first `v_dim` columns.
    Returns the latent output [T, H, v_dim] in q.dtype. Does not modify the cache.
    """
    if len(kv_lens) and cu_seqlens_q[-1] == len(kv_lens) and all(ql == 1 for ql in _diff(cu_seqlens_q)):
        return _paged_decode(q, cache, page_table, kv_lens, scale, v_dim, kv_scale)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    flat = cache.view(-1, cache.shape[-1])
    for n in range(len(kv_lens)):
        qs, qe = cu_seqlens_q[n], cu_seqlens_q[n + 1]
        if qe == qs:
            continue
        rows = flat[mla_cache_rows(page_table[n], kv_lens[n], cache.shape[1])].float() * kv_scale
        kv = rows.unsqueeze(1)  # [S, 1, Dl]: one latent head shared by all query heads
        out[qs:qe] = _causal_softmax_attention(q[qs:qe], kv, kv[..., :v_dim], scale).to(q.dtype)
    return out


def _diff(offsets: list[int]) -> list[int]:
    return [b - a for a, b in zip(offsets[:-1], offsets[1:])]


def _paged_decode(
    q: Tensor, cache: Tensor, page_table: Tensor, kv_lens: list[int], scale: float, v_dim: int, kv_scale: float
) -> Tensor:
    """`mla_attention_paged` when every sequence has exactly one new token: all sequences at once, padded to the
    longest context and masked (the same math as the per-sequence loop)."""
    page_size = cache.shape[1]
    lens = torch.tensor(kv_lens, device=q.device)
    pos = torch.arange(max(kv_lens), device=q.device)
    rows = page_table[:, pos // page_size].long() * page_size + pos % page_size  # [N, L]
    kv = cache.view(-1, cache.shape[-1])[rows].float() * kv_scale  # [N, L, Dl]
    scores = torch.einsum("nhd,nld->nhl", q.float(), kv) * scale
    scores = scores.masked_fill((pos[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nhl,nld->nhd", probs, kv[..., :v_dim]).to(q.dtype)


def mla_decode(
    q: Tensor,
    cache: Tensor,
    page_table: Tensor,
    kv_lens: Tensor,
    scale: float,
    v_dim: int,
    kv_scale: float = 1.0,
    *,
    q_rope: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    max_q: int | None = None,
) -> Tensor:
    """`mla_attention_paged` for a batch where every sequence has the same Q new tokens (decode: 1, verify: k), or
    for any mix of query lengths (ragged, with cu_seqlens_q).

    q: [N, Q, H, Dl] absorbed queries; or, with q_rope [N, Q, H, Dl - v_dim], q [N, Q, H, v_dim] holds the latent
    part and q_rope the rope part of the same queries (the concatenation is the query; two views, so the caller
    needs no copy). kv_lens: [N] (device) context lengths after this step; a sequence with kv_lens[n] <= 0 is a
    padding row and gets zeros. Returns [N, Q, H, v_dim] in q.dtype.
    Ragged: q [T, H, Dl] (q_rope [T, H, Dl - v_dim]) flat, cu_seqlens_q [N+1] (device) offsets of each sequence's
    tokens, max_q a host int >= every sequence's token count (the Triton kernel's grid bound; unused here); returns
    [T, H, v_dim], zeros for the rows of padding sequences. The Triton kernel of the same contract takes only
    device values (graph-safe); this reference reads kv_lens (and cu_seqlens_q) on the host.
    """
    if q_rope is not None:
        q = torch.cat([q, q_rope], dim=-1)
    if cu_seqlens_q is not None:
        return _ragged_decode(q, cache, page_table, kv_lens.tolist(), cu_seqlens_q.tolist(), scale, v_dim, kv_scale)
    n, ql, h, dl = q.shape
    lens = kv_lens.tolist()
    out = q.new_zeros(n, ql, h, v_dim)
    live = [i for i, kv_len in enumerate(lens) if kv_len > 0]
    if live:
        idx = torch.tensor(live, device=q.device)
        o = mla_attention_paged(q[idx].reshape(-1, h, dl), cache, page_table[idx],
                                list(range(0, ql * len(live) + 1, ql)), [lens[i] for i in live], scale, v_dim, kv_scale)
        out[idx] = o.view(len(live), ql, h, v_dim)
    return out


def _ragged_decode(q: Tensor, cache: Tensor, page_table: Tensor, kv_lens: list[int], cu: list[int], scale: float,
                   v_dim: int, kv_scale: float) -> Tensor:
    """The ragged `mla_decode`: each live sequence (kv_len > 0, some tokens) on its own (the padded all-decode path of
    `mla_attention_paged` would read the rows past the shorter histories); zeros elsewhere."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_dim)
    for n, kv_len in enumerate(kv_lens):
        qs, qe = cu[n], cu[n + 1]
        if kv_len > 0 and qe > qs:
            out[qs:qe] = mla_attention_paged(q[qs:qe], cache, page_table[n:n + 1], [0, qe - qs], [kv_len], scale,
                                             v_dim, kv_scale)
    return out
