"""A MoE layer's FFN junction (h + y, then the next norm) fused into the experts' combine kernel.

Scenarios (tiny-kimi-linear, fp32, CPU):
- TOKENSPEED_OPS=triton (Triton interpreter): a batched prefill and a decode step give the same logits and
  residual streams, bit for bit, with the junction fused into the combine (one rank: `combine_add_rms_norm` runs
  once per MoE layer and step), with the unfused pair (experts then `ops.add_rms_norm`, the model before this
  change) and on the tensor-parallel path (world size 2 with an identity all-reduce: unfused, the all-reduce
  before the add), so greedy tokens cannot differ.
- The tensor-parallel path all-reduces the experts' partial sum before the add (the add and the norm follow the
  reduction), and never asks the experts for the fused junction; the reference path of both gives the same bits.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

# tests.ops.triton_env sets up Triton (the interpreter) before anything imports it
from tests.ops.triton_env import cpu_interp
from tests.models.moe_steps import run_two_steps
from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models import load_model
from tokenspeed.models.kimi.moe import SparseMoE


class _Recording(ParallelContext):
    """Two TP ranks without a process group: all_reduce is the identity and logs itself (weights unsharded, so
    the identity is the sum of one full rank)."""

    log: ClassVar[list[str]] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append("all_reduce")
        return x


def _moes(model) -> list[SparseMoE]:
    return [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]


def _unfused(self: SparseMoE, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.add_rms_norm(self(x), residual, norm.weight, norm.eps)


@cpu_interp
def test_fused_junction_equals_unfused_and_tp_path_triton_interp(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_OPS", "triton")
    from tokenspeed.ops.triton import moe_combine, moe_experts

    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=6)
    moes = _moes(model)
    assert moes and all(m.fold_shared and m.parallel.tp_size == 1 for m in moes)
    calls = []
    fused = moe_combine.combine_add_rms_norm
    monkeypatch.setattr(moe_experts, "combine_add_rms_norm", lambda *a, **k: calls.append(1) or fused(*a, **k))
    got = run_two_steps(model)
    assert len(calls) == 2 * len(moes)  # two steps, every MoE junction in the combine
    with monkeypatch.context() as m:
        m.setattr(SparseMoE, "forward_add_norm", _unfused)
        unfused = run_two_steps(model)
    for moe in moes:
        moe.parallel = _Recording(tp_size=2, tp_rank=0)
    tp = run_two_steps(model)
    assert len(calls) == 2 * len(moes)  # the TP path never fuses
    for a, b, c in zip(got, unfused, tp, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("T", [1, 6])
def test_tp_path_reduces_before_the_add(monkeypatch, T: int):
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=2)
    moe = _moes(model)[0]
    norm = model.model.layers[2].input_layernorm
    g = torch.Generator().manual_seed(T)
    x, residual = (torch.randn(T, model.config.hidden_size, generator=g) for _ in range(2))
    fused = moe.forward_add_norm(x, residual, norm)
    log = _Recording.log
    log.clear()
    add_norm, experts = ops.add_rms_norm, ops.moe_experts
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a: log.append("add_rms_norm") or add_norm(*a))
    monkeypatch.setattr(ops, "moe_experts",
                        lambda *a, **k: log.append("junction" if "residual" in k else "experts") or experts(*a, **k))
    moe.parallel = _Recording(tp_size=2, tp_rank=0)
    normed, summed = moe.forward_add_norm(x, residual, norm)
    assert log == ["experts", "all_reduce", "add_rms_norm"]
    assert torch.equal(normed, fused[0]) and torch.equal(summed, fused[1])
    assert torch.equal(summed, residual + moe(x))  # summed is the stream h + y, normed its norm
