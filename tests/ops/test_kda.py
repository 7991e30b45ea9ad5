"""Tests of the plain-torch KDA reference: chunked == recurrent == decode, gates, fla oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tokenspeed.ops.reference.kda import kda_chunk, kda_gate, kda_recurrent, l2_normalize

TOL = 1e-5


def rel_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| / max|b| in fp32 (b is the reference)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def cu_of(lens: list[int]) -> Tensor:
    """cu_seqlens [N+1] int64 for the given sequence lengths."""
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)


def make_inputs(
    lens: list[int],
    H: int = 3,
    K: int = 32,
    V: int = 24,
    lower_bound: float | None = -5.0,
    seed: int = 0,
    f_shift: float = 0.0,
) -> dict:
    """Random, already-normalised KDA inputs for a flat varlen batch, plus a random initial state."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.randn(H, K, generator=gen) * 0.5
    f = torch.randn(T, H, K, generator=gen) + f_shift
    return dict(
        q=l2_normalize(torch.randn(T, H, K, generator=gen)),
        k=l2_normalize(torch.randn(T, H, K, generator=gen)),
        v=torch.randn(T, H, V, generator=gen),
        g=kda_gate(f, A_log, dt_bias, lower_bound),
        beta=torch.sigmoid(torch.randn(T, H, generator=gen)),
        initial_state=torch.randn(len(lens), H, K, V, generator=gen),
        cu_seqlens=cu_of(lens),
        scale=K**-0.5,
    )


def slice_seq(inp: dict, n: int) -> dict:
    """Inputs of sequence n alone (a batch of one)."""
    cu = inp["cu_seqlens"].tolist()
    sl = slice(cu[n], cu[n + 1])
    out = {key: inp[key][sl] for key in ("q", "k", "v", "g", "beta")}
    out.update(
        initial_state=inp["initial_state"][n : n + 1],
        cu_seqlens=cu_of([cu[n + 1] - cu[n]]),
        scale=inp["scale"],
    )
    return out


def decode_token_by_token(inp: dict) -> tuple[Tensor, Tensor]:
    """Batched decode: at step t every sequence still running feeds one token to kda_recurrent."""
    cu = inp["cu_seqlens"].tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    states = inp["initial_state"].float().clone()
    o = torch.zeros_like(inp["v"])
    for t in range(max(lens, default=0)):
        active = [n for n, length in enumerate(lens) if length > t]
        rows = torch.tensor([cu[n] + t for n in active])
        step = {key: inp[key][rows] for key in ("q", "k", "v", "g", "beta")}
        o_t, s_t = kda_recurrent(
            **step,
            scale=inp["scale"],
            initial_state=states[active],
            cu_seqlens=torch.arange(len(active) + 1, dtype=torch.int64),
        )
        o[rows] = o_t
        states[active] = s_t
    return o, states


LENS = [0, 1, 5, 63, 64, 65, 130]


def test_kda_gate_lower_bound_formula() -> None:
    H, K = 3, 8
    f, A_log, dt_bias = torch.randn(5, H, K), torch.randn(H), torch.randn(H, K)
    g = kda_gate(f.bfloat16(), A_log, dt_bias, -5.0)
    x = f.bfloat16().float() + dt_bias
    expected = -5.0 * torch.sigmoid(A_log.exp()[:, None] * x)
    assert g.dtype == torch.float32 and g.shape == (5, H, K)
    torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-6)
    assert (g < 0).all() and (g > -5).all()


def test_kda_gate_softplus_formula() -> None:
    H, K = 3, 8
    f, A_log, dt_bias = torch.randn(5, H, K), torch.randn(H), torch.randn(H, K)
    g = kda_gate(f, A_log, dt_bias, None)
    expected = torch.stack(
        [-math.exp(A_log[h]) * F.softplus(f[:, h] + dt_bias[h]) for h in range(H)], dim=1
    )
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-6)


def test_l2_normalize() -> None:
    x = torch.randn(4, 3, 16).bfloat16()
    y = l2_normalize(x)
    xf = x.float()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunk_matches_recurrent(chunk_size: int, lower_bound: float | None) -> None:
    inp = make_inputs(LENS, lower_bound=lower_bound)
    o_r, s_r = kda_recurrent(**inp)
    o_c, s_c = kda_chunk(**inp, chunk_size=chunk_size)
    assert o_c.shape == o_r.shape == inp["v"].shape
    assert s_c.shape == s_r.shape == inp["initial_state"].shape
    assert rel_err(o_c, o_r) < TOL
    assert rel_err(s_c, s_r) < TOL


