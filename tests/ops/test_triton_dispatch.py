"""`tokenspeed.ops` dispatch: CUDA tensors -> Triton kernels, CPU tensors -> reference, TOKENSPEED_OPS overrides."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

from tokenspeed import ops
from tokenspeed.ops import dispatch
from tokenspeed.ops.reference import attn_res as ref_attn_res
from tokenspeed.ops.reference import moe as ref_moe
from tokenspeed.ops.reference import norm as ref_norm

INTERP = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_mode_parsing(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    assert dispatch.mode() == "auto"
    monkeypatch.setenv("TOKENSPEED_OPS", " Reference ")
    assert dispatch.mode() == "reference"
    assert not dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv("TOKENSPEED_OPS", "cuda")
    with pytest.raises(ValueError, match="TOKENSPEED_OPS"):
        dispatch.mode()


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    x = torch.randn(3, 8)
    assert not dispatch.use_triton(x)
    assert torch.equal(ops.rms_norm(x, torch.ones(8), 1e-5), ref_norm.rms_norm(x, torch.ones(8), 1e-5))
    assert ops.attn_res_mix(torch.zeros(0, 3, 8), x, torch.ones(8), 1e-6) is x  # n == 0 returns partial itself


def test_public_signatures_unchanged():
    import inspect

    from tokenspeed.ops.reference import activation as ref_act

    for name, ref in [("rms_norm", ref_norm.rms_norm), ("gated_rms_norm", ref_norm.gated_rms_norm),
                      ("add_rms_norm", ref_norm.add_rms_norm), ("gated_activation", ref_act.gated_activation),
                      ("gated_activation_merged", ref_act.gated_activation_merged),
                      ("attn_res_mix", ref_attn_res.attn_res_mix),
                      ("attn_res_mix_rms_norm", ref_attn_res.attn_res_mix_rms_norm),
                      ("moe_route", ref_moe.moe_route), ("moe_experts", ref_moe.moe_experts)]:
        assert inspect.signature(getattr(ops, name)) == inspect.signature(ref), name
        assert getattr(ops, name).__doc__ == ref.__doc__
        assert name in ops.__all__


@pytest.mark.skipif(not INTERP, reason="needs the Triton CPU interpreter (set before triton import)")
def test_forced_triton_on_cpu_interpreter(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    x, w, g = torch.randn(4, 24), torch.randn(24), torch.randn(4, 24)
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), ref_norm.rms_norm(x, w, 1e-5), atol=1e-5)
    assert torch.allclose(ops.gated_rms_norm(x, g, w, 1e-5), ref_norm.gated_rms_norm(x, g, w, 1e-5), atol=1e-5)
    blocks = torch.randn(2, 4, 24)
    assert torch.allclose(ops.attn_res_mix_rms_norm(blocks, x, w, 1e-6, w, 1e-5),
                          ref_attn_res.attn_res_mix_rms_norm(blocks, x, w, 1e-6, w, 1e-5), atol=1e-5)
    wk, ik = ops.moe_route(x, None, 3)
    wr, ir = ref_moe.moe_route(x, None, 3)
    assert torch.equal(ik, ir) and torch.allclose(wk, wr, atol=1e-6)
    for a, b in zip(ops.add_rms_norm(g, x, w, 1e-5), ref_norm.add_rms_norm(g, x, w, 1e-5), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    _, sk = ops.add_rms_norm(g, x.double(), w, 1e-5)  # mixed dtypes: outside the region, the reference
    assert sk.dtype == torch.float64 and torch.equal(sk, x.double() + g)


@pytest.mark.parametrize("mode", ["auto", "triton"])
def test_moe_route_shared_expert_id_matches_reference(monkeypatch, mode):
    """The public `ops.moe_route(..., shared_expert_id=)` on CPU (the reference) and forced to Triton (the
    interpreter) equals the reference: the routed columns of the plain route, then the column (id, 1.0)."""
    if mode == "triton" and not INTERP:
        pytest.skip("needs the Triton CPU interpreter (set before triton import)")
    monkeypatch.setenv("TOKENSPEED_OPS", mode)
    g = torch.Generator().manual_seed(3)
    T, E, k = 5, 24, 4
    logits, bias = torch.randn(T, E, generator=g) * 2, torch.randn(E, generator=g) * 0.1
    for scoring, renormalize, scale in (("sigmoid", True, 2.446), ("softmax", False, 1.5)):
        kw = {"scoring": scoring, "renormalize": renormalize, "routed_scaling_factor": scale}
        w, ids = ops.moe_route(logits, bias, k, shared_expert_id=E, **kw)
        wr, ir = ref_moe.moe_route(logits, bias, k, shared_expert_id=E, **kw)
        assert w.shape == ids.shape == wr.shape == (T, k + 1)
        assert torch.equal(ids, ir) and torch.allclose(w, wr, rtol=1e-6, atol=0)
        assert torch.equal(w[:, k], torch.ones(T)) and torch.equal(ids[:, k], torch.full((T,), E))
        w0, i0 = ref_moe.moe_route(logits, bias, k, **kw)
        assert torch.equal(ir[:, :k], i0) and torch.equal(wr[:, :k], w0)
    with pytest.raises(ValueError, match="shared_expert_id"):
        ops.moe_route(logits, bias, k, shared_expert_id=E - 1)


def _spy(monkeypatch, module: str, name: str) -> list:
    mod = dispatch.kernels(module)
    real = getattr(mod, name)
    calls: list = []
    monkeypatch.setattr(mod, name, lambda *a, **k: calls.append(name) or real(*a, **k))
    return calls


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_take_triton_and_env_forces_reference(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    calls = []
    for module, name in [("norm", "rms_norm"), ("norm", "gated_rms_norm"), ("attn_res", "attn_res_mix"),
                         ("attn_res", "attn_res_mix_rms_norm"), ("moe_route", "moe_route")]:
        calls.append(_spy(monkeypatch, module, name))
    dev, bf = "cuda", torch.bfloat16
    x, g = torch.randn(4, 7168, device=dev, dtype=bf), torch.randn(4, 7168, device=dev, dtype=bf)
    w, q = torch.randn(7168, device=dev, dtype=bf), torch.randn(7168, device=dev) * 0.05
    blocks = torch.randn(3, 4, 7168, device=dev, dtype=bf)
    logits, bias = torch.randn(4, 896, device=dev, dtype=bf), torch.randn(896, device=dev) * 0.1

    def run_all():
        return [ops.rms_norm(x, w, 1e-5), ops.gated_rms_norm(x, g, w.float(), 1e-5),
                ops.attn_res_mix(blocks, x, q, 1e-6), ops.attn_res_mix_rms_norm(blocks, x, q, 1e-6, w, 1e-5),
                ops.moe_route(logits, bias, 16)[0]]

    fast = run_all()
    assert [len(c) for c in calls] == [1] * 5
    monkeypatch.setenv("TOKENSPEED_OPS", "reference")
    slow = run_all()
    assert [len(c) for c in calls] == [1] * 5
    for a, b in zip(fast, slow):
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_cuda_fusions_take_triton(monkeypatch):
    """add_rms_norm, gated_activation(_merged) and moe_experts(add=) on CUDA run their kernels (one call each)."""
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    calls = [_spy(monkeypatch, "norm", "add_rms_norm"), _spy(monkeypatch, "activation", "gated_activation"),
             _spy(monkeypatch, "activation", "gated_activation_merged"), _spy(monkeypatch, "moe_experts", "moe_experts")]
    dev, bf = "cuda", torch.bfloat16
    x, r = (torch.randn(3, 2304, device=dev, dtype=bf) for _ in range(2))
    w = torch.randn(2304, device=dev, dtype=bf)  # the norm gain: one per hidden channel
    gu = torch.randn(3, 2048, device=dev, dtype=bf)
    act = ops.Activation("silu")
    ops.add_rms_norm(x, r, w, 1e-5)
    ops.gated_activation(*gu.chunk(2, dim=-1), act)
    ops.gated_activation_merged(gu, act)
    w1, w3 = (torch.randn(8, 64, 2304, device=dev, dtype=bf) * 0.02 for _ in range(2))
    w2 = torch.randn(8, 2304, 64, device=dev, dtype=bf) * 0.1
    tw, ids = torch.rand(3, 2, device=dev), torch.randint(0, 8, (3, 2), device=dev)
    ops.moe_experts(x, w1, w3, w2, tw, ids, act, add=r)
    assert [len(c) for c in calls] == [1, 1, 1, 1]
