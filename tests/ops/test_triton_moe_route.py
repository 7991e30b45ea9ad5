"""Triton MoE router (sigmoid / softmax, bias-corrected top-k, renormalise) against the torch reference.

Ids must match exactly except where two selection scores are within 1e-6 (two fp32 sigmoids may differ in the
last bit there); weights within 1e-5 relative (they are fp32 whatever the logits' dtype). Exact ties go to the
lower expert id. Outputs start poisoned.
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