def test_zero_initial_state() -> None:
    inp = make_inputs([70, 3])
    inp["initial_state"] = None
    o_r, s_r = kda_recurrent(**inp)
    o_c, s_c = kda_chunk(**inp, chunk_size=32)
    assert rel_err(o_c, o_r) < TOL and rel_err(s_c, s_r) < TOL
    # First token of a fresh sequence: S = beta k v^T, o = beta (scale q . k) v.
    q, k, v, b = inp["q"][0], inp["k"][0], inp["v"][0], inp["beta"][0]
    expected = (b * inp["scale"] * (q * k).sum(-1))[:, None] * v
    torch.testing.assert_close(o_r[0], expected, rtol=1e-5, atol=1e-6)


def test_decode_matches_recurrent_and_chunk() -> None:
    inp = make_inputs(LENS, seed=1)
    o_d, s_d = decode_token_by_token(inp)
    o_r, s_r = kda_recurrent(**inp)
    o_c, s_c = kda_chunk(**inp)
    assert rel_err(o_d, o_r) < TOL and rel_err(s_d, s_r) < TOL
    assert rel_err(o_d, o_c) < TOL and rel_err(s_d, s_c) < TOL


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_batch_equals_solo(form: str) -> None:
    fn = kda_recurrent if form == "recurrent" else kda_chunk
    inp = make_inputs(LENS, seed=2)
    o, s = fn(**inp)
    cu = inp["cu_seqlens"].tolist()
    for n in range(len(LENS)):
        o_n, s_n = fn(**slice_seq(inp, n))
        torch.testing.assert_close(o[cu[n] : cu[n + 1]], o_n, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s[n : n + 1], s_n, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_zero_length_passes_state_and_inputs_untouched(form: str) -> None:
    fn = kda_recurrent if form == "recurrent" else kda_chunk
    inp = make_inputs([0, 4, 0], seed=3)
    s0 = inp["initial_state"].clone()
    _, s = fn(**inp)
    assert torch.equal(inp["initial_state"], s0)  # not mutated
    assert torch.equal(s[0], s0[0]) and torch.equal(s[2], s0[2])
    assert not torch.equal(s[1], s0[1])
    # Entirely empty batch.
    empty = make_inputs([0, 0], seed=3)
    o_e, s_e = fn(**empty)
    assert o_e.shape[0] == 0 and torch.equal(s_e, empty["initial_state"])


def test_output_dtype_follows_v() -> None:
    inp = make_inputs([10, 70], seed=4)
    inp["v"] = inp["v"].bfloat16()
    for fn in (kda_recurrent, kda_chunk):
        o, s = fn(**inp)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_strong_decay_k3_gate() -> None:
    """lower_bound -5 with f large: g ~ -5 on every channel, Gamma ~ -320 over a 64 chunk."""
    inp = make_inputs([64, 150, 1], seed=5, f_shift=100.0)
    g = inp["g"]
    assert g.max() < -4.99
    assert g[:64].sum(0).min() < -319.0  # Gamma at the end of the first chunk
    o_r, s_r = kda_recurrent(**inp)
    o_c, s_c = kda_chunk(**inp, chunk_size=64)
    for x in (o_r, s_r, o_c, s_c):
        assert torch.isfinite(x).all()
    assert rel_err(o_c, o_r) < TOL and rel_err(s_c, s_r) < TOL


# ----------------------------------------------------------------------------- fla oracle


def _to_fla(inp: dict, B: int) -> dict:
    """Equal-length flat batch -> fla's [B, T, H, *] layout and [B, H, K, V] state."""
    return dict(
        q=inp["q"].unflatten(0, (B, -1)),
        k=inp["k"].unflatten(0, (B, -1)),
        v=inp["v"].unflatten(0, (B, -1)),
        g=inp["g"].unflatten(0, (B, -1)),
        beta=inp["beta"].unflatten(0, (B, -1)),
        scale=inp["scale"],
        initial_state=inp["initial_state"].clone(),
        output_final_state=True,
    )


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_against_fla_naive_recurrent(lower_bound: float | None) -> None:
    naive = pytest.importorskip("fla.ops.kda.naive")
    inp = make_inputs([37, 37], seed=6, lower_bound=lower_bound)
    o_ref, s_ref = naive.naive_recurrent_kda(**_to_fla(inp, 2))
    o, s = kda_recurrent(**inp)
    assert rel_err(o, o_ref.flatten(0, 1)) < TOL and rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("f_shift", [0.0, 100.0])
def test_against_fla_naive_chunk(f_shift: float) -> None:
    naive = pytest.importorskip("fla.ops.kda.naive")
    inp = make_inputs([128, 128], seed=7, f_shift=f_shift)
    o_ref, s_ref = naive.naive_chunk_kda(**_to_fla(inp, 2), chunk_size=64)
    o, s = kda_chunk(**inp, chunk_size=64)
    assert torch.isfinite(o_ref).all()
    assert rel_err(o, o_ref.flatten(0, 1)) < TOL and rel_err(s, s_ref) < TOL
