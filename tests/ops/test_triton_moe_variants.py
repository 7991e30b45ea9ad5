"""The prefill variants of the Triton routed experts (`ExpertsConfig` fields past the tiles) against the torch
reference `moe_experts`, in the interpreter (fp32, tolerance 1e-5).

Variants: the grouped (swizzled) program order of each GEMM (ragged last group), the pre-gathered expert-sorted x,
TMA descriptor loads (weights, the sorted x, h), the down GEMM on sub-blocks of the alignment block (all-padding
sub-blocks exit), the half-block tail of either GEMM (both of its branches taken), and their combinations. Every
case has ids outside [0, E) (-1 and E, a token with none valid), experts with zero rows, one heavy expert spanning
several blocks; D and I either ragged against the tiles (48, 40) or multiples of them (64, 64); SiLU and SiTU; every
torch.empty the op allocates starts as NaN. Also: the sorted-x layout, the TMA fallback to pointer loads (a
non-contiguous weight; rows that are not a multiple of 16 bytes), all ids invalid, and the config checks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.ops.triton_env import cpu_interp, rel_err  # sets up Triton first
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import moe_experts as ref_experts

SILU = Activation("silu")
SITU = Activation("situ", beta=4.0, linear_beta=25.0)

VARIANTS = {
    "group": {"group_m1": 3, "group_m2": 2},
    "gather": {"gather_x": True, "group_m1": 4},
    "tma": {"tma1": True, "tma2": True},
    "gather_tma": {"gather_x": True, "tma1": True, "tma2": True, "group_m1": 2, "group_m2": 5},
    "sub16": {"block_m2": 16, "group_m2": 3},
    "sub32_tma_tail": {"block_m2": 32, "tma2": True, "tail_m2": True},
    "tail": {"tail_m1": True, "tail_m2": True},
    "tail_gather_tma": {"tail_m1": True, "tail_m2": True, "gather_x": True, "tma1": True, "tma2": True,
                        "group_m1": 3, "group_m2": 3},
}


def base_config():
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig

    return ExpertsConfig(64, 32, 32, 4, 2, 32, 32, 4, 2)


def inputs(T, k, E, D, DI, seed=0):
    """Weights and a routing with invalid ids (-1, E; token 1 has none valid), experts 2 and 5 empty, and expert 0
    in slot 0 of the first 70 tokens (a run of > 64 rows: a full block, then a tail)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, DI, D, generator=g) * D ** -0.5
    w3 = torch.randn(E, DI, D, generator=g) * D ** -0.5
    w2 = torch.randn(E, D, DI, generator=g) * DI ** -0.5
    x = torch.randn(T, D, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    ids[:70, 0] = 0
    ids = torch.where(ids == 2, torch.full_like(ids, 3), ids)
    ids = torch.where(ids == 5, torch.full_like(ids, 6), ids)
    drop = torch.rand(T, k, generator=g)
    ids = torch.where(drop < 0.1, torch.full_like(ids, -1), ids)
    ids = torch.where((drop >= 0.1) & (drop < 0.2), torch.full_like(ids, E), ids)
    ids[1] = torch.tensor([-1, E] * k)[:k]
    tw = torch.rand(T, k, generator=g) + 0.1
    return x, w1, w3, w2, tw, ids


def check(cfg, T=90, k=3, E=8, D=48, DI=40, act=SITU, **kw):
    from tokenspeed.ops.triton.moe_experts import moe_experts

    x, w1, w3, w2, tw, ids = inputs(T, k, E, D, DI)
    for fn in kw.values():
        x, w1, w3, w2 = fn(x, w1, w3, w2)
    y = moe_experts(x, w1, w3, w2, tw, ids, act, config=cfg)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = rel_err(y, ref_experts(x, w1, w3, w2, tw, ids, act))
    assert err < 1e-5, err


@cpu_interp
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("D,DI,act", [(48, 40, SITU), (64, 64, SILU)], ids=["ragged_situ", "even_silu"])
def test_variant_interp(variant, D, DI, act, poison_empty):
    check(replace(base_config(), **VARIANTS[variant]), D=D, DI=DI, act=act)


@cpu_interp
def test_routing_exercises_every_branch():
    """The routing above has: an expert run longer than one block, blocks whose second half is padding and blocks
    whose second half is not (both tail branches), down sub-blocks of 16 that are all padding, and empty experts."""
    from tokenspeed.ops.triton.moe_align import align_pairs

    _, _, _, _, _, ids = inputs(90, 3, 8, 48, 40)
    P = ids.numel()
    sp, be = align_pairs(ids, 8, 64)
    rows = sp.view(-1, 64)
    used = (be >= 0) & (be < 8)
    assert int((be == 0).sum()) >= 2
    half_pad = rows[:, 32] >= P
    assert bool((used & half_pad).any()) and bool((used & ~half_pad).any())
    assert bool((used[:, None] & (sp.view(-1, 4, 16)[:, :, 0] >= P)).any())
    counts = torch.bincount(ids[(ids >= 0) & (ids < 8)], minlength=8)
    assert counts[2] == 0 and counts[5] == 0


@cpu_interp
@pytest.mark.parametrize("tail", [False, True])
def test_gather_sorted_x_layout_interp(tail, poison_empty):
    """Sorted rows of valid blocks hold x[pair // k], their padding rows zeros; the op on the copy matches."""
    from tokenspeed.ops.triton.moe_align import align_pairs
    from tokenspeed.ops.triton.moe_experts import gather_sorted_x

    x, *_, ids = inputs(90, 3, 8, 48, 40)
    k, E, bm = 3, 8, 64
    sp, be = align_pairs(ids, E, bm)
    xs = gather_sorted_x(x, sp, be, k, E, bm)
    P = ids.numel()
    for b in range(be.numel()):
        if not 0 <= int(be[b]) < E:
            continue
        for r in range(b * bm, (b + 1) * bm):
            p = int(sp[r])
            want = x[p // k] if p < P else torch.zeros_like(x[0])
            assert torch.equal(xs[r], want), (b, r)
    check(replace(base_config(), gather_x=True, tail_m1=tail))


@cpu_interp
def test_tma_fallback_interp(poison_empty):
    """TMA flags on tensors a descriptor cannot take (non-contiguous weights; a 36-byte row) use pointer loads."""
    from tokenspeed.ops.triton.moe_experts import _tma_ok

    cfg = replace(base_config(), gather_x=True, tma1=True, tma2=True, tail_m1=True, tail_m2=True)

    def strided(x, w1, w3, w2):  # same values, transposed storage
        return x, w1.transpose(1, 2).contiguous().transpose(1, 2), w3, w2.transpose(1, 2).contiguous().transpose(1, 2)

    _, w1, _, w2 = strided(*inputs(90, 3, 8, 48, 40)[:4])
    assert not _tma_ok(w1) and not _tma_ok(w2)
    check(cfg, strided=strided)
    assert not _tma_ok(torch.zeros(4, 9))
    check(cfg, D=9, DI=40)  # x rows and w1 / w3 rows of 36 bytes
    check(cfg, D=48, DI=9)  # h and w2 rows of 36 bytes


@cpu_interp
def test_all_ids_invalid_variants_interp(poison_empty):
    from tokenspeed.ops.triton.moe_experts import moe_experts

    x, w1, w3, w2, tw, _ = inputs(5, 2, 8, 48, 40)
    ids = torch.tensor([[-1, 8]] * 5)
    cfg = replace(base_config(), **VARIANTS["tail_gather_tma"], block_m2=32)
    y = moe_experts(x, w1, w3, w2, tw, ids, SILU, config=cfg)
    assert torch.equal(y, torch.zeros_like(y))


@cpu_interp
def test_bad_variant_configs_interp():
    from tokenspeed.ops.triton.moe_experts import moe_experts

    x, w1, w3, w2, tw, ids = inputs(3, 2, 8, 48, 40)
    for bad in ({"block_m2": 128}, {"block_m2": 24}, {"group_m1": -1}, {"block_m": 16, "tail_m1": True},
                {"block_m2": 16, "tail_m2": True}):
        with pytest.raises(ValueError):
            moe_experts(x, w1, w3, w2, tw, ids, SILU, config=replace(base_config(), **bad))


@pytest.mark.parametrize("shape", [(9, 257, 2304, 1024), (3, 9, 64, 32), (17, 897, 3584, 256)],
                         ids=["kimi-linear-48b", "tiny-kimi-linear", "k3-tp8"])
def test_variant_token_counts_cover_every_launch_variant(shape):
    """`variant_token_counts` returns T = 1 and exactly the T where the default launch (its tiles and the direct
    mode) differs from T - 1's, so a warm-up at those lengths meets every variant a step of <= max_tokens rows can
    take; kimi-linear-48b-a3b's (8 routed + the folded shared of 257) are the counts its warm-up adds."""
    from tokenspeed.ops.triton.moe_config import default_config, variant_token_counts

    k, E, D, DI = shape
    counts = variant_token_counts(k, E, D, DI, 4096)

    def key(T):
        cfg = default_config(T, k, E, D, DI)
        return cfg, T <= cfg.direct_max_tokens

    assert counts[0] == 1 and counts == sorted(set(counts))
    assert counts == [T for T in range(1, 4097) if T == 1 or key(T) != key(T - 1)]
    assert {key(T) for T in counts} == {key(T) for T in range(1, 4097)}
    if shape == (9, 257, 2304, 1024):
        assert counts == [1, 2, 5, 457, 914, 3656]
