"""Tests of the Block Attention Residuals depth mix (k3-architecture.md §2.3).

Scenarios:
* attn_res_mix == softmax_i( RMSNorm_gamma(v_i) . w ) weighted sum of the raw v_i, written from the paper
  definition in fp64 with separate gain gamma and projection w (the op takes the folded query gamma * w),
  for n = 1..8 snapshots plus the partial sum; candidates of very different scales so the RMS
  normalisation of the keys (and not of the values) matters.
* n identical candidates mix to that candidate; scaling a candidate by c > 0 leaves its weight unchanged.
* 0 snapshots: the partial is returned unchanged (mix of one candidate is the identity), any dtype.
* attn_res_mix_rms_norm == rms_norm(attn_res_mix(...)), bitwise, bf16 and fp32, with and without snapshots.
* dtype follows the partial: bf16 in, bf16 out, close to the fp32 math of the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.conftest import rel_err
from tokenspeed.ops import attn_res_mix, attn_res_mix_rms_norm, rms_norm

T, D, EPS = 5, 32, 1e-5


def paper_mix(blocks: Tensor, partial: Tensor, gamma: Tensor, w: Tensor, eps: float) -> Tensor:
    """softmax over candidates of (RMSNorm_gamma(v_i) . w), then sum_i alpha_i v_i, fp64."""
    cands = [b.double() for b in blocks] + [partial.double()]
    logits = []
    for v in cands:
        normed = gamma.double() * v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
        logits.append((normed * w.double()).sum(-1))  # [T]
    z = torch.stack(logits)  # [n+1, T]
    alpha = torch.exp(z - z.max(0).values) / torch.exp(z - z.max(0).values).sum(0)
    return sum(alpha[i][:, None] * cands[i] for i in range(len(cands)))


def make(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1, n + 1)[torch.randperm(n + 1, generator=gen)]
    blocks = (torch.randn(n, T, D, generator=gen) * scales[:n, None, None]).to(dtype)
    partial = (torch.randn(T, D, generator=gen) * scales[n]).to(dtype)
    gamma = torch.rand(D, generator=gen) + 0.5
    w = torch.randn(D, generator=gen) * 0.4
    return blocks, partial, gamma, w


@pytest.mark.parametrize("n", range(1, 9))
def test_mix_matches_paper_definition(n: int) -> None:
    blocks, partial, gamma, w = make(n, seed=n)
    got = attn_res_mix(blocks, partial, (gamma * w).float(), EPS)
    ref = paper_mix(blocks, partial, gamma, w, EPS)
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-5


def test_mix_is_not_trivial() -> None:
    """Guard: on this data the mix differs from a plain mean and from the partial, so the test above bites."""
    blocks, partial, gamma, w = make(4)
    got = attn_res_mix(blocks, partial, gamma * w, EPS)
    assert rel_err(got, partial) > 0.1
    assert rel_err(got, torch.cat([blocks, partial[None]]).mean(0)) > 0.1
    # The keys are RMS-normed: mixing with un-normed logits gives another answer.
    cands = torch.cat([blocks, partial[None]]).double()
    alpha = torch.softmax(cands @ (gamma * w).double(), 0)
    assert rel_err(got, (alpha[..., None] * cands).sum(0)) > 0.1


def test_mix_of_identical_candidates_is_that_candidate() -> None:
    v = torch.randn(T, D)
    got = attn_res_mix(v.expand(3, T, D).clone(), v, torch.randn(D), EPS)
    assert rel_err(got, v) < 1e-6


def test_key_is_scale_invariant() -> None:
    """z_i uses RMSNorm(v_i): scaling a snapshot by c > 0 keeps its weight, so its contribution scales by c."""
    blocks, partial, gamma, w = make(2, seed=3)
    q = gamma * w
    # Use large-norm rows so eps is negligible.
    blocks, partial = blocks * 10, partial * 10
    base = attn_res_mix(blocks, partial, q, EPS)
    scaled = blocks.clone()
    scaled[0] *= 3.0
    got = attn_res_mix(scaled, partial, q, EPS)
    # alpha unchanged => got - base = alpha_0 * 2 * b_0; recover alpha_0 from that and check it is in (0, 1).
    delta = got - base
    alpha0 = (delta * blocks[0]).sum(-1) / (2 * (blocks[0] * blocks[0]).sum(-1))
    assert rel_err(delta, 2 * alpha0[:, None] * blocks[0]) < 1e-4
    assert ((alpha0 > 0) & (alpha0 < 1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_snapshots_returns_partial(dtype: torch.dtype) -> None:
    partial = torch.randn(T, D).to(dtype)
    got = attn_res_mix(torch.empty(0, T, D, dtype=dtype), partial, torch.randn(D), EPS)
    assert got.dtype == dtype
    assert torch.equal(got, partial)


@pytest.mark.parametrize("n", [0, 1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_rms_norm_is_norm_of_mix(n: int, dtype: torch.dtype) -> None:
    blocks, partial, gamma, w = make(n, dtype, seed=10 + n)
    norm_w = (torch.rand(D) + 0.5).to(dtype)
    got = attn_res_mix_rms_norm(blocks, partial, gamma * w, EPS, norm_w, 1e-6)
    assert got.dtype == dtype
    assert torch.equal(got, rms_norm(attn_res_mix(blocks, partial, gamma * w, EPS), norm_w, 1e-6))


@pytest.mark.parametrize("n", [1, 7])
def test_bf16_in_bf16_out(n: int) -> None:
    blocks, partial, gamma, w = make(n, torch.bfloat16, seed=20 + n)
    got = attn_res_mix(blocks, partial, (gamma * w).float(), EPS)
    assert got.dtype == torch.bfloat16 and got.shape == (T, D)
    # The math runs in fp32 on the bf16 values and rounds once at the end.
    ref = paper_mix(blocks, partial, gamma, w, EPS)
    assert rel_err(got, ref) < 2**-8
