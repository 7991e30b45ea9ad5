"""Tests of the plain-torch MoE reference: noaux_tc routing and the routed-experts combine.

Scenarios:
* moe_route: the correction bias steers which experts are selected, but the returned weights are the
  un-biased sigmoid scores of the selected experts, renormalised to sum 1 and times routed_scaling_factor;
  the selection is exactly the top-k of score + bias, in descending order; ties go to the lower expert id
  (within the top-k and at its boundary); softmax scoring; renormalize=False; ids in range, unique per token;
  unknown scoring raises.
* moe_experts == a dense formula computed differently (every expert on every token, the activation written
  out by hand, then a one-hot-mask weighted sum) for silu and situ, fp32 rel < 1e-5; expert ids outside
  [0, E) (-1, E) contribute nothing; a token whose ids are all non-local gets zeros; bf16 in -> bf16 out,
  close to fp32, with each expert output rounded to bf16 before the fp32 combine; add=s (the shared experts) is
  the rounded routed sum plus s, rounded again (== `moe_experts(...) + s`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.conftest import rel_err
from tokenspeed.ops import Activation, moe_experts, moe_route

E, K = 8, 3


# --------------------------------------------------------------------------------------------- routing


def check_ids_valid(ids: Tensor, num_experts: int) -> None:
    assert ids.dtype == torch.int64
    assert ((ids >= 0) & (ids < num_experts)).all()
    for row in ids.tolist():
        assert len(set(row)) == len(row), f"duplicate expert in {row}"


def test_route_bias_steers_selection_not_weights() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -2.0, 0.0, 1.5, -0.5]])
    scores = torch.sigmoid(logits)
    _, ids0 = moe_route(logits, None, 2)
    assert ids0.tolist() == [[0, 6]]
    bias = torch.zeros(E)
    bias[4] = 1.0  # sigmoid(-2) + 1 = 1.12 beats everything
    w, ids = moe_route(logits, bias, 2, routed_scaling_factor=2.5)
    assert ids.tolist() == [[4, 0]]
    raw = scores[0, [4, 0]]
    assert torch.allclose(w[0], raw / raw.sum() * 2.5, rtol=1e-6, atol=0)
    assert w.dtype == torch.float32
    assert abs(w.sum().item() - 2.5) < 1e-5
    # A weight is never the biased score.
    assert not torch.allclose(w[0], (raw + bias[[4, 0]]) / (raw + bias[[4, 0]]).sum() * 2.5)


def test_route_selection_is_topk_of_biased_scores() -> None:
    T = 64
    logits = torch.randn(T, E) * 2
    bias = torch.randn(E) * 0.3
    w, ids = moe_route(logits, bias, K, routed_scaling_factor=1.7)
    assert w.shape == (T, K) and ids.shape == (T, K)
    check_ids_valid(ids, E)
    scores = torch.sigmoid(logits)
    choice = scores + bias
    chosen = choice.gather(1, ids)
    # Descending order of selection score.
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()
    # Every selected expert beats every unselected one.
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    worst_chosen = chosen.min(-1).values
    best_other = choice.masked_fill(mask, float("-inf")).max(-1).values
    assert (worst_chosen >= best_other).all()
    # Weights: raw (un-biased) scores, renormalised, scaled.
    raw = scores.gather(1, ids)
    assert torch.allclose(w, raw / raw.sum(-1, keepdim=True) * 1.7, rtol=1e-6, atol=0)
    # The bias actually changed some selections on this data (else the test above proves little).
    _, ids_nobias = moe_route(logits, None, K)
    assert (ids.sort(-1).values != ids_nobias.sort(-1).values).any()


def test_route_ties_prefer_lower_expert_id() -> None:
    logits = torch.tensor(
        [
            [0.0] * E,  # all tied
            [1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 3.0, 2.0],  # four-way tie for the top
            [3.0, 1.0, 1.0, 1.0, 0.0, 1.0, -2.0, 1.0],  # tie at the top-k boundary
        ]
    )
    _, ids = moe_route(logits, None, K)
    assert ids.tolist() == [[0, 1, 2], [1, 2, 4], [0, 1, 2]]
    # Ties created by the bias (different raw scores, equal biased scores) also go to the lower id.
    logits2 = torch.zeros(1, E)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    _, ids2 = moe_route(logits2, bias, 2)
    assert ids2.tolist() == [[5, 6]]


def test_route_softmax_scoring() -> None:
    logits = torch.randn(16, E)
    bias = torch.randn(E) * 0.05
    w, ids = moe_route(logits, bias, K, scoring="softmax", routed_scaling_factor=3.0)
    check_ids_valid(ids, E)
    probs = torch.softmax(logits.double(), -1)
    chosen = (probs + bias.double()).gather(1, ids)
    mask = torch.zeros(16, E, dtype=torch.bool).scatter_(1, ids, True)
    assert (chosen.min(-1).values >= (probs + bias.double()).masked_fill(mask, -1e9).max(-1).values).all()
    raw = probs.gather(1, ids)
    assert torch.allclose(w.double(), raw / raw.sum(-1, keepdim=True) * 3.0, rtol=1e-5, atol=0)
    # Without renormalisation: the softmax probabilities themselves (they sum to < 1 over the top-k).
    w2, ids2 = moe_route(logits, bias, K, scoring="softmax", renormalize=False, routed_scaling_factor=3.0)
    assert torch.equal(ids2, ids)
    assert torch.allclose(w2.double(), raw * 3.0, rtol=1e-5, atol=0)
    assert (w2.sum(-1) < 3.0).all()


def test_route_sigmoid_without_renormalize() -> None:
    logits = torch.randn(10, E)
    w, ids = moe_route(logits, None, K, renormalize=False, routed_scaling_factor=2.0)
    assert torch.allclose(w, torch.sigmoid(logits).gather(1, ids) * 2.0, rtol=1e-6, atol=0)


def test_route_bf16_logits_upcast() -> None:
    logits = torch.randn(12, E).bfloat16()
    w, ids = moe_route(logits, None, K)
    assert w.dtype == torch.float32
    w_ref, ids_ref = moe_route(logits.float(), None, K)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def test_route_unknown_scoring_raises() -> None:
    with pytest.raises(ValueError):
        moe_route(torch.randn(2, E), None, K, scoring="relu")


# --------------------------------------------------------------------------------------------- experts

D, I = 16, 12


def make_experts(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Scaled so that gate pre-activations reach |a| ~ 10: SiTU's tanh cap matters.
    w1 = torch.randn(E, I, D, generator=gen).to(dtype)
    w3 = (torch.randn(E, I, D, generator=gen) * 3).to(dtype)
    w2 = (torch.randn(E, D, I, generator=gen) * I**-0.5).to(dtype)
    return w1, w3, w2


def act_by_hand(a: Tensor, u: Tensor, kind: str) -> Tensor:
    a, u = a.double(), u.double()
    if kind == "silu":
        return a / (1 + torch.exp(-a)) * u
    return 4.0 * torch.tanh(a / 4.0) / (1 + torch.exp(-a)) * 25.0 * torch.tanh(u / 25.0)


def dense_experts(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, kind: str) -> Tensor:
    """All experts on all tokens, then a [T, E] mask of routing weights (slots with non-local ids dropped)."""
    xd = x.double()
    a = torch.einsum("eid,td->eti", w1.double(), xd)
    u = torch.einsum("eid,td->eti", w3.double(), xd)
    h = torch.einsum("edi,eti->etd", w2.double(), act_by_hand(a, u, kind))  # [E, T, D]
    local = (ids >= 0) & (ids < E)
    onehot = F.one_hot(ids.clamp(0, E - 1), E).double() * local[..., None]  # [T, k, E]
    mask = (onehot * weights.double()[..., None]).sum(1)  # [T, E]
    return torch.einsum("te,etd->td", mask, h)


def random_routing(T: int, k: int = K, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen) + 0.1
    return weights, ids


@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_experts_match_dense_formula(kind: str) -> None:
    T = 20
    x = torch.randn(T, D)
    w1, w3, w2 = make_experts()
    weights, ids = random_routing(T)
    got = moe_experts(x, w1, w3, w2, weights, ids, Activation(kind))
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert rel_err(got, dense_experts(x, w1, w3, w2, weights, ids, kind)) < 1e-5


def test_situ_and_silu_experts_differ() -> None:
    """Guard for the test above: the data drives SiTU's caps, so the two activations disagree."""
    x = torch.randn(20, D)
    w1, w3, w2 = make_experts()
    weights, ids = random_routing(20)
    silu = moe_experts(x, w1, w3, w2, weights, ids, Activation("silu"))
    situ = moe_experts(x, w1, w3, w2, weights, ids, Activation("situ"))
    assert rel_err(situ, silu) > 0.05


