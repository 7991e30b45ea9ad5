"""The WY verify schedule (`KdaConfig(wy=True)`, ops/triton/kda_verify_wy.py) against the plain split launch and the
torch composition on the Triton interpreter (fp32, within 1e-5): windows of one chunk and of several (the state
carried between chunks), a padding slot (zeros), a one-token and a zero-length sequence, the fused norm, both pool
layouts, K3's bounded gate and the softplus gate; the pools are not written; the launches it refuses. GPU parity at
K3 shapes in bf16."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_triton_kda_decode import clone, composed, make, run_fused, tailed
from tests.ops.triton_env import cpu_interp, needs_cuda, rel_err  # sets up Triton first
from tokenspeed.ops.triton.kda_config import KdaConfig, config_from_label
from tokenspeed.ops.triton.kda_verify_wy import window_rows


def verify_pair(lens, H, D, dtype, device, slots, config, norm=False, v_first=False, lower_bound=-5.0, bound=None):
    """(o of the WY launch, o of the plain split launch, o of the composition, pools before / after the WY one);
    `bound`: the WY launch's max_seq_tokens."""
    inp = make(lens, H, D, dtype, device, slots=slots)
    T = sum(lens)
    kw = {"update_state": False}
    if norm:
        g = torch.Generator().manual_seed(5)
        kw.update(norm_gate=torch.randn(T, H * D, generator=g).to(dtype).to(device),
                  norm_weight=torch.randn(D, generator=g).to(device))
    a, p = clone(inp), clone(inp)
    if v_first:
        a["state"] = tailed(a["state"].transpose(-1, -2).contiguous())
    o_wy = run_fused(a, lower_bound, D ** -0.5, config=config, state_v_first=v_first, max_seq_tokens=bound, **kw)
    o_plain = run_fused(p, lower_bound, D ** -0.5, config=KdaConfig(min(16, D)), **kw)
    r = clone(inp)
    o_ref = None if norm else composed(r, lower_bound, D ** -0.5)
    state_after = a["state"].transpose(-1, -2) if v_first else a["state"]
    return o_wy, o_plain, o_ref, inp, state_after, a["conv_state"]


