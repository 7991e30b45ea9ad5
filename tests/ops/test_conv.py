"""Tests of the plain-torch causal depthwise conv1d with carried state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tokenspeed.ops.reference.conv import causal_conv1d

C, W = 12, 4


def rel_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| / max|b| in fp32 (b is the reference)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def cu_of(lens: list[int]) -> Tensor:
    """cu_seqlens [N+1] int64 for the given sequence lengths."""
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)


def torch_conv(x: Tensor, weight: Tensor, activation: str | None) -> Tensor:
    """Oracle: depthwise F.conv1d of one sequence [T, C] with W-1 zeros of left padding."""
    xp = F.pad(x.float().T[None], (weight.shape[1] - 1, 0))  # [1, C, W-1+T]
    y = F.conv1d(xp, weight.float()[:, None, :], groups=x.shape[1])[0].T
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", ["silu", None])
def test_fresh_state_matches_torch_conv1d(activation: str | None) -> None:
    x, weight = torch.randn(20, C), torch.randn(C, W)
    state = torch.zeros(1, C, W - 1)
    y = causal_conv1d(x, weight, state, torch.tensor([0]), cu_of([20]), activation)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, torch_conv(x, weight, activation)) < 1e-6
    torch.testing.assert_close(state[0], x[-(W - 1) :].T)  # last W-1 inputs, most recent last


def test_prefix_then_continuation_equals_full() -> None:
    x, weight = torch.randn(30, C), torch.randn(C, W)
    full = torch_conv(x, weight, "silu")
    state = torch.zeros(2, C, W - 1)
    slot = torch.tensor([1])
    y1 = causal_conv1d(x[:11], weight, state, slot, cu_of([11]))
    y2 = causal_conv1d(x[11:12], weight, state, slot, cu_of([1]))  # a decode step
    y3 = causal_conv1d(x[12:], weight, state, slot, cu_of([18]))
    assert rel_err(torch.cat([y1, y2, y3]), full) < 1e-6
    torch.testing.assert_close(state[1], x[-(W - 1) :].T)
    assert torch.equal(state[0], torch.zeros(C, W - 1))


def test_varlen_scattered_slots_and_other_slots_untouched() -> None:
    lens, slots = [9, 0, 1, 2, 25], [6, 0, 3, 1, 4]
    prefixes = [torch.randn(5, C) for _ in lens]  # history already consumed by each sequence
    news = [torch.randn(n, C) for n in lens]
    weight = torch.randn(C, W)
    state = torch.randn(8, C, W - 1)
    for p, s in zip(prefixes, slots):
        state[s] = p[-(W - 1) :].T
    before = state.clone()

    y = causal_conv1d(torch.cat(news), weight, state, torch.tensor(slots), cu_of(lens))

    cu = cu_of(lens).tolist()
    for n, (p, new, s) in enumerate(zip(prefixes, news, slots)):
        seq = torch.cat([p, new])
        expected_y = torch_conv(seq, weight, "silu")[len(p) :]
        torch.testing.assert_close(y[cu[n] : cu[n + 1]], expected_y, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[s], seq[-(W - 1) :].T)
    untouched = [i for i in range(8) if i not in slots]
    assert torch.equal(state[untouched], before[untouched])
    assert torch.equal(state[0], before[0])  # zero-length sequence keeps its state


@pytest.mark.parametrize("length", [1, 2])
def test_short_sequence_shifts_state(length: int) -> None:
    """A sequence shorter than W-1 keeps the newest W-1 of [old state, new tokens]."""
    weight = torch.randn(C, W)
    old = torch.randn(1, C, W - 1)
    state = old.clone()
    x = torch.randn(length, C)
    causal_conv1d(x, weight, state, torch.tensor([0]), cu_of([length]))
    expected = torch.cat([old[0], x.T], dim=1)[:, -(W - 1) :]
    torch.testing.assert_close(state[0], expected)
    assert torch.equal(state[0, :, : W - 1 - length], old[0, :, length:])


def test_bf16_dtypes() -> None:
    x, weight = torch.randn(7, C).bfloat16(), torch.randn(C, W)
    state = torch.zeros(1, C, W - 1, dtype=torch.bfloat16)
    y = causal_conv1d(x, weight, state, torch.tensor([0]), cu_of([7]))
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    torch.testing.assert_close(y, torch_conv(x, weight, "silu").bfloat16())
    assert torch.equal(state[0], x[-(W - 1) :].T)


def test_unknown_activation_raises() -> None:
    x, weight, state = torch.randn(3, C), torch.randn(C, W), torch.zeros(1, C, W - 1)
    with pytest.raises(ValueError):
        causal_conv1d(x, weight, state, torch.tensor([0]), cu_of([3]), activation="gelu")
    assert torch.equal(state, torch.zeros(1, C, W - 1))