@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_experts_non_local_ids_contribute_nothing(kind: str) -> None:
    T = 12
    x = torch.randn(T, D)
    w1, w3, w2 = make_experts(seed=1)
    weights, ids = random_routing(T, seed=1)
    ids = ids.clone()
    ids[0, 1] = -1
    ids[3, 0] = E
    ids[5, 2] = E + 7
    ids[7] = torch.tensor([-1, E, -1])  # a token with no local expert
    got = moe_experts(x, w1, w3, w2, weights, ids, Activation(kind))
    assert torch.equal(got[7], torch.zeros(D))
    assert rel_err(got, dense_experts(x, w1, w3, w2, weights, ids, kind)) < 1e-5
    # Same as zeroing the non-local slots' weights and pointing them at any real expert.
    local = (ids >= 0) & (ids < E)
    same = moe_experts(x, w1, w3, w2, weights * local, ids.clamp(0, E - 1), Activation(kind))
    assert rel_err(got, same) < 1e-6


@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_experts_bf16(kind: str) -> None:
    T = 24
    x = torch.randn(T, D).bfloat16()
    w1, w3, w2 = make_experts(torch.bfloat16, seed=2)
    weights, ids = random_routing(T, seed=2)
    got = moe_experts(x, w1, w3, w2, weights, ids, Activation(kind))
    assert got.dtype == torch.bfloat16 and got.shape == (T, D)
    ref = dense_experts(x, w1, w3, w2, weights, ids, kind)
    assert rel_err(got, ref) < 2e-2
    # The combine is fp32 over bf16-rounded expert outputs: compare with that rounding done by hand.
    per_expert = torch.stack(
        [
            moe_experts(x, w1, w3, w2, torch.ones(T, 1), torch.full((T, 1), e), Activation(kind)).float()
            for e in range(E)
        ]
    )  # [E, T, D], each already bf16-rounded
    combined = torch.zeros(T, D)
    for e in range(E):  # fp32 accumulation, expert by expert
        w_e = (weights * (ids == e)).sum(-1, keepdim=True)
        combined += w_e * per_expert[e]
    assert torch.equal(got, combined.bfloat16())
    # Not rounding the expert outputs first gives a (slightly) different answer: the test above can tell.
    unrounded = torch.zeros(T, D)
    for e in range(E):
        xe = x.float()
        a, u = xe @ w1[e].float().t(), xe @ w3[e].float().t()
        h = act_by_hand(a.bfloat16().float(), u.bfloat16().float(), kind).bfloat16().float() @ w2[e].float().t()
        unrounded += (weights * (ids == e)).sum(-1, keepdim=True) * h
    assert rel_err(unrounded, combined) < 2e-2
    assert not torch.equal(unrounded.bfloat16(), got)


