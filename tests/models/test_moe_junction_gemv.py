"""A MoE layer's FFN junction left pending (`ops.PendingNorm`) and fused into the next layer's first projection.

Scenarios (tiny-kimi-linear, fp32, CPU, Triton interpreter with TOKENSPEED_OPS=triton and TOKENSPEED_MOE_GATE=force):
- a batched prefill (8 tokens, over the fused kernel's 4 rows: nothing deferred) and a decode step of 2 sequences
  (every MoE layer followed by a layer that takes a pending input defers, and that layer's first projection runs
  `junction_gemv` once); logits and every layer's residual stream (the EAGLE3 features, captured while still
  pending) equal the unfused model's (TOKENSPEED_MOE_JUNCTION_GEMV=0) within fp32 rounding, the same greedy tokens;
- the last layer never defers (its output goes to the final norm and the LM head);
- default CPU mode (no forced Triton): nothing is deferred.
"""

from __future__ import annotations

import torch

from tests.models.moe_steps import run_two_steps
from tests.ops.triton_env import cpu_interp, rel_err  # sets up Triton (the interpreter) first
from tokenspeed import ops
from tokenspeed.models import load_model


def _expected_deferrals(model) -> int:
    layers = model.model.layers
    return sum(1 for i, layer in enumerate(layers[:-1])
               if hasattr(layer, "block_sparse_moe") and layers[i + 1].takes_pending_input())


def _count(monkeypatch):
    from tokenspeed.ops.triton import gemv_junction

    calls = []
    real = gemv_junction.junction_gemv
    monkeypatch.setattr(gemv_junction, "junction_gemv", lambda *a, **kw: calls.append(a[3].shape[0]) or real(*a, **kw))
    return calls


@cpu_interp
def test_deferred_junction_matches_unfused_interp(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", "force")
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=6)
    expected = _expected_deferrals(model)
    assert expected >= 1
    calls = _count(monkeypatch)
    got = run_two_steps(model)
    assert calls == [2] * expected  # the decode step only (2 rows); the 8-token prefill is over the limit
    monkeypatch.setenv("TOKENSPEED_MOE_JUNCTION_GEMV", "0")
    calls.clear()
    want = run_two_steps(model)
    assert not calls
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-4
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1)) and torch.equal(got[1].argmax(-1), want[1].argmax(-1))


@cpu_interp
def test_last_layer_and_cpu_default_never_defer(monkeypatch):
    from tokenspeed.models.kimi.moe import SparseMoE

    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=2)
    seen: list[bool] = []
    real = SparseMoE.forward_junctions

    def spy(self, *a):
        out = real(self, *a)
        seen.append(isinstance(out[0], ops.PendingNorm))
        return out

    monkeypatch.setattr(SparseMoE, "forward_junctions", spy)
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    run_two_steps(model)
    assert seen and not any(seen)  # CPU default: plain tensors
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", "force")
    seen.clear()
    run_two_steps(model)
    moe_layers = sum(hasattr(layer, "block_sparse_moe") for layer in model.model.layers)
    decode = seen[moe_layers:]
    assert not any(seen[:moe_layers])  # the prefill step: 8 rows
    assert sum(decode) == _expected_deferrals(model)
    if hasattr(model.model.layers[-1], "block_sparse_moe"):
        assert decode[-1] is False  # the last layer's output feeds the final norm
