"""Kimi Linear's shared expert folded into the routed experts (hidden-space `SparseMoE`).

Scenarios (fp32, CPU): the folded layer (one `moe_route(..., shared_expert_id=E)` + one `moe_experts` over
[E + 1, ...] weights) equals the unfolded computation on the same weights (routed experts over slots 0..E-1 plus a
separate shared `GatedMLP` built from slot E) within 1e-5 relative, at TP=1 and on each rank of TP=2 (loaded
from a checkpoint, the slot-E shard equal to that rank's shard of the checkpoint's shared-expert tensors, the
rank partial sums adding up to the TP=1 output); a written tiny-kimi-linear checkpoint stores the shared expert
under its own names and loading it and writing it back round-trips every tensor bit for bit; K3's LatentMoE and a
hidden-space MoE whose shared MLP is wider than a routed expert keep the separate shared experts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import rel_err
from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.models import load_model, write_tiny_checkpoint
from tokenspeed.models.checkpoint import checkpoint_tensors
from tokenspeed.models.kimi.mlp import GatedMLP
from tokenspeed.models.kimi.moe import SparseMoE

MOE = "model.layers.1.block_sparse_moe."  # tiny-kimi-linear: layer 0 dense, MoE after


class _NoReduce(ParallelContext):
    """A TP rank without a process group: all_reduce is the identity (the test sums the ranks' partials)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _unfolded(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Routed experts 0..E-1 plus a separate shared GatedMLP on slot E's weights (this rank's partial sum)."""
    c, e = moe.config, moe.config.num_experts
    mlp = GatedMLP(c, c.moe_intermediate_size, moe.parallel, x.dtype, reduce_output=False)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.cat([moe.w1[e], moe.w3[e]]))
        mlp.down_proj.weight.copy_(moe.w2[e])
    weights, ids = ops.moe_route(
        moe.gate(x), moe.gate.e_score_correction_bias, c.num_experts_per_token,
        scoring=c.moe_router_activation_func, renormalize=c.moe_renormalize,
        routed_scaling_factor=c.routed_scaling_factor,
    )
    assert ids.shape[1] == c.num_experts_per_token and bool((ids < e).all())
    return ops.moe_experts(x, moe.w1[:e], moe.w3[:e], moe.w2[:e], weights, ids, moe.act, add=mlp(x))


def test_folded_layer_equals_unfolded_tp1(monkeypatch) -> None:
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    model = load_model("tiny-kimi-linear", dtype=torch.float32, seed=3)
    c = model.config
    moes = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    assert moes
    x = torch.randn(13, c.hidden_size)
    for moe in moes:
        assert moe.fold_shared and not hasattr(moe, "shared_experts")
        assert moe.w1.shape[0] == moe.w3.shape[0] == moe.w2.shape[0] == c.num_experts + 1
        with torch.no_grad():
            assert rel_err(moe(x), _unfolded(moe, x)) < 1e-5
            assert rel_err(moe(x[:1]), _unfolded(moe, x[:1])) < 1e-5  # a decode-sized batch


def test_folded_layer_equals_unfolded_tp2_ranks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    ckpt = write_tiny_checkpoint(tmp_path, "tiny-kimi-linear", torch.float32, seed=2)
    stored = load_file(tmp_path / "model.safetensors")
    full = load_model(ckpt, dtype=torch.float32).model.layers[1].block_sparse_moe
    x = torch.randn(7, full.config.hidden_size)
    e = full.config.num_experts
    partials = []
    for rank in range(2):
        model = load_model(ckpt, dtype=torch.float32, parallel=_NoReduce(tp_size=2, tp_rank=rank))
        moe = model.model.layers[1].block_sparse_moe
        assert moe.fold_shared and moe.w1.shape == (e + 1, full.config.moe_intermediate_size // 2,
                                                    full.config.hidden_size)
        # slot E is this rank's shard of the shared expert, split like a routed expert
        assert torch.equal(moe.w1[e], stored[MOE + "shared_experts.gate_proj.weight"].chunk(2, 0)[rank])
        assert torch.equal(moe.w3[e], stored[MOE + "shared_experts.up_proj.weight"].chunk(2, 0)[rank])
        assert torch.equal(moe.w2[e], stored[MOE + "shared_experts.down_proj.weight"].chunk(2, 1)[rank])
        assert torch.equal(moe.w2[0], stored[MOE + "experts.0.w2.weight"].chunk(2, 1)[rank])
        with torch.no_grad():
            part = moe(x)
            assert rel_err(part, _unfolded(moe, x)) < 1e-5
        partials.append(part)
    with torch.no_grad():
        assert rel_err(partials[0] + partials[1], full(x)) < 1e-5


def test_checkpoint_round_trips_shared_expert(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "tiny-kimi-linear", torch.float32, seed=7)
    stored = load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path, dtype=torch.float32)
    c = model.config
    for layer in model.model.layers:
        if not hasattr(layer, "block_sparse_moe"):
            continue
        moe, pre = layer.block_sparse_moe, f"model.layers.{layer.layer_id}.block_sparse_moe."
        assert f"{pre}experts.{c.num_experts}.w1.weight" not in stored  # the shared slot keeps its own names
        for w, name in ((moe.w1, "gate_proj"), (moe.w3, "up_proj"), (moe.w2, "down_proj")):
            assert torch.equal(w[c.num_experts], stored[f"{pre}shared_experts.{name}.weight"])
    written = checkpoint_tensors(model, "")
    assert written.keys() == stored.keys()
    for name, t in stored.items():
        assert torch.equal(written[name], t), name


def test_other_shapes_keep_separate_shared_experts() -> None:
    k3 = load_model("tiny-k3", dtype=torch.float32, seed=1).model.layers[1].block_sparse_moe
    assert not k3.fold_shared and isinstance(k3.shared_experts, GatedMLP)
    assert k3.w1.shape[0] == k3.config.num_experts
    config = load_model("tiny-kimi-linear", load_format="dummy").config
    wide = SparseMoE(dataclasses.replace(config, num_shared_experts=2), ParallelContext(), torch.float32)
    with torch.no_grad():
        for p in wide.parameters():
            p.normal_(0, 0.1)
    assert not wide.fold_shared and wide.w1.shape[0] == config.num_experts
    assert wide.shared_experts.down_proj.weight.shape == (config.hidden_size, 2 * config.moe_intermediate_size)
    with torch.no_grad():
        assert wide(torch.randn(3, config.hidden_size)).shape == (3, config.hidden_size)


def test_warm_up_token_counts_follow_the_experts_launch_shape() -> None:
    """The model's warm-up lengths are the experts kernels' variant points for the (k, E, D, DI) its MoE layers
    call `ops.moe_experts` with: the folded shared expert adds a routing column and a stacked expert."""
    model = load_model("tiny-kimi-linear", dtype=torch.bfloat16, seed=3)
    moe = model.model.layers[1].block_sparse_moe
    c = moe.config
    assert moe.experts_launch_shape() == (c.num_experts_per_token + 1, c.num_experts + 1, c.hidden_size,
                                          c.moe_intermediate_size)
    counts = model.warm_up_token_counts(512)
    assert counts == ops.moe_variant_token_counts(*moe.experts_launch_shape(), 512, torch.bfloat16)
    assert counts[0] == 1 and len(counts) > 2
