"""The align-free direct mode of the Triton routed experts (`ExpertsConfig.direct_max_tokens`: block p = pair p, no
alignment launch) against the aligned path and the torch reference.

CPU (Triton interpreter, fp32): every output element bit for bit the aligned path's with the same config (so also
within 1e-5 of the reference) at T = 1..4, k = 1, 2, 8, E = 8, 64, 256, D / I ragged against the tiles (48 / 40,
33 / 17), multiples of them (64 / 64) and D over several N tiles (200); SiLU and SiTU; with `add=`; ids outside
[0, E) (-1, E, a token with none valid); tokens sharing experts (pairs of one expert in several blocks); int32 and
strided ids; the intermediate h row of each pair equal to the aligned h row of that pair; the prefill variants
(tails, down sub-blocks, grouped order, gathered x, TMA) on or off make no difference. `default_config` takes the
direct mode up to DIRECT_MAX_TOKENS tokens and not above; the direct mode launches no alignment and never asks the
host for a value; a negative threshold is rejected. Every torch.empty the op allocates starts as NaN.
The interpreter's fp32 dot is numpy's sgemm, whose result for a row may depend on the row's position in the tile
(this host's OpenBLAS: rows 6..15 of a 16-row tile take another kernel path and can differ in the last bit); a
direct block computes its pair at row 0, an aligned block at its rank among the expert's pairs, which stays <= 3
at T <= 4 with distinct ids per token, the range these bit-for-bit checks use.
CUDA (`-m gpu`): bf16 at the Kimi-Linear-48B shapes, T = 1, 2, 4, bit for bit against the aligned path; bf16 and
fp32 with 16 pairs per expert (aligned rows 0..15 against the direct row 0: the MMA's result for a row does not
depend on its position). Graph replay of the direct mode: `test_triton_moe_experts.py::test_cuda_graph_replay_gpu`
(T = 1, 4).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # first: sets up the Triton interpreter
from tests.ops.moe_inputs import KIMI, make_weights
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import moe_experts as ref_experts

SILU = Activation("silu")
SITU = Activation("situ", beta=4.0, linear_beta=25.0)


def routing(T: int, k: int, E: int, D: int, dtype, device, seed: int = 0, invalid: bool = False,
            shared: bool = False):
    """x [T, D], weights [T, k] fp32 and k distinct ids per token; `invalid`: some ids -1 / E and (T > 1) token 1
    with none valid; `shared`: every token also picks token 0's first expert (pairs of one expert in T blocks)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    if shared:
        for t in range(1, T):
            if ids[0, 0] not in ids[t]:
                ids[t, -1] = ids[0, 0]
    if invalid:
        drop = torch.rand(T, k, generator=g)
        ids = torch.where(drop < 0.2, torch.full_like(ids, -1), ids)
        ids = torch.where((drop >= 0.2) & (drop < 0.35), torch.full_like(ids, E), ids)
        if T > 1:
            ids[1] = torch.tensor([-1, E] * k)[:k]
    tw = torch.rand(T, k, generator=g) + 0.1
    return x, tw.to(device), ids.to(device)


def both(x, w1, w3, w2, tw, ids, act, cfg, add=None):
    """(direct, aligned) results of the Triton op under cfg with the direct mode forced on / off."""
    from tokenspeed.ops.triton.moe_experts import moe_experts

    T = x.shape[0]
    direct = moe_experts(x, w1, w3, w2, tw, ids, act, add=add, config=replace(cfg, direct_max_tokens=T))
    aligned = moe_experts(x, w1, w3, w2, tw, ids, act, add=add, config=replace(cfg, direct_max_tokens=0))
    assert direct.shape == aligned.shape == (T, w2.shape[1]) and direct.dtype == x.dtype
    return direct, aligned


def check(T, k, E, D, DI, act, *, cfg=None, add=False, seed=0, **rkw):
    from tokenspeed.ops.triton.moe_experts import default_config

    w1, w3, w2 = make_weights(E, D, DI, torch.float32, "cpu", seed=seed)
    x, tw, ids = routing(T, k, E, D, torch.float32, "cpu", seed=seed, **rkw)
    s = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 1)) if add else None
    cfg = cfg or default_config(T, k, E, D, DI, 4)
    direct, aligned = both(x, w1, w3, w2, tw, ids, act, cfg, add=s)
    assert torch.equal(direct, aligned)
    assert rel_err(direct, ref_experts(x, w1, w3, w2, tw, ids, act, add=s)) < 1e-5


# ----------------------------------------------------------------------------- CPU (interpreter, fp32)
@cpu_interp
@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("k,E", [(1, 8), (2, 8), (8, 8), (8, 64), (8, 256)])
def test_direct_equals_aligned_interp(T, k, E, poison_empty):
    check(T, k, E, 48, 40, SITU if T % 2 else SILU, seed=T * 10 + k, invalid=T == 3, shared=T == 4)


