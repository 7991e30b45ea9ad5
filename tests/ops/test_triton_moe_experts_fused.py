"""The fused one-launch experts path of the Triton routed experts (`ExpertsConfig.fused_max_tokens`:
`tokenspeed.ops.triton.moe_fused` + `moe_combine.combine_partials`) against the torch reference and the two-launch
direct path.

CPU (Triton interpreter, fp32): T = 1..4, k = 2..4 with the folded shared expert (id E - 1 in every row, as
`moe_route(..., shared_expert_id=)` appends it), E = 8, hidden 64..256 and intermediate 64..256, ragged against the
chunk / column tiles (D 72, I 80); SiLU and SiTU; with `add=`; with the junction (residual + norm weight: bit for
bit the fused op's output followed by `tokenspeed.ops.triton.norm.add_rms_norm`, and within 1e-5 of the reference
junction); ids outside [0, E); every chunk width and down column block; the op's torch.empty outputs start as NaN,
and the partials too. Fused against the two-launch path within 1e-5 (only the fp32 order of the down sum differs).
The fused path is one experts launch (the two-launch kernels patched to raise), deterministic over repeated calls,
leaves the combine's row counters at zero, and is taken by `default_config` up to FUSED_MAX_TOKENS unless
TOKENSPEED_MOE_FUSED=0. CUDA (`-m gpu`): bf16 at the Kimi-Linear-48B shapes, fused against the two-launch path and
the reference, plain and with the junction.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.ops.moe_inputs import KIMI, make_weights
from tests.ops.triton_env import needs_cuda, rel_err  # first: sets up the Triton interpreter
from tokenspeed.ops.reference.activation import Activation
from tokenspeed.ops.reference.moe import moe_experts as ref_experts

SILU = Activation("silu")
SITU = Activation("situ", beta=4.0, linear_beta=25.0)



@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """The fused path is opt-in (TOKENSPEED_MOE_FUSED=1); these tests exercise it through the default configs."""
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "1")


def routing(T: int, k: int, E: int, D: int, dtype, device, seed: int = 0, invalid: bool = False):
    """x [T, D], weights [T, k] fp32 and ids [T, k]: k - 1 distinct routed ids of [0, E - 1) per token, then the
    folded shared expert E - 1 with weight 1 (as `with_shared_expert` appends it); `invalid`: some routed ids -1 /
    E (T > 1: token 1 keeps only the shared expert)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    routed = torch.rand(T, E - 1, generator=g).argsort(-1)[:, :k - 1]
    if invalid:
        drop = torch.rand(T, k - 1, generator=g)
        routed = torch.where(drop < 0.3, torch.full_like(routed, -1), routed)
        routed = torch.where((drop >= 0.3) & (drop < 0.5), torch.full_like(routed, E), routed)
        if T > 1:
            routed[1] = torch.tensor([-1, E] * k)[:k - 1]
    ids = torch.cat([routed, torch.full((T, 1), E - 1)], 1)
    tw = torch.cat([torch.rand(T, k - 1, generator=g) + 0.1, torch.ones(T, 1)], 1)
    return x, tw.to(device), ids.to(device)


def configs(T: int, k: int, E: int, D: int, DI: int, elt: int, **fused):
    """(fused, two-launch direct) configs from `default_config`, the fused one with the given overrides."""
    from tokenspeed.ops.triton.moe_experts import default_config

    cfg = replace(default_config(T, k, E, D, DI, elt), direct_max_tokens=T)
    return replace(cfg, fused_max_tokens=T, **fused), replace(cfg, fused_max_tokens=0)


def junction_args(T: int, D: int, dtype, device, seed: int = 5):
    g = torch.Generator(device="cpu").manual_seed(seed)
    res = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    nw = (torch.rand(D, generator=g) + 0.5).to(device=device, dtype=dtype)
    return res, nw


