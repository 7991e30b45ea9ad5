"""Triton MoE router (sigmoid / softmax, bias-corrected top-k, renormalise) against the torch reference.

Ids must match exactly except where two selection scores are within 1e-6 (two fp32 sigmoids may differ in the
last bit there); weights within 1e-5 relative (they are fp32 whatever the logits' dtype). Exact ties go to the
lower expert id. Outputs start poisoned.
shared_expert_id (a shared expert folded in as an always-selected expert): the extra column is (id, 1.0) under
every scoring / renormalisation / scaling, the routed k columns equal the plain route's bit for bit and the
reference `with_shared_expert` of the reference route; ids below E and an `out` without the extra column are
rejected; the fold end to end (route with the shared id, experts stacked [E + 1, ...]) equals the routed experts
with the shared expert's output added.
"""

from __future__ import annotations


import pytest
import torch

from tests.ops.triton_env import cpu_interp, needs_cuda  # noqa: E402,F401 - sets up Triton first

from tokenspeed.ops.reference.moe import moe_route as ref_route  # noqa: E402



def route(logits, bias, k, **kw):
    from tokenspeed.ops.triton.moe_route import moe_route

    T = logits.shape[0]
    w = torch.full((T, k), float("nan"), device=logits.device)
    ids = torch.full((T, k), -7, dtype=torch.int64, device=logits.device)
    out = moe_route(logits, bias, k, out=(w, ids), **kw)
    assert out[0] is w and out[1] is ids
    return w, ids


def check(T, E, k, dtype, device, scoring="sigmoid", bias=True, scale=1.0, renormalize=True):
    logits = (torch.randn(T, E, device=device) * 2).to(dtype)
    b = torch.randn(E, device=device) * 0.1 if bias else None
    kw = dict(scoring=scoring, renormalize=renormalize, routed_scaling_factor=scale)
    w, ids = route(logits, b, k, **kw)
    w_ref, ids_ref = ref_route(logits, b, k, **kw)
    assert not torch.isnan(w).any() and bool((ids >= 0).all()) and bool((ids < E).all())
    lf = logits.float()
    scores = torch.sigmoid(lf) if scoring == "sigmoid" else torch.softmax(lf, -1)
    choice = scores + (b if bias else 0)
    # Same selection scores in the same order (ids may differ only between near-equal scores).
    assert torch.allclose(choice.gather(1, ids), choice.gather(1, ids_ref), atol=1e-6, rtol=0)
    same = (ids == ids_ref).all(1)
    assert same.double().mean().item() >= 0.99
    err = ((w[same] - w_ref[same]).abs().max() / w_ref[same].abs().max()).item() if same.any() else 0.0
    assert err < 1e-5, err


@cpu_interp
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("T,E,k", [(3, 40, 5), (2, 256, 8), (1, 7, 7)])
def test_route_interp(T, E, k, scoring):
    check(T, E, k, torch.float32, "cpu", scoring=scoring, scale=2.446)


@cpu_interp
def test_route_interp_no_bias_no_renorm():
    check(4, 33, 3, torch.float32, "cpu", bias=False, renormalize=False)


@cpu_interp
def test_route_interp_ties_to_lower_id():
    logits = torch.zeros(2, 16)
    logits[1, 9] = logits[1, 3] = 1.0
    w, ids = route(logits, None, 4)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [3, 9, 0, 1]
    assert torch.allclose(w.sum(1), torch.ones(2))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 64, 4099])