@cpu_interp
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("D,DI", [(33, 17), (64, 64), (200, 40)])
@pytest.mark.parametrize("T", [1, 4])
def test_direct_dims_interp(T, D, DI, act, poison_empty):
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig

    # 32-wide tiles: D 200 spans 7 N tiles, 64 / 64 takes the unmasked K loops (BLOCK_K 32 and 64)
    cfg = ExpertsConfig(16, 32, 32, 4, 2, 32, 64, 4, 2)
    check(T, 8 if T == 1 else 4, 64, D, DI, act, cfg=cfg, seed=D + T, invalid=True)


@cpu_interp
@pytest.mark.parametrize("T,k,E", [(1, 8, 256), (2, 2, 8), (3, 8, 64), (4, 1, 8)])
def test_direct_add_interp(T, k, E, poison_empty):
    check(T, k, E, 48, 40, SILU, add=True, seed=T, invalid=T == 3)


@cpu_interp
def test_direct_all_invalid_interp(poison_empty):
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig, moe_experts

    w1, w3, w2 = make_weights(8, 48, 40, torch.float32, "cpu")
    x, tw, _ = routing(2, 2, 8, 48, torch.float32, "cpu")
    ids = torch.tensor([[-1, 8], [9, -3]])
    cfg = ExpertsConfig(direct_max_tokens=2)
    assert torch.equal(moe_experts(x, w1, w3, w2, tw, ids, SILU, config=cfg), torch.zeros(2, 48))
    s = torch.randn(2, 48)
    assert torch.equal(moe_experts(x, w1, w3, w2, tw, ids, SILU, config=cfg, add=s), s)


@cpu_interp
def test_direct_ids_int32_and_strided_interp(poison_empty):
    from tokenspeed.ops.triton.moe_experts import default_config, moe_experts

    w1, w3, w2 = make_weights(64, 48, 40, torch.float32, "cpu")
    x, tw, ids = routing(3, 8, 64, 48, torch.float32, "cpu", invalid=True)
    cfg = default_config(3, 8, 64, 48, 40, 4)
    want = moe_experts(x, w1, w3, w2, tw, ids, SITU, config=cfg)
    strided = ids.t().contiguous().t()
    assert not strided.is_contiguous()
    for variant in (ids.int(), strided, ids.to(torch.int32).t().contiguous().t()):
        assert torch.equal(moe_experts(x, w1, w3, w2, tw, variant, SITU, config=cfg), want)


@cpu_interp
@pytest.mark.parametrize("T,k,E", [(1, 8, 256), (4, 3, 8)])
def test_direct_h_rows_interp(T, k, E, poison_empty):
    """Direct h row p == the aligned h row holding pair p, bit for bit (valid pairs); so are the per-pair buffers."""
    from tokenspeed.ops.triton import moe_experts as tk
    from tokenspeed.ops.triton.moe_align import align_pairs

    w1, w3, w2 = make_weights(E, 48, 40, torch.float32, "cpu")
    x, _, ids = routing(T, k, E, 48, torch.float32, "cpu", invalid=True, shared=True)
    cfg = tk.default_config(T, k, E, 48, 40, 4)
    P = T * k
    flat = ids.reshape(-1)
    sp, be = align_pairs(ids, E, cfg.block_m)
    h_al = tk.gate_up(x, w1, w3, sp, be, k, SITU, cfg)
    buf_al = tk.down(h_al, w2, sp, be, P, cfg)
    h_dir = tk.gate_up_direct(x, w1, w3, flat.contiguous(), k, SITU, cfg)
    buf_dir = tk.down_direct(h_dir, w2, flat.contiguous(), cfg)
    assert h_dir.shape == (P, 40) and buf_dir.shape == (P, 48)
    assert torch.equal(buf_dir, buf_al)
    valid = (flat >= 0) & (flat < E)
    assert bool(valid.any()) and not bool(valid.all())
    for r in range(sp.numel()):
        p = int(sp[r])
        if p < P and bool(valid[p]):
            assert torch.equal(h_dir[p], h_al[r]), (p, r)
    assert torch.equal(buf_dir[~valid], torch.zeros_like(buf_dir[~valid]))


@cpu_interp
@pytest.mark.parametrize("variant", [
    {"tail_m1": True, "tail_m2": True},
    {"block_m2": 32, "tail_m2": True, "group_m2": 3},
    {"group_m1": 2, "gather_x": True, "tma1": True, "tma2": True},
], ids=["tails", "sub32_tail", "group_gather_tma"])
def test_direct_ignores_prefill_variants_interp(variant, poison_empty):
    """With the prefill variants on, the direct mode (which runs none of them but the tails' tile height) still
    gives the aligned path's result bit for bit."""
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig

    cfg = replace(ExpertsConfig(64, 32, 32, 4, 2, 32, 32, 4, 2), **variant)
    check(3, 4, 8, 48, 40, SITU, cfg=cfg, invalid=True, shared=True)
    check(2, 8, 64, 64, 64, SILU, cfg=cfg, add=True)


