"""Tests of the plain-torch MLA reference (expanded form, absorbed form over a paged latent cache).

Scenarios:
* absorbed == expanded: queries absorbed through W_UK, latents [c_kv ; k_pe] stored at scattered pages
  (page sizes that do not divide the lengths, unused pages poisoned with NaN), MQA over the cache, then the
  latent output expanded by W_UV; a batch mixing decode (q_len 1), prefill (q_len == kv_len) and chunk
  continuation (q_len < kv_len, cached prefix stored by an earlier call). fp32, rel < 1e-5.
* expanded form == a naive per-query, per-head python softmax loop (causal, bottom-right aligned), including
  a sequence with no new queries.
* mla_gather_latent returns each sequence's rows in token order; mla_store_latent writes only its slots;
  mla_attention_paged leaves the cache untouched.
* fp8 e4m3 cache with a per-tensor kv_scale: stored rows dequantise within fp8 rounding, and attention
  stays within 5e-2 (relative, in norm; 1e-1 elementwise) of the fp32-cache result; a bf16 cache stays
  within bf16 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from tests.conftest import rel_err
from tokenspeed.ops import (
    mla_attention_expanded,
    mla_attention_paged,
    mla_gather_latent,
    mla_store_latent,
)

H, NOPE, ROPE, VD, R = 3, 16, 8, 12, 24  # heads, q/k nope dim, shared "pe" dim, v head dim, kv_lora_rank
DL = R + ROPE  # latent row width
SCALE = (NOPE + ROPE) ** -0.5

# (q_len, kv_len) per sequence: decode, prefill, chunk continuation, another decode, a long prefill.
BATCH = [(1, 9), (7, 7), (4, 13), (1, 1), (11, 11)]


def cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def make_problem(batch: list[tuple[int, int]], seed: int = 0) -> dict:
    """Random per-head queries, a kv_b weight and per-token latents (c_kv, k_pe) for every kv token."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(q for q, _ in batch)
    S = sum(k for _, k in batch)
    return {
        "q_nope": torch.randn(T, H, NOPE, generator=gen),
        "q_pe": torch.randn(T, H, ROPE, generator=gen),
        "kv_b": torch.randn(H * (NOPE + VD), R, generator=gen) * R**-0.5,
        "c_kv": torch.randn(S, R, generator=gen),
        "k_pe": torch.randn(S, ROPE, generator=gen),
    }


def split_kv_b(kv_b: Tensor) -> tuple[Tensor, Tensor]:
    """W_UK [H, NOPE, R], W_UV [H, VD, R] from the kv_b_proj weight [H*(NOPE+VD), R]."""
    w = kv_b.view(H, NOPE + VD, R)
    return w[:, :NOPE], w[:, NOPE:]


def expanded(p: dict, batch: list[tuple[int, int]]) -> Tensor:
    """The expanded (per-head keys and values) MLA output [T, H, VD]."""
    w_uk, w_uv = split_kv_b(p["kv_b"])
    k_nope = torch.einsum("hnr,sr->shn", w_uk, p["c_kv"])
    k = torch.cat([k_nope, p["k_pe"][:, None, :].expand(-1, H, -1)], dim=-1)
    v = torch.einsum("hvr,sr->shv", w_uv, p["c_kv"])
    q = torch.cat([p["q_nope"], p["q_pe"]], dim=-1)
    return mla_attention_expanded(q, k, v, cu([b[0] for b in batch]), cu([b[1] for b in batch]), SCALE)


def scattered_pages(batch: list[tuple[int, int]], page_size: int, seed: int) -> tuple[Tensor, int, int]:
    """page_table [N, max_pages] of shuffled distinct pages; the pad entries point at a never-written page.

    Returns (page_table, num_pages, pad_page).
    """
    need = [math.ceil(k / page_size) for _, k in batch]
    max_pages = max(need) + 1
    num_pages = sum(need) + 4
    perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
    pad_page = 0
    table = torch.full((len(batch), max_pages), pad_page, dtype=torch.int32)
    used = 0
    for n, k in enumerate(need):
        table[n, :k] = perm[used : used + k].int()
        used += k
    return table, num_pages, pad_page


