"""Tests of rotary position embedding (interleaved pairs) and DeepSeek-style YaRN scaling.

Scenarios:
* default RoPE: pair i of a vector at position p is rotated by p * theta^(-2i/dim) (explicit 2x2 rotation of
  (x[2i], x[2i+1])); <R_m q, R_n k> depends only on m - n; rotation preserves the norm; position 0 is the
  identity; bf16 in, bf16 out.
* yarn: factor 1 equals default RoPE; with factor 8 the highest-frequency pair is unchanged (up to the
  magnitude) and the lowest-frequency one is interpolated (angle / factor); the magnitude
  yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim) multiplies cos and sin (1 when the two mscales are
  equal); "type" and "rope_type" keys are both read; yarn_mscale(1, x) == 1 and equals 0.1 x ln f + 1 above 1.
* an unknown rope type raises ValueError.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import rel_err
from tokenspeed.ops import apply_rope, rope_cos_sin, yarn_mscale

DIM, THETA = 32, 10000.0


def rotate(x: torch.Tensor, positions: torch.Tensor, scaling: dict | None = None) -> torch.Tensor:
    cos, sin = rope_cos_sin(positions, DIM, THETA, scaling)
    return apply_rope(x, cos, sin)


def test_explicit_rotation_of_interleaved_pairs() -> None:
    positions = torch.tensor([0, 1, 7, 300])
    x = torch.randn(4, 2, DIM)
    got = rotate(x, positions).double()
    ref = torch.empty_like(got)
    for t, p in enumerate(positions.tolist()):
        for i in range(DIM // 2):
            ang = p * THETA ** (-2 * i / DIM)
            c, s = math.cos(ang), math.sin(ang)
            x0, x1 = x[t, :, 2 * i].double(), x[t, :, 2 * i + 1].double()
            ref[t, :, 2 * i] = x0 * c - x1 * s
            ref[t, :, 2 * i + 1] = x0 * s + x1 * c
    assert rel_err(got, ref) < 1e-6


def test_score_depends_only_on_relative_position() -> None:
    q, k = torch.randn(1, 4, DIM), torch.randn(1, 4, DIM)

    def score(m: int, n: int) -> torch.Tensor:
        qm = rotate(q, torch.tensor([m]))
        kn = rotate(k, torch.tensor([n]))
        return (qm.double() * kn.double()).sum(-1)  # [1, H]

    base = score(5, 2)
    for m, n in [(3, 0), (13, 10), (103, 100), (1003, 1000)]:
        assert rel_err(score(m, n), base) < 1e-5
    assert rel_err(score(2, 5), base) > 1e-2  # the sign of the offset matters
    assert rel_err(score(9, 2), base) > 1e-2


def test_rotation_preserves_norm_and_position_zero_is_identity() -> None:
    x = torch.randn(6, 3, DIM)
    y = rotate(x, torch.tensor([0, 1, 2, 50, 4095, 100000]))
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    # Each pair keeps its own norm too.
    assert torch.allclose(
        y.unflatten(-1, (-1, 2)).norm(dim=-1), x.unflatten(-1, (-1, 2)).norm(dim=-1), rtol=1e-5, atol=1e-6
    )
    assert torch.equal(y[0], x[0])


def test_cos_sin_shape_and_bf16() -> None:
    cos, sin = rope_cos_sin(torch.arange(5), DIM, THETA)
    assert cos.shape == (5, DIM // 2) and sin.shape == (5, DIM // 2) and cos.dtype == torch.float32
    x = torch.randn(5, 2, DIM).bfloat16()
    y = apply_rope(x, cos, sin)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, apply_rope(x.float(), cos, sin)) < 2**-8


YARN = {
    "type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}


def test_yarn_factor_one_is_default() -> None:
    pos = torch.tensor([0, 3, 1000, 5000])
    cos_d, sin_d = rope_cos_sin(pos, DIM, THETA)
    cos_y, sin_y = rope_cos_sin(pos, DIM, THETA, {**YARN, "factor": 1.0})
    assert torch.allclose(cos_y, cos_d, atol=1e-6, rtol=0) and torch.allclose(sin_y, sin_d, atol=1e-6, rtol=0)


def test_yarn_keeps_high_frequencies_and_interpolates_low_ones() -> None:
    factor = YARN["factor"]
    mag = yarn_mscale(factor, 1.0) / yarn_mscale(factor, 0.0)
    pos = torch.tensor([1, 17, 900, 3000])
    cos_d, sin_d = rope_cos_sin(pos, DIM, THETA)
    cos_y, sin_y = rope_cos_sin(pos, DIM, THETA, YARN)
    # Highest frequency (pair 0: many rotations within the original window): extrapolated, i.e. unchanged.
    assert torch.allclose(cos_y[:, 0] / mag, cos_d[:, 0], atol=1e-5, rtol=0)
    assert torch.allclose(sin_y[:, 0] / mag, sin_d[:, 0], atol=1e-5, rtol=0)
    # Lowest frequency (last pair: less than one rotation over the window): interpolated by the factor.
    low_freq = THETA ** (-2 * (DIM // 2 - 1) / DIM) / factor
    ang = pos.double() * low_freq
    assert torch.allclose(cos_y[:, -1].double() / mag, ang.cos(), atol=1e-5, rtol=0)
    assert torch.allclose(sin_y[:, -1].double() / mag, ang.sin(), atol=1e-5, rtol=0)
    # So the low pair really changed.
    assert (sin_y[1:, -1] / mag - sin_d[1:, -1]).abs().max() > 1e-3
    # Every yarn frequency lies between the interpolated and the extrapolated one.
    p1 = torch.tensor([1])
    ang_y = torch.atan2(*reversed(rope_cos_sin(p1, DIM, THETA, YARN)))[0].double()
    ang_d = torch.atan2(*reversed(rope_cos_sin(p1, DIM, THETA)))[0].double()
    assert ((ang_y <= ang_d + 1e-6) & (ang_y >= ang_d / factor - 1e-6)).all()
    # The YaRN split by wavelength: pairs that turn more than beta_fast times within the original window keep
    # their frequency, pairs that turn fewer than beta_slow times are interpolated, the rest lie strictly between.
    rotations = YARN["original_max_position_embeddings"] * ang_d / (2 * math.pi)
    fast, slow = rotations > YARN["beta_fast"], rotations < YARN["beta_slow"]
    mid = ~fast & ~slow
    assert fast.sum() >= 3 and slow.sum() >= 2 and mid.sum() >= 3  # DIM = 32 has all three kinds
    assert torch.allclose(ang_y[fast], ang_d[fast], rtol=1e-6, atol=0)
    assert torch.allclose(ang_y[slow], ang_d[slow] / factor, rtol=1e-6, atol=0)
    assert ((ang_y[mid] < ang_d[mid] * (1 - 1e-4)) & (ang_y[mid] > ang_d[mid] / factor * (1 + 1e-4))).all()


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 0.0), (0.707, 0.707), (1.0, 0.5)])
def test_yarn_magnitude(mscale: float, mscale_all_dim: float) -> None:
    factor = 40.0
    scaling = {**YARN, "factor": factor, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 77]), DIM, THETA, scaling)
    mag = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    expected = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
    assert abs(mag - expected) < 1e-12
    assert torch.allclose(
        (cos.double() ** 2 + sin.double() ** 2).sqrt(),
        torch.full(cos.shape, mag, dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    assert torch.allclose(cos[0], torch.full((DIM // 2,), mag, dtype=torch.float32), rtol=1e-6, atol=0)
    # The rotation scales vectors by the magnitude.
    x = torch.randn(3, 2, DIM)
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1) * mag, rtol=1e-5, atol=0)


def test_yarn_mscale() -> None:
    for x in (0.0, 0.5, 1.0, 0.707):
        assert yarn_mscale(1.0, x) == 1.0
        assert yarn_mscale(0.5, x) == 1.0
    assert abs(yarn_mscale(40.0, 1.0) - (0.1 * math.log(40.0) + 1.0)) < 1e-12
    assert abs(yarn_mscale(4.0, 0.707) - (0.0707 * math.log(4.0) + 1.0)) < 1e-12


def test_rope_type_key_spellings() -> None:
    pos = torch.tensor([3, 2000])
    by_type = rope_cos_sin(pos, DIM, THETA, YARN)
    by_rope_type = rope_cos_sin(
        pos, DIM, THETA, {**{k: v for k, v in YARN.items() if k != "type"}, "rope_type": "yarn"}
    )
    assert torch.equal(by_type[0], by_rope_type[0]) and torch.equal(by_type[1], by_rope_type[1])
    default_explicit = rope_cos_sin(pos, DIM, THETA, {"rope_type": "default"})
    default_none = rope_cos_sin(pos, DIM, THETA, None)
    assert torch.equal(default_explicit[0], default_none[0]) and torch.equal(default_explicit[1], default_none[1])


@pytest.mark.parametrize(
    "scaling", [{"type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "llama3"}]
)
def test_unknown_rope_type_raises(scaling: dict) -> None:
    with pytest.raises(ValueError):
        rope_cos_sin(torch.arange(3), DIM, THETA, scaling)
