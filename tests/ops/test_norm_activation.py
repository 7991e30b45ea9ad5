"""Tests of RMSNorm variants and the gated activations (k3-architecture.md §2.1, §2.6).

Scenarios:
* rms_norm == w * x / sqrt(mean(x^2) + eps) in fp32 (fp64 oracle); eps keeps an all-zero row finite.
* rms_norm bf16 rounding point: the result equals bf16(w * bf16(normalised)) bit for bit (the gain multiplies
  after the downcast), and on the same data the single-rounding variant differs, so the check can fail.
* gated_rms_norm == rms(x) * w * sigmoid(g), weight shared over heads, fp32 inside, output in x.dtype.
* SiTU == beta*tanh(a/beta)*sigmoid(a) * lin*tanh(u/lin) (defaults 4, 25, and custom values); ~ silu(a)*u for
  small |a|, |u|; saturation: gate branch -> beta as a -> +inf and -> 0 as a -> -inf, up branch clipped to
  +-lin; |SiTU| <= beta * lin everywhere.
* silu kind == silu(a)*u; bf16 in, bf16 out; an unknown activation kind raises ValueError.
* gated_activation_merged(gate_up) == gated_activation of its two halves, bit for bit; an odd width raises.
* add_rms_norm(x, r) == (rms_norm(r + x), r + x) bit for bit in bf16 (the residual junction it replaces), and the
  norm of the unrounded fp32 sum differs on the same data.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import rel_err
from tokenspeed.ops import (
    Activation,
    add_rms_norm,
    gated_activation,
    gated_activation_merged,
    gated_rms_norm,
    rms_norm,
)

# --------------------------------------------------------------------------------------------- RMSNorm


def test_rms_norm_formula_fp32() -> None:
    x = torch.randn(6, 4, 48) * 3
    w = torch.rand(48) + 0.5
    got = rms_norm(x, w, 1e-5)
    xd = x.double()
    ref = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-6


def test_rms_norm_eps_matters_and_zero_row_is_finite() -> None:
    x = torch.randn(3, 16) * 1e-3  # mean(x^2) ~ 1e-6, comparable to eps
    x[1] = 0
    w = torch.ones(16)
    got = rms_norm(x, w, 1e-5)
    assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros(16))
    xd = x.double()
    assert rel_err(got, xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)) < 1e-6
    assert rel_err(got, rms_norm(x, w, 1e-6)) > 0.1


def test_rms_norm_bf16_gain_after_downcast() -> None:
    x = (torch.randn(64, 128) * 2).bfloat16()
    w = (torch.rand(128) * 2 + 0.1).bfloat16()
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    two_roundings = (w.float() * normed.float()).bfloat16()
    assert torch.equal(got, two_roundings)
    # The other rounding point (gain in fp32, one rounding) disagrees somewhere on this data.
    one_rounding = (w.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert not torch.equal(got, one_rounding)


def test_gated_rms_norm() -> None:
    x = torch.randn(7, 3, 32) * 2
    g = torch.randn(7, 3, 32) * 3
    w = torch.rand(32) + 0.5
    got = gated_rms_norm(x, g, w, 1e-5)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double() * torch.sigmoid(g.double())
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-6
    # bf16 in -> bf16 out, from the fp32 math of the bf16 values.
    got16 = gated_rms_norm(x.bfloat16(), g.bfloat16(), w, 1e-5)
    assert got16.dtype == torch.bfloat16
    xd16 = x.bfloat16().double()
    ref16 = xd16 / torch.sqrt(xd16.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    ref16 = ref16 * torch.sigmoid(g.bfloat16().double())
    assert rel_err(got16, ref16) < 2**-8


# --------------------------------------------------------------------------------------------- activations


def situ_formula(a: torch.Tensor, u: torch.Tensor, beta: float = 4.0, lin: float = 25.0) -> torch.Tensor:
    a, u = a.double(), u.double()
    return beta * torch.tanh(a / beta) * torch.sigmoid(a) * lin * torch.tanh(u / lin)


@pytest.mark.parametrize("beta,lin", [(4.0, 25.0), (2.0, 3.0)])
def test_situ_formula(beta: float, lin: float) -> None:
    a = torch.randn(200) * 8
    u = torch.randn(200) * 40
    # (4, 25) goes through the defaults: K3's SiTU constants.
    act = Activation("situ") if (beta, lin) == (4.0, 25.0) else Activation("situ", beta=beta, linear_beta=lin)
    got = gated_activation(a, u, act)
    assert got.dtype == torch.float32 and got.shape == a.shape
    assert rel_err(got, situ_formula(a, u, beta, lin)) < 1e-6


def test_situ_close_to_swiglu_for_small_inputs() -> None:
    # beta*tanh(a/beta) = a (1 - a^2/(3 beta^2) + ...): |a| < 0.5 -> < 0.6% off; |u| < 2 -> < 0.3% off.
    a = (torch.rand(500) - 0.5) * 1.0
    u = (torch.rand(500) - 0.5) * 4.0
    got = gated_activation(a, u, Activation("situ")).double()
    swiglu = F.silu(a.double()) * u.double()
    assert ((got - swiglu).abs() <= 1e-2 * swiglu.abs() + 1e-12).all()
    # ... and clearly not for large ones.
    big = torch.tensor([8.0])
    assert gated_activation(big, big, Activation("situ")).item() < 0.6 * (F.silu(big) * big).item()


def test_situ_saturation() -> None:
    act = Activation("situ")
    one = torch.tensor([1.0])
    # Gate branch (u fixed at a value where the up branch is ~ linear): -> 4 as a -> +inf, -> 0 as a -> -inf.
    up1 = 25 * torch.tanh(one / 25)
    for a in (30.0, 100.0, 1e4):
        assert abs(gated_activation(torch.tensor([a]), one, act).item() / up1.item() - 4.0) < 1e-5
    for a in (-30.0, -100.0, -1e4):
        assert abs(gated_activation(torch.tensor([a]), one, act).item()) < 1e-10
    # Up branch clipped to +-25 (gate branch fixed at a = 30, i.e. ~4).
    g = torch.full((4,), 30.0)
    got = gated_activation(g, torch.tensor([200.0, 1e4, -200.0, -1e4]), act)
    assert torch.allclose(got, torch.tensor([100.0, 100.0, -100.0, -100.0]), rtol=1e-5, atol=0)
    # Bounded everywhere by beta * linear_beta; gate branch bounded below by its minimum (~ -0.8).
    a = torch.linspace(-60, 60, 2001)
    u = torch.linspace(-1e3, 1e3, 2001)
    out = gated_activation(a[:, None].expand(-1, 2001), u[None, :].expand(2001, -1), act)
    assert out.abs().max().item() <= 100.0 + 1e-4
    gate_branch = gated_activation(a, torch.full_like(a, 1e4), act) / 25.0
    assert gate_branch.min().item() > -1.0 and gate_branch.max().item() <= 4.0 + 1e-6


def test_situ_custom_caps() -> None:
    act = Activation("situ", beta=2.0, linear_beta=3.0)
    got = gated_activation(torch.tensor([50.0, 50.0]), torch.tensor([1e3, -1e3]), act)
    assert torch.allclose(got, torch.tensor([6.0, -6.0]), rtol=1e-5, atol=0)


def test_silu_kind() -> None:
    a, u = torch.randn(100) * 4, torch.randn(100) * 4
    got = gated_activation(a, u, Activation("silu"))
    assert rel_err(got, F.silu(a.double()) * u.double()) < 1e-6
    assert gated_activation(a, u, Activation()).equal(got)  # silu is the default


@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_activation_bf16(kind: str) -> None:
    a, u = (torch.randn(64) * 6).bfloat16(), (torch.randn(64) * 30).bfloat16()
    got = gated_activation(a, u, Activation(kind))
    assert got.dtype == torch.bfloat16
    ref = situ_formula(a, u) if kind == "situ" else F.silu(a.double()) * u.double()
    assert ((got.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-30).all()  # one rounding of the fp32 result


@pytest.mark.parametrize("kind", ["gelu", "relu", "SiLU", ""])
def test_unknown_activation_raises(kind: str) -> None:
    with pytest.raises(ValueError):
        gated_activation(torch.randn(4), torch.randn(4), Activation(kind))


@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_merged_equals_halves(kind: str) -> None:
    gu = (torch.randn(9, 2, 2 * 40) * 5).bfloat16()
    got = gated_activation_merged(gu, Activation(kind))
    assert got.shape == (9, 2, 40) and got.dtype == torch.bfloat16
    assert torch.equal(got, gated_activation(gu[..., :40], gu[..., 40:], Activation(kind)))
    with pytest.raises(ValueError, match="even"):
        gated_activation_merged(gu[..., :-1], Activation(kind))


# --------------------------------------------------------------------------------------------- residual junction


def test_add_rms_norm_is_the_junction_bf16() -> None:
    x = (torch.randn(33, 96) * 2).bfloat16()
    r = (torch.randn(33, 96) * 3).bfloat16()
    w = (torch.rand(96) * 2 + 0.1).bfloat16()
    normed, summed = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, r + x) and torch.equal(normed, rms_norm(r + x, w, 1e-6))
    s32 = r.float() + x.float()  # the fusion done wrong: the norm of the unrounded sum
    wrong = (w.float() * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float())
    assert not torch.equal(normed, wrong.bfloat16())
    assert summed.data_ptr() not in (x.data_ptr(), r.data_ptr())  # inputs untouched, new tensors out