@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_experts_add_rounds_twice(kind: str) -> None:
    """add=s (the shared experts' output) is `moe_experts(...) + s`: the routed sum rounded to bf16 first, then the
    add rounded again; one rounding of the fp32 sum plus s is a different function on this data."""
    T = 24
    x = torch.randn(T, D).bfloat16()
    w1, w3, w2 = make_experts(torch.bfloat16, seed=3)
    weights, ids = random_routing(T, seed=3)
    s = (torch.randn(T, D) * 0.3).bfloat16()
    routed = moe_experts(x, w1, w3, w2, weights, ids, Activation(kind))
    got = moe_experts(x, w1, w3, w2, weights, ids, Activation(kind), add=s)
    assert got.dtype == torch.bfloat16 and torch.equal(got, routed + s)
    per_expert = torch.stack([moe_experts(x, w1, w3, w2, torch.ones(T, 1), torch.full((T, 1), e),
                                          Activation(kind)).float() for e in range(E)])
    fp32_sum = torch.zeros(T, D)
    for e in range(E):  # the reference's combine order: expert by expert
        fp32_sum += (weights * (ids == e)).sum(-1, keepdim=True) * per_expert[e]
    assert torch.equal(got, (fp32_sum.bfloat16().float() + s.float()).bfloat16())
    assert not torch.equal(got, (fp32_sum + s.float()).bfloat16())
    with pytest.raises(ValueError, match="add must be"):
        moe_experts(x, w1, w3, w2, weights, ids, Activation(kind), add=s.float())