def check(T, k, D, DI, act, *, E=8, add=False, junction=False, invalid=False, seed=0, **fused):
    """The fused path within 1e-5 of the reference and of the two-launch path; with the junction also bit for bit
    its own plain output followed by the Triton `add_rms_norm`."""
    from tokenspeed.ops.triton.moe_experts import moe_experts
    from tokenspeed.ops.triton.norm import add_rms_norm

    w1, w3, w2 = make_weights(E, D, DI, torch.float32, "cpu", seed=seed)
    x, tw, ids = routing(T, k, E, D, torch.float32, "cpu", seed=seed, invalid=invalid)
    s = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 1)) if add else None
    cf, cu = configs(T, k, E, D, DI, 4, **fused)
    fused = moe_experts(x, w1, w3, w2, tw, ids, act, add=s, config=cf)
    unfused = moe_experts(x, w1, w3, w2, tw, ids, act, add=s, config=cu)
    ref = ref_experts(x, w1, w3, w2, tw, ids, act, add=s)
    assert fused.shape == (T, D) and fused.dtype == x.dtype
    assert rel_err(fused, ref) < 1e-5 and rel_err(fused, unfused) < 1e-5
    if junction:
        res, nw = junction_args(T, D, torch.float32, "cpu", seed)
        normed, summed = moe_experts(x, w1, w3, w2, tw, ids, act, add=s, residual=res, norm_weight=nw, config=cf)
        n_ref, s_ref = ref_experts(x, w1, w3, w2, tw, ids, act, add=s, residual=res, norm_weight=nw)
        assert rel_err(summed, s_ref) < 1e-5 and rel_err(normed, n_ref) < 1e-5
        n_un, s_un = add_rms_norm(fused, res, nw, 1e-6)
        assert torch.equal(summed, s_un) and torch.equal(normed, n_un)


@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [2, 4])
def test_fused_interp(T, k, poison_empty):
    check(T, k, 64, 96, SILU, seed=T + k)


@pytest.mark.parametrize("D, DI", [(64, 64), (72, 80), (256, 128), (128, 256)])
@pytest.mark.parametrize("act", [SILU, SITU], ids=["silu", "situ"])
def test_fused_dims_interp(D, DI, act, poison_empty):
    check(2, 3, D, DI, act, seed=D + DI)


@pytest.mark.parametrize("T", [1, 4])
def test_fused_junction_interp(T, poison_empty):
    check(T, 3, 96, 64, SILU, junction=True, seed=T)


@pytest.mark.parametrize("T", [1, 3])
def test_fused_add_junction_invalid_interp(T, poison_empty):
    check(T, 4, 72, 80, SITU, add=True, junction=True, invalid=True, seed=10 + T)


@pytest.mark.parametrize("chunk, block_d", [(16, 16), (32, 64), (64, 32), (128, 128)])
def test_fused_tiles_interp(chunk, block_d, poison_empty):
    check(2, 3, 72, 80, SILU, add=True, fused_chunk=chunk, fused_block_d=block_d)