def slots(table_row: Tensor, start: int, stop: int, page_size: int) -> Tensor:
    """Flat cache rows of tokens start..stop-1 of one sequence."""
    pos = torch.arange(start, stop)
    return table_row[pos // page_size].long() * page_size + pos % page_size


def fill_cache(
    latent: Tensor,
    batch: list[tuple[int, int]],
    table: Tensor,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    kv_scale: float = 1.0,
) -> Tensor:
    """A NaN-poisoned cache holding every sequence's latents: the cached prefix first, then the new tokens."""
    cache = torch.full((num_pages, page_size, DL), float("nan")).to(dtype)
    kv_off = cu([b[1] for b in batch])
    for n, (q_len, kv_len) in enumerate(batch):
        base = kv_off[n]
        cached = kv_len - q_len
        if cached:  # an earlier step stored the prefix
            mla_store_latent(latent[base : base + cached], cache, slots(table[n], 0, cached, page_size), kv_scale)
        mla_store_latent(
            latent[base + cached : base + kv_len], cache, slots(table[n], cached, kv_len, page_size), kv_scale
        )
    return cache


def absorbed(
    p: dict,
    batch: list[tuple[int, int]],
    page_size: int,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
    kv_scale: float = 1.0,
) -> Tensor:
    """Absorbed MLA over a paged cache, expanded back through W_UV: [T, H, VD]."""
    w_uk, w_uv = split_kv_b(p["kv_b"])
    q_abs = torch.cat([torch.einsum("hnr,thn->thr", w_uk, p["q_nope"]), p["q_pe"]], dim=-1)  # [T, H, DL]
    latent = torch.cat([p["c_kv"], p["k_pe"]], dim=-1)  # [S, DL]
    table, num_pages, _ = scattered_pages(batch, page_size, seed)
    cache = fill_cache(latent, batch, table, num_pages, page_size, dtype, kv_scale)
    o_lat = mla_attention_paged(
        q_abs, cache, table, cu([b[0] for b in batch]), [b[1] for b in batch], SCALE, R, kv_scale
    )
    assert o_lat.shape == (q_abs.shape[0], H, R)
    return torch.einsum("hvr,thr->thv", w_uv, o_lat)


@pytest.mark.parametrize("page_size", [1, 3, 4, 5])
def test_absorbed_paged_matches_expanded(page_size: int) -> None:
    p = make_problem(BATCH)
    ref = expanded(p, BATCH)
    got = absorbed(p, BATCH, page_size)
    assert torch.isfinite(got).all(), "a NaN-poisoned cache row that no sequence owns was read"
    assert rel_err(got, ref) < 1e-5


def test_absorbed_single_decode_sequence() -> None:
    batch = [(1, 17)]
    p = make_problem(batch, seed=3)
    assert rel_err(absorbed(p, batch, page_size=6), expanded(p, batch)) < 1e-5


def naive_attention(q: Tensor, k: Tensor, v: Tensor, batch: list[tuple[int, int]], scale: float) -> Tensor:
    """One query, one head at a time: softmax over keys 0..kv_len - q_len + j, in fp64."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    qo, ko = cu([b[0] for b in batch]), cu([b[1] for b in batch])
    for n, (q_len, kv_len) in enumerate(batch):
        for j in range(q_len):
            pos = kv_len - q_len + j
            for h in range(q.shape[1]):
                qv = q[qo[n] + j, h].double()
                scores = [float(qv @ k[ko[n] + t, h].double()) * scale for t in range(pos + 1)]
                m = max(scores)
                e = [math.exp(s - m) for s in scores]
                z = sum(e)
                for t in range(pos + 1):
                    out[qo[n] + j, h] += (e[t] / z) * v[ko[n] + t, h].double()
    return out


def test_expanded_matches_naive_loop() -> None:
    batch = [(1, 6), (5, 5), (3, 8), (0, 4), (2, 2)]
    T, S = sum(b[0] for b in batch), sum(b[1] for b in batch)
    q = torch.randn(T, H, 10)
    k = torch.randn(S, H, 10)
    v = torch.randn(S, H, 7)
    got = mla_attention_expanded(q, k, v, cu([b[0] for b in batch]), cu([b[1] for b in batch]), 0.4)
    assert got.shape == (T, H, 7) and got.dtype == torch.float32
    assert rel_err(got, naive_attention(q, k, v, batch, 0.4)) < 1e-5


def test_expanded_is_causal_bottom_right() -> None:
    """Changing a key/value after a query's position does not change that query's output."""
    batch = [(3, 8)]
    q, k, v = torch.randn(3, H, 10), torch.randn(8, H, 10), torch.randn(8, H, 7)
    base = mla_attention_expanded(q, k, v, [0, 3], [0, 8], 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[7] += 5.0
    v2[7] += 5.0  # only the last query (position 7) sees token 7
    moved = mla_attention_expanded(q, k2, v2, [0, 3], [0, 8], 0.3)
    assert torch.equal(moved[:2], base[:2])
    assert not torch.allclose(moved[2], base[2])
    assert rel_err(base, naive_attention(q, k, v, batch, 0.3)) < 1e-5


def test_gather_returns_rows_in_order() -> None:
    batch = [(2, 7), (1, 3), (4, 10)]
    latent = torch.randn(sum(b[1] for b in batch), DL)
    page_size = 4
    table, num_pages, _ = scattered_pages(batch, page_size, seed=5)
    cache = fill_cache(latent, batch, table, num_pages, page_size)
    got = mla_gather_latent(cache, table, [b[1] for b in batch], torch.float32)
    assert torch.equal(got, latent)
    # Shorter kv_lens give each sequence's prefix, still back to back.
    got2 = mla_gather_latent(cache, table, [3, 0, 5], torch.float32)
    kv_off = cu([b[1] for b in batch])
    assert torch.equal(got2, torch.cat([latent[0:3], latent[kv_off[2] : kv_off[2] + 5]]))


def test_store_touches_only_its_slots() -> None:
    cache = torch.randn(6, 4, DL)
    before = cache.clone()
    slot_mapping = torch.tensor([13, 2, 20, 7])
    rows = torch.randn(4, DL)
    mla_store_latent(rows, cache, slot_mapping)
    flat, flat_before = cache.view(-1, DL), before.view(-1, DL)
    assert torch.equal(flat[slot_mapping], rows)
    others = torch.ones(flat.shape[0], dtype=torch.bool)
    others[slot_mapping] = False
    assert torch.equal(flat[others], flat_before[others])


def test_paged_attention_does_not_modify_cache() -> None:
    batch = [(2, 5), (1, 4)]
    latent = torch.randn(9, DL)
    table, num_pages, _ = scattered_pages(batch, 3, seed=2)
    cache = fill_cache(latent, batch, table, num_pages, 3)
    before = cache.clone()
    mla_attention_paged(torch.randn(3, H, DL), cache, table, [0, 2, 3], [5, 4], SCALE, R)
    assert torch.equal(cache.nan_to_num(0.0), before.nan_to_num(0.0))
    assert torch.equal(cache.isnan(), before.isnan())


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def test_fp8_store_dequantises_within_fp8_rounding() -> None:
    batch = [(3, 11), (1, 6)]
    latent = torch.randn(17, DL) * 3.0
    kv_scale = latent.abs().max().item() / FP8_MAX * 1.5
    page_size = 4
    table, num_pages, _ = scattered_pages(batch, page_size, seed=4)
    cache = fill_cache(latent, batch, table, num_pages, page_size, dtype=FP8, kv_scale=kv_scale)
    assert cache.dtype == FP8
    got = mla_gather_latent(cache, table, [11, 6], torch.float32, kv_scale=kv_scale)
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4 for normals; subnormal spacing 2^-9 (times scale).
    tol = latent.abs() * 2**-4 + 2**-10 * kv_scale + 1e-7
    assert ((got - latent).abs() <= tol).all()
    # kv_scale really scales: without it the dequantised rows are latent / kv_scale.
    raw = mla_gather_latent(cache, table, [11, 6], torch.float32)
    assert rel_err(raw * kv_scale, latent) < 0.07


@pytest.mark.parametrize("page_size", [3, 8])
def test_fp8_cache_attention_close_to_fp32(page_size: int) -> None:
    p = make_problem(BATCH, seed=7)
    ref = absorbed(p, BATCH, page_size)
    amax = torch.cat([p["c_kv"], p["k_pe"]], dim=-1).abs().max().item()
    kv_scale = amax / FP8_MAX
    got = absorbed(p, BATCH, page_size, dtype=FP8, kv_scale=kv_scale)
    assert torch.isfinite(got).all()
    # e4m3 rounds each latent by up to 6%: over random seeds the output error is ~3% in norm and the largest
    # single element reaches ~5% of max|ref|, so the tight bound is on the norm and the elementwise one looser.
    assert ((got - ref).norm() / ref.norm()).item() < 5e-2
    assert rel_err(got, ref) < 1e-1
    assert rel_err(got, ref) > 1e-3  # the fp8 path really quantised something


def test_bf16_cache_attention_close_to_fp32() -> None:
    p = make_problem(BATCH, seed=8)
    ref = absorbed(p, BATCH, 5)
    got = absorbed(p, BATCH, 5, dtype=torch.bfloat16)
    assert rel_err(got, ref) < 2e-2


def test_batched_decode_equals_each_sequence_alone() -> None:
    """The all-decode fast path (one einsum over padded contexts) == the per-sequence path."""
    from tokenspeed.ops.reference.mla import mla_attention_paged

    torch.manual_seed(3)
    page, dl, h = 4, 24, 3
    cache = torch.randn(40, page, dl)
    kv_lens = [1, 9, 4, 13, 7]
    table = torch.randperm(40)[: 5 * 4].view(5, 4).int()
    q = torch.randn(5, h, dl)
    batched = mla_attention_paged(q, cache, table, [0, 1, 2, 3, 4, 5], kv_lens, 0.3, 16)
    for n in range(5):
        solo = mla_attention_paged(q[n : n + 1], cache, table[n : n + 1], [0, 1], kv_lens[n : n + 1], 0.3, 16)
        torch.testing.assert_close(batched[n : n + 1], solo, rtol=1e-6, atol=1e-6)


def test_mla_decode_reference_ragged_form() -> None:
    """The ragged form of the reference `mla_decode` (flat q [T, H, Dl], cu_seqlens): each live sequence equals
    `mla_attention_paged` of it alone, the rows of a padding sequence (kv_len <= 0) are zeros and one without new
    tokens takes no rows; the q / q_rope split is the concatenation; a uniform batch gives the uniform form."""
    from tokenspeed.ops.reference.mla import mla_attention_paged, mla_decode

    torch.manual_seed(4)
    page, dl, h, v = 4, 24, 3, 16
    cache = torch.randn(40, page, dl)
    q_lens, kv_lens = [1, 6, 0, 2, 1], [9, 13, 4, 0, 5]
    table = torch.randperm(40)[: 5 * 4].view(5, 4).int()
    cu_list = [0]
    for n in q_lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list)
    q = torch.randn(cu_list[-1], h, dl)
    got = mla_decode(q, cache, table, torch.tensor(kv_lens), 0.3, v, cu_seqlens_q=cu, max_q=6)
    assert got.shape == (10, h, v)
    for n, (ql, kv) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(cu_list[n], cu_list[n + 1])
        want = torch.zeros(ql, h, v) if kv <= 0 else mla_attention_paged(q[rows], cache, table[n : n + 1], [0, ql],
                                                                           [kv], 0.3, v)
        assert torch.equal(got[rows], want)
    split = mla_decode(q[..., :v], cache, table, torch.tensor(kv_lens), 0.3, v, q_rope=q[..., v:], cu_seqlens_q=cu,
                       max_q=6)
    assert torch.equal(split, got)
    qu = torch.randn(3, 2, h, dl)
    uniform = mla_decode(qu, cache, table[:3], torch.tensor(kv_lens[:3]), 0.3, v)
    ragged = mla_decode(qu.view(6, h, dl), cache, table[:3], torch.tensor(kv_lens[:3]), 0.3, v,
                        cu_seqlens_q=torch.tensor([0, 2, 4, 6]), max_q=2)
    torch.testing.assert_close(ragged.view(3, 2, h, v), uniform, rtol=1e-6, atol=1e-6)