def test_route_k3_gpu(T, dtype):
    check(T, 896, 16, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("T,E,k", [(33, 256, 8), (5, 1000, 3), (2, 8192, 64)])
def test_route_other_gpu(T, E, k, scoring):
    check(T, E, k, torch.bfloat16, "cuda", scoring=scoring, scale=2.446)


@pytest.mark.gpu
@needs_cuda
def test_route_ties_gpu():
    logits = torch.zeros(3, 896, device="cuda", dtype=torch.bfloat16)
    w, ids = route(logits, None, 16)
    assert ids.tolist() == [list(range(16))] * 3


# ----------------------------------------------------------------------------- a shared expert folded in
def shared_case(T, E, k, scoring, renormalize, scale):
    """(routed-only, with-shared) Triton routes and the reference's with-shared route of the same logits."""
    from tokenspeed.ops.reference.moe import with_shared_expert

    g = torch.Generator().manual_seed(T * 1000 + E + k)
    logits = torch.randn(T, E, generator=g) * 2
    b = torch.randn(E, generator=g) * 0.1
    kw = {"scoring": scoring, "renormalize": renormalize, "routed_scaling_factor": scale}
    plain = route(logits, b, k, **kw)
    with_shared = route_shared(logits, b, k, E, **kw)
    return plain, with_shared, with_shared_expert(*ref_route(logits, b, k, **kw), E)


def route_shared(logits, bias, k, shared_id, **kw):
    from tokenspeed.ops.triton.moe_route import moe_route

    T = logits.shape[0]
    w = torch.full((T, k + 1), float("nan"))
    ids = torch.full((T, k + 1), -7, dtype=torch.int64)
    out = moe_route(logits, bias, k, shared_expert_id=shared_id, out=(w, ids), **kw)
    assert out[0] is w and out[1] is ids
    return w, ids


@cpu_interp
@pytest.mark.parametrize("scoring,renormalize,scale", [("sigmoid", True, 2.446), ("softmax", True, 1.0),
                                                       ("sigmoid", False, 3.0), ("softmax", False, 0.5)])
@pytest.mark.parametrize("T,E,k", [(3, 40, 5), (2, 256, 8), (1, 7, 7)])
def test_route_shared_column_interp(T, E, k, scoring, renormalize, scale):
    """The extra column is (E, 1.0) whatever the scaling; the routed k columns are bit for bit the plain route's
    (the shared weight joins neither the renormalisation nor the scaling), and the reference agrees."""
    (w, ids), (ws, ids_s), (wr, idsr) = shared_case(T, E, k, scoring, renormalize, scale)
    assert ws.shape == ids_s.shape == (T, k + 1)
    assert torch.equal(ws[:, :k], w) and torch.equal(ids_s[:, :k], ids)
    assert torch.equal(ws[:, k], torch.ones(T)) and torch.equal(ids_s[:, k], torch.full((T,), E))
    assert torch.equal(wr[:, k], torch.ones(T)) and torch.equal(idsr[:, k], torch.full((T,), E))
    assert torch.equal(idsr[:, :k], ids)
    assert torch.allclose(wr[:, :k], w, rtol=1e-5, atol=0)
    if renormalize:
        assert torch.allclose(ws[:, :k].sum(1), torch.full((T,), scale), rtol=1e-5)


@cpu_interp
def test_route_shared_errors_interp():
    from tokenspeed.ops.reference.moe import check_shared_expert_id
    from tokenspeed.ops.triton.moe_route import moe_route

    logits = torch.randn(2, 8)
    for bad in (3, -1, 7, 8.0):
        with pytest.raises(ValueError, match="shared_expert_id"):
            moe_route(logits, None, 2, shared_expert_id=bad)
        with pytest.raises(ValueError, match="shared_expert_id"):
            check_shared_expert_id(bad, 8)
    with pytest.raises(ValueError, match=r"\[T, 3\]"):  # out sized for the routed k only
        moe_route(logits, None, 2, shared_expert_id=8, out=(torch.empty(2, 2), torch.empty(2, 2, dtype=torch.long)))
    w, ids = moe_route(logits, None, 2, shared_expert_id=11)  # any id past the routed ones
    assert ids[:, 2].tolist() == [11, 11] and w[:, 2].tolist() == [1.0, 1.0]


@cpu_interp
def test_route_shared_fold_equals_add_interp(poison_empty):
    """The fold end to end (fp32): route with shared_expert_id=E, experts stacked [E + 1, ...], one moe_experts
    call == the routed experts plus the shared expert's output added (a single rounding of the fp32 sum instead of
    two: equal within fp32 rounding, not bit for bit)."""
    from tests.ops.moe_inputs import make_weights
    from tokenspeed.ops.reference.activation import Activation
    from tokenspeed.ops.reference.moe import moe_experts as ref_experts
    from tokenspeed.ops.triton.moe_experts import moe_experts
    from tokenspeed.ops.triton.moe_route import moe_route

    T, E, k, D, DI = 3, 16, 4, 48, 40
    act = Activation("silu")
    w1, w3, w2 = make_weights(E + 1, D, DI, torch.float32, "cpu")  # expert E: the shared one
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(6))
    w, ids = moe_route(logits, None, k, routed_scaling_factor=2.5)
    ws, ids_s = moe_route(logits, None, k, routed_scaling_factor=2.5, shared_expert_id=E)
    shared = ref_experts(x, w1[E:], w3[E:], w2[E:], torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.long), act)
    want = ref_experts(x, w1[:E], w3[:E], w2[:E], w, ids, act, add=shared)
    folded = moe_experts(x, w1, w3, w2, ws, ids_s, act)
    assert (folded - want).abs().max().item() <= 1e-5 * want.abs().max().item()