@cpu_interp
@pytest.mark.parametrize("lens,slots", [([4, 4, 1], [5, -1, 2]), ([3, 9, 1, 0], [1, 6, -1, 3])],
                         ids=["one-chunk", "two-chunks"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("told", [False, True], ids=["any-length", "max-told"])
def test_wy_verify_matches_plain_and_composition_interp(lens, slots, v_first, lower_bound, told):
    """Without max_seq_tokens the 9-token sequence of "two-chunks" takes the long path (windows of ceil(T / N) = 4
    in turn); told the maximum, every sequence fits one window."""
    o_wy, o_plain, o_ref, inp, state, conv = verify_pair(lens, 2, 32, torch.float32, "cpu", slots,
                                                         KdaConfig(16, wy=True), v_first=v_first,
                                                         lower_bound=lower_bound, bound=max(lens) if told else None)
    assert rel_err(o_wy, o_plain) < 1e-5 and rel_err(o_wy, o_ref) < 1e-5
    cu = torch.tensor([0] + lens).cumsum(0)
    for n, s in enumerate(slots):
        if s < 0:
            assert o_wy[cu[n]:cu[n + 1]].abs().max() == 0 if lens[n] else True
    assert torch.equal(state, inp["state"]) and torch.equal(conv, inp["conv_state"])  # verify: pools untouched


@cpu_interp
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_wy_keys_pass_matches_plain_interp(v_first, lower_bound, norm):
    """The two-launch WY form (key pass into scratch, then (V tile, sequence, head) programs) equals the plain loop
    within 1e-5: uneven windows within the told bound, a padding slot, a one-token and a zero-length sequence."""
    lens, slots = [4, 3, 1, 0, 4], [5, -1, 2, 3, 0]
    o_kp, o_plain, o_ref, inp, state, conv = verify_pair(lens, 2, 32, torch.float32, "cpu", slots,
                                                         KdaConfig(8, wy=True, keys_pass=True), norm=norm,
                                                         v_first=v_first, lower_bound=lower_bound, bound=4)
    assert rel_err(o_kp, o_plain) < 1e-5 and (o_ref is None or rel_err(o_kp, o_ref) < 1e-5)
    assert o_kp[4:7].abs().max() == 0  # the padding row
    assert torch.equal(state, inp["state"]) and torch.equal(conv, inp["conv_state"])


@cpu_interp
def test_wy_verify_norm_epilogue_interp():
    o_wy, o_plain, _, _, _, _ = verify_pair([4, 2, 4], 2, 16, torch.float32, "cpu", [0, 3, -1],
                                            KdaConfig(16, wy=True), norm=True)
    assert rel_err(o_wy, o_plain) < 1e-5


def test_wy_refusals_and_label():
    from tokenspeed.ops.triton.kda_decode import kda_decode

    cfg = KdaConfig(32, wy=True)
    assert cfg.label == "bv32-split-w4-wy" and config_from_label(cfg.label) == cfg
    kp = KdaConfig(16, window=True, wy=True, keys_pass=True)
    assert kp.label == "bv16-split-w4-win-wy-kp" and config_from_label(kp.label) == kp
    assert window_rows(4) == 4 and window_rows(3) == 4 and window_rows(1) == 1 and window_rows(100) == 16
    inp = make([2, 2], 1, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="verify windows"):
        kda_decode(**clone(inp), lower_bound=-5.0, scale=1.0, update_state=True, config=cfg)
    odd = make([2], 1, 48, torch.float32, "cpu")
    with pytest.raises(ValueError, match="power-of-two head dim"):
        kda_decode(**clone(odd), lower_bound=-5.0, scale=1.0, update_state=False, config=KdaConfig(16, wy=True))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("H,N,q", [(12, 1, 4), (32, 8, 4), (96, 4, 4), (32, 2, 9)])
@pytest.mark.parametrize("bv,warps,kp", [(32, 4, False), (16, 4, False), (64, 4, False), (32, 4, True), (16, 4, True)])
@pytest.mark.parametrize("told", [False, True], ids=["any-length", "max-told"])
def test_wy_verify_k3_shapes_gpu(H, N, q, bv, warps, kp, told):
    lens = [q] * N
    slots = list(range(N))
    slots[-1] = -1 if N > 1 else 0
    o_wy, o_plain, _, inp, state, _ = verify_pair(lens, H, 128, torch.bfloat16, "cuda", slots,
                                                  KdaConfig(bv, num_warps=warps, wy=True, keys_pass=kp), norm=True,
                                                  v_first=True,
                                                  bound=q if told else None)
    assert rel_err(o_wy.float(), o_plain.float()) < 1e-2
    assert torch.equal(state, inp["state"])


@cpu_interp
def test_verify_env_forces_window_and_wy_where_they_run(monkeypatch):
    """TOKENSPEED_KDA_VERIFY (MULTI_ENV) forces the config of several-token launches only; a forced `wy` runs
    verify windows and falls back to its split form where it cannot (a committing tail, the replay), with the same
    results as the plain launch."""
    from tokenspeed.ops.triton import kda_config as kc
    from tokenspeed.ops.triton import kda_verify_wy

    monkeypatch.setenv(kc.MULTI_ENV, "bv64-split-w4-win")
    assert kc.default_config(32, 128, tokens_per_seq=4) == KdaConfig(64, window=True)
    assert kc.default_config(32, 128) == kc.DECODE_TABLE[1][1]  # one token: the decode table
    monkeypatch.setenv(kc.MULTI_ENV, "bv16-split-w4-wy")
    calls = []
    real = kda_verify_wy._kda_verify_wy_kernel
    monkeypatch.setattr(kda_verify_wy, "_kda_verify_wy_kernel", type("K", (), {
        "__getitem__": lambda self, grid: calls.append(grid) or real[grid]})())
    inp = make([3, 3], 1, 64, torch.float32, "cpu", slots=[1, 4])  # head dim >= 64: below, legacy_config always
    a, p = clone(inp), clone(inp)
    o_env = run_fused(a, -5.0, 0.125, update_state=True)  # a committing tail: wy cannot, split runs
    monkeypatch.delenv(kc.MULTI_ENV)
    o_plain = run_fused(p, -5.0, 0.125, update_state=True)
    assert not calls and torch.equal(o_env, o_plain) and torch.equal(a["state"], p["state"])
    monkeypatch.setenv(kc.MULTI_ENV, "bv16-split-w4-wy")
    a = clone(inp)
    o_wy = run_fused(a, -5.0, 0.125, update_state=False)
    assert len(calls) == 1 and rel_err(o_wy, o_plain) < 1e-5  # the first tail token's outputs are the same