def test_fused_partials_interp(poison_empty):
    """The partial rows sum to each pair's down product (zeros for an invalid id), every row written."""
    from tokenspeed.ops.reference.activation import gated_activation
    from tokenspeed.ops.triton.moe_fused import fused_direct

    T, k, E, D, DI = 2, 3, 8, 64, 80
    w1, w3, w2 = make_weights(E, D, DI, torch.float32, "cpu", seed=3)
    x, _, ids = routing(T, k, E, D, torch.float32, "cpu", seed=3)
    ids[1, 0] = -1
    cf, _ = configs(T, k, E, D, DI, 4, fused_chunk=32)
    part, nc = fused_direct(x, w1, w3, w2, ids.reshape(-1).contiguous(), k, SILU, cf)
    assert nc == 3 and part.shape == (T * k * nc, D) and part.dtype == torch.float32
    sums = part.view(T * k, nc, D).sum(1)
    for p, e in enumerate(ids.reshape(-1).tolist()):
        xt = x[p // k]
        want = torch.zeros(D) if e < 0 else gated_activation(xt @ w1[e].t(), xt @ w3[e].t(), SILU) @ w2[e].t()
        assert rel_err(sums[p], want) < 1e-5 if e >= 0 else torch.equal(sums[p], want)


def test_fused_one_launch_deterministic_interp(monkeypatch, poison_empty):
    """The fused path launches neither two-launch kernel, repeats bit for bit, and resets the row counters."""
    from tokenspeed.ops.triton import moe_experts as tk
    from tokenspeed.ops.triton.moe_combine import row_counters

    def boom(*a, **kw):
        raise AssertionError("two-launch kernel called on the fused path")

    monkeypatch.setattr(tk, "gate_up_direct", boom)
    monkeypatch.setattr(tk, "down_direct", boom)
    T, k, E, D, DI = 2, 3, 8, 64, 64
    w1, w3, w2 = make_weights(E, D, DI, torch.float32, "cpu", seed=4)
    x, tw, ids = routing(T, k, E, D, torch.float32, "cpu", seed=4)
    res, nw = junction_args(T, D, torch.float32, "cpu")
    cf, _ = configs(T, k, E, D, DI, 4)
    a = tk.moe_experts(x, w1, w3, w2, tw, ids, SILU, residual=res, norm_weight=nw, config=cf)
    b = tk.moe_experts(x, w1, w3, w2, tw, ids, SILU, residual=res, norm_weight=nw, config=cf)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not row_counters(x.device).any()


def test_fused_config_interp(monkeypatch):
    from tokenspeed.ops.triton.moe_config import FUSED_MAX_TOKENS, _check_config, fused_chunk_size
    from tokenspeed.ops.triton.moe_experts import ExpertsConfig, default_config

    k, E, D, DI = KIMI["k"] + 1, KIMI["E"] + 1, KIMI["D"], KIMI["I"]
    monkeypatch.delenv("TOKENSPEED_MOE_FUSED", raising=False)
    assert ExpertsConfig().fused_max_tokens == 0  # explicit configs keep the two-launch path
    assert default_config(1, k, E, D, DI).fused_max_tokens == 0  # off by default (slower on the H200: moe_config)
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "1")
    assert default_config(1, k, E, D, DI).fused_max_tokens == FUSED_MAX_TOKENS == 4
    assert default_config(64, k, E, D, DI).fused_max_tokens < 64  # a threshold: T = 64 stays on the aligned path
    cfg = default_config(1, k, E, D, DI)
    assert [fused_chunk_size(T * k, DI, cfg) for T in (1, 2, 4)] == [32, 64, 64]
    assert fused_chunk_size(9, DI, replace(cfg, fused_chunk=128)) == 128
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "0")
    assert default_config(1, k, E, D, DI).fused_max_tokens == 0
    monkeypatch.setenv("TOKENSPEED_MOE_FUSED", "yes")
    with pytest.raises(ValueError):
        default_config(1, k, E, D, DI)
    for bad in ({"fused_chunk": 24}, {"fused_chunk": 8}, {"fused_block_d": 0}, {"fused_max_tokens": -1}):
        with pytest.raises(ValueError):
            _check_config(replace(ExpertsConfig(), **bad))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("junction", [False, True])
def test_fused_kimi_bf16_gpu(T, junction, poison_empty):
    """bf16 at the Kimi-Linear shapes (top-8 of 256 + the folded shared expert): the fused path against the
    two-launch path (same roundings, the down sums reordered: a rounding flip of a bf16 expert output at most) and
    the reference."""
    from tokenspeed.ops.triton.moe_experts import moe_experts

    k, E, D, DI = KIMI["k"] + 1, KIMI["E"] + 1, KIMI["D"], KIMI["I"]
    w1, w3, w2 = make_weights(E, D, DI, torch.bfloat16, "cuda", seed=T)
    x, tw, ids = routing(T, k, E, D, torch.bfloat16, "cuda", seed=T)
    cf, cu = configs(T, k, E, D, DI, 2)
    kw = {}
    if junction:
        res, nw = junction_args(T, D, torch.bfloat16, "cuda")
        kw = {"residual": res, "norm_weight": nw}
    fused = moe_experts(x, w1, w3, w2, tw, ids, SILU, config=cf, **kw)
    unfused = moe_experts(x, w1, w3, w2, tw, ids, SILU, config=cu, **kw)
    ref = ref_experts(x, w1, w3, w2, tw, ids, SILU, **kw)
    for f, u, r in zip(*(t if junction else (t,) for t in (fused, unfused, ref))):
        assert rel_err(f, u) < 1e-2 and rel_err(f, r) < 1e-2
