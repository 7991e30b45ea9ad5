"""A MoE layer's first junction (attention output + residual, post-attention norm), router GEMV and routing fused
into one `ops.moe_gate` launch (`SparseMoE.forward_junctions`).

Scenarios (tiny-kimi-linear, fp32, CPU):
- TOKENSPEED_OPS=triton (Triton interpreter) with TOKENSPEED_MOE_GATE=force: a batched prefill (8 tokens) and a
  decode step run `moe_gate` once per MoE layer and step, and give the logits and residual streams of the unfused
  model (TOKENSPEED_MOE_GATE=0) within fp32 rounding (the router logits' summation order differs), the same
  greedy tokens; a junction over more rows than the kernel takes falls back to the unfused launches.
- Default (CPU, no forced mode): nothing is fused and `forward_junctions` is bit for bit the composition the
  decoder ran before (`ops.add_rms_norm`, then `forward_add_norm`); tensor-parallel ranks and "0" never fuse.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_env import cpu_interp, rel_err  # sets up Triton (the interpreter) first
from tests.models.moe_steps import run_two_steps
from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models import load_model
from tokenspeed.models.kimi.moe import SparseMoE


def _moe_layers(model) -> list:
    return [layer for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]




def _junction_inputs(model, T: int, seed: int):
    layer = _moe_layers(model)[0]
    g = torch.Generator().manual_seed(seed)
    attn, residual = (torch.randn(T, model.config.hidden_size, generator=g) for _ in range(2))
    return layer, attn, residual, model.model.layers[layer.layer_id + 1].input_layernorm


@cpu_interp
def test_model_fused_gate_matches_unfused_interp(monkeypatch):
    from tokenspeed.ops.triton import moe_gate

    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=6)
    layers = _moe_layers(model)
    assert layers and all(lay.block_sparse_moe.parallel.tp_size == 1 for lay in layers)
    calls = []
    real = moe_gate.moe_gate
    monkeypatch.setattr(moe_gate, "moe_gate", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", "force")
    got = run_two_steps(model)
    assert calls == [8] * len(layers) + [2] * len(layers)  # every MoE layer, both steps
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", "0")
    calls.clear()
    want = run_two_steps(model)
    assert not calls
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-4
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1)) and torch.equal(got[1].argmax(-1), want[1].argmax(-1))


@cpu_interp
def test_junctions_fused_vs_composition_interp(monkeypatch):
    """One layer's junctions: fused equals the composition within fp32 rounding, summed bit for bit; above the
    kernel's row limit the composition runs."""
    from tokenspeed.ops.triton import moe_gate

    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=3)
    layer, attn, residual, norm = _junction_inputs(model, 5, seed=1)
    moe, post = layer.block_sparse_moe, layer.post_attention_layernorm
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", "force")
    assert moe.gate_fusable(attn, residual, post)
    got = moe.forward_junctions(attn, residual, post, norm)
    x, h = ops.add_rms_norm(attn, residual, post.weight, post.eps)
    want = moe.forward_add_norm(x, h, norm)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5
    big = torch.randn(moe_gate.MAX_TOKENS + 1, attn.shape[1])
    assert not moe.gate_fusable(big, big, post)


def test_cpu_default_is_the_composition(monkeypatch):
    """No fusion on CPU by default: forward_junctions is bit for bit add_rms_norm then forward_add_norm; "0" and
    tensor-parallel ranks never fuse."""
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    monkeypatch.delenv("TOKENSPEED_MOE_GATE", raising=False)
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=2)
    layer, attn, residual, norm = _junction_inputs(model, 3, seed=2)
    moe, post = layer.block_sparse_moe, layer.post_attention_layernorm
    assert not moe.gate_fusable(attn, residual, post)
    got = moe.forward_junctions(attn, residual, post, norm)
    want = moe.forward_add_norm(*ops.add_rms_norm(attn, residual, post.weight, post.eps), norm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", "0")
    assert not moe.gate_fusable(attn, residual, post)
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", "force")
    moe.parallel = ParallelContext(tp_size=2, tp_rank=0)
    assert not moe.gate_fusable(attn, residual, post)


@pytest.mark.parametrize("mode", ["0", "1"])
def test_forward_plain_routes_moe_layers_through_junctions(monkeypatch, mode: str):
    """The decoder hands a MoE layer's attention output to `forward_junctions` (dense layer 0 keeps its two
    add_rms_norm junctions), whatever the switch."""
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    monkeypatch.setenv("TOKENSPEED_MOE_GATE", mode)
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=5)
    seen = []
    real = SparseMoE.forward_junctions
    monkeypatch.setattr(SparseMoE, "forward_junctions", lambda self, *a: seen.append(a[0].shape) or real(self, *a))
    run_two_steps(model)
    assert len(seen) == 2 * len(_moe_layers(model))
    assert not hasattr(model.model.layers[0], "block_sparse_moe")
