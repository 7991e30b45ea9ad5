"""The fused residual junctions and merged gated activation change no bit of the plain model.

tiny-kimi-linear (dense layer 0, MoE + shared expert after, KDA and MLA layers) on the CPU reference path, fp32 and
bf16: the model's forward (each residual add fused with the norm after it via `ops.add_rms_norm`, the gated MLPs
through `ops.gated_activation_merged`) against the unfused composition the model ran before (written out here:
`h = h + attn(input_norm(h))`, `h = h + ffn(post_norm(h))`, `gate, up = gate_up(x).chunk(2)`, `norm(h)`; the
MoE's shared expert stays folded into the routed experts, checked against a separate shared MLP in
test_moe_fold.py): logits and every captured layer's residual stream bit for bit over a batched prefill and two
decode steps, so greedy tokens cannot change. Also: one fused junction per add (2 per layer: `add_rms_norm`, or
for a MoE layer's second one the experts' combine, `moe_experts(..., residual=)`) and no other norm of the
residual stream.
"""

from __future__ import annotations

import pytest
import torch

from tokenspeed import ops
from tokenspeed.models import CacheBuffers, ForwardBatch, KimiForCausalLM, parse_hf_config, preset_hf_config
from tokenspeed.models.weights import init_dummy_weights

PAGE = 4


def build(dtype: torch.dtype) -> KimiForCausalLM:
    model = KimiForCausalLM(parse_hf_config(preset_hf_config("tiny-kimi-linear")), dtype=dtype).eval()
    init_dummy_weights(model, seed=5)
    return model


def old_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    y = mlp.down_proj(ops.gated_activation(gate, up, mlp.act))
    return mlp.parallel.all_reduce(y) if mlp.reduce_output else y


def old_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """A folded shared expert (tiny-kimi-linear: slot E, weight 1.0) stays folded here: the fold's own rounding
    is checked against the separate shared MLP in test_moe_fold.py; this test is about the junctions."""
    c = moe.config
    weights, ids = ops.moe_route(
        moe.gate(x), getattr(moe.gate, "e_score_correction_bias", None), c.num_experts_per_token,
        scoring=c.moe_router_activation_func, renormalize=c.moe_renormalize,
        routed_scaling_factor=c.routed_scaling_factor, shared_expert_id=c.num_experts if moe.fold_shared else None,
    )
    y = ops.moe_experts(x, moe.w1, moe.w3, moe.w2, weights, ids, moe.act)
    return moe.parallel.all_reduce(y if moe.fold_shared else y + old_mlp(moe.shared_experts, x))


def old_forward(model: KimiForCausalLM, batch: ForwardBatch, cache: CacheBuffers) -> tuple[torch.Tensor, list]:
    """(logits, residual stream after each layer) of the unfused plain pre-norm stack."""
    m = model.model
    hidden = m.embed_tokens(batch.input_ids)
    after = []
    for layer in m.layers:
        hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), batch, cache)
        x = layer.post_attention_layernorm(hidden)
        hidden = hidden + (old_mlp(layer.mlp, x) if hasattr(layer, "mlp") else old_moe(layer.block_sparse_moe, x))
        after.append(hidden)
    return model.lm_head(m.norm(hidden)).float(), after


def steps() -> list[tuple[list[list[int]], list[int]]]:
    """(new tokens per sequence, cached lengths) for a 2-sequence prefill (7 and 5 tokens) and two decodes."""
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 7))
    return [([a[:7], b[:5]], [0, 0]), ([a[7:8], b[5:6]], [7, 5]), ([a[8:9], b[6:7]], [8, 6])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plain_model_bit_identical_to_unfused(dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.delenv("TOKENSPEED_OPS", raising=False)
    model = build(dtype)
    n = model.config.num_hidden_layers
    caches = [CacheBuffers.allocate(model.config, 16, PAGE, 4, dtype) for _ in range(2)]
    pages = [[0, 1, 2], [5, 6]]
    for tokens, cached in steps():
        batch = ForwardBatch.build(tokens, cached, pages, [1, 3], PAGE)
        with torch.no_grad():
            got, feats = model(batch, caches[0], capture_layers=tuple(range(1, n + 1)))
            want, after = old_forward(model, batch, caches[1])
        assert torch.equal(got, want)
        for i in range(n):
            assert torch.equal(feats[i], after[i]), i
    assert torch.equal(caches[0].kda_recurrent[0], caches[1].kda_recurrent[0])


def test_one_add_rms_norm_per_junction(monkeypatch) -> None:
    model = build(torch.float32)
    counts = {"add_rms_norm": 0, "rms_norm": 0, "moe_junction": 0}
    for name in ("add_rms_norm", "rms_norm"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name: counts.__setitem__(_n, counts[_n] + 1) or _r(*a))
    experts = ops.moe_experts

    def moe_experts(*a, **kw):
        counts["moe_junction"] += kw.get("residual") is not None
        return experts(*a, **kw)

    monkeypatch.setattr(ops, "moe_experts", moe_experts)
    cache = CacheBuffers.allocate(model.config, 4, PAGE, 1, torch.float32)
    with torch.no_grad():
        model(ForwardBatch.build([[5, 6, 7]], [0], [[0]], [0], PAGE), cache)
    c = model.config
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    assert moe_layers > 0 and counts["moe_junction"] == moe_layers  # one rank: every MoE junction in the combine
    assert counts["add_rms_norm"] + counts["moe_junction"] == 2 * c.num_hidden_layers
    # plain norms left: the first layer's input norm and the MLA layers' q_a norms (the kv_a norm runs inside
    # ops.mla_norm_store_latent, fused with the latent cache write)
    assert counts["rms_norm"] == 1 + len(c.mla_layers) * (c.q_lora_rank is not None)