@cpu_interp
def test_default_config_threshold_interp():
    from tokenspeed.ops.triton.moe_experts import DIRECT_MAX_TOKENS, ExpertsConfig, default_config

    assert ExpertsConfig().direct_max_tokens == 0  # explicit configs keep the aligned path
    for T in (1, DIRECT_MAX_TOKENS, DIRECT_MAX_TOKENS + 1, 64, 8192):
        cfg = default_config(T, KIMI["k"], KIMI["E"], KIMI["D"], KIMI["I"])
        assert cfg.direct_max_tokens == (DIRECT_MAX_TOKENS if T * 8 / 256 <= 16 else 0)
        assert (T <= cfg.direct_max_tokens) == (T <= DIRECT_MAX_TOKENS)


@cpu_interp
def test_direct_skips_alignment_and_host_reads_interp(monkeypatch, poison_empty):
    """No alignment launch (either kind) and no value pulled to the host in the direct mode."""
    from tokenspeed.ops.triton import moe_align
    from tokenspeed.ops.triton import moe_experts as tk

    w1, w3, w2 = make_weights(16, 48, 40, torch.float32, "cpu")
    x, tw, ids = routing(4, 8, 16, 48, torch.float32, "cpu", invalid=True, shared=True)
    want = ref_experts(x, w1, w3, w2, tw, ids, SITU)

    def boom(*a, **kw):
        raise AssertionError("alignment or host read in the direct mode")

    monkeypatch.setattr(tk, "align", boom)
    for name in ("align", "align_pairs", "align_pairs_fused"):
        monkeypatch.setattr(moe_align, name, boom)
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for name in ("nonzero", "unique", "bincount", "masked_select", "sort", "argsort"):
        monkeypatch.setattr(torch, name, boom)
    y = tk.moe_experts(x, w1, w3, w2, tw, ids, SITU)  # default_config: T = 4 takes the direct mode
    monkeypatch.undo()
    assert rel_err(y, want) < 1e-5


@cpu_interp
def test_bad_threshold_interp():
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig, moe_experts

    w1, w3, w2 = make_weights(8, 48, 40, torch.float32, "cpu")
    x, tw, ids = routing(2, 2, 8, 48, torch.float32, "cpu")
    with pytest.raises(ValueError, match="direct_max_tokens"):
        moe_experts(x, w1, w3, w2, tw, ids, SILU, config=ExpertsConfig(direct_max_tokens=-1))


# ----------------------------------------------------------------------------- CUDA
@functools.lru_cache(maxsize=1)
def kimi_weights():
    return make_weights(KIMI["E"], KIMI["D"], KIMI["I"], torch.bfloat16, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_direct_kimi_bf16_gpu(T, act, poison_empty):
    from tokenspeed.ops.triton.moe_experts import default_config

    w1, w3, w2 = kimi_weights()
    x, tw, ids = routing(T, KIMI["k"], KIMI["E"], KIMI["D"], torch.bfloat16, "cuda", seed=T, invalid=T == 4,
                         shared=T == 2)
    s = torch.randn_like(x)
    cfg = default_config(T, KIMI["k"], KIMI["E"], KIMI["D"], KIMI["I"])
    assert T <= cfg.direct_max_tokens
    for add in (None, s):
        direct, aligned = both(x, w1, w3, w2, tw, ids, act, cfg, add=add)
        assert torch.equal(direct, aligned)
        assert rel_err(direct.float(), ref_experts(x, w1, w3, w2, tw, ids, act, add=add).float()) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_direct_full_blocks_gpu(dtype):
    """16 tokens on the same 4 experts: each aligned block holds 16 pairs (rows 0..15), each direct block one (row
    0); the results agree bit for bit, so the GPU dot's row results do not depend on the row's place in the tile."""
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig

    T, k, E, D, DI = 16, 4, 4, 256, 128
    w1, w3, w2 = make_weights(E, D, DI, dtype, "cuda")
    x, tw, ids = routing(T, k, E, D, dtype, "cuda")
    assert bool((ids.sort(1).values == torch.arange(E, device="cuda")).all())  # every token on all 4 experts
    for cfg in (ExpertsConfig(16, 32, 64, 4, 3, 32, 64, 4, 3), ExpertsConfig(64, 64, 64, 4, 3, 64, 64, 4, 3)):
        direct, aligned = both(x, w1, w3, w2, tw, ids, SITU, cfg)
        assert torch.equal(direct, aligned)
