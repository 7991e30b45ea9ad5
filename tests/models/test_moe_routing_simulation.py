"""Benchmark routing (`set_routing_simulation`, `--moe-routing-simulation uniform`): with random weights, tokens
with the same hidden state all go to the same experts; with the simulation they spread over the experts, the
folded shared expert stays in every row, "off" gives the model's own outputs back bit for bit, a bad mode is a
clear error, and the engine option reaches every MoE layer."""

from __future__ import annotations

import pytest
import torch

from tokenspeed import LLM, SamplingParams
from tokenspeed.config import ModelConfig
from tokenspeed.errors import ConfigError
from tokenspeed.models import KimiForCausalLM, parse_hf_config, preset_hf_config
from tokenspeed.models.kimi.moe import SparseMoE, set_routing_simulation
from tokenspeed.models.weights import init_dummy_weights


def _model() -> KimiForCausalLM:
    model = KimiForCausalLM(parse_hf_config(preset_hf_config("tiny-kimi-linear")), dtype=torch.float32).eval()
    init_dummy_weights(model, seed=3)
    return model


def _moe_layers(model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_identical_tokens_spread_over_the_experts() -> None:
    model = _model()
    layer = _moe_layers(model)[0]
    c = layer.config
    x = torch.randn(1, c.hidden_size).repeat(32, 1)  # 32 tokens with one hidden state
    _, ids = layer._route(x)
    assert ids.unique().numel() == c.num_experts_per_token + layer.fold_shared  # the router: one choice for all
    assert set_routing_simulation(model, "uniform") == len(_moe_layers(model)) > 0
    _, sim = layer._route(x)
    routed = sim[:, : c.num_experts_per_token]
    assert routed.unique().numel() > 2 * c.num_experts_per_token
    assert all(len(set(r)) == c.num_experts_per_token for r in routed.tolist())
    if layer.fold_shared:
        assert (sim[:, -1] == c.num_experts).all()


def test_outputs_change_and_off_restores_them() -> None:
    model = _model()
    layer = _moe_layers(model)[0]
    x = torch.randn(6, layer.config.hidden_size)
    with torch.no_grad():
        plain = layer(x)
        set_routing_simulation(model, "uniform")
        assert [m.routing_salt for m in _moe_layers(model)] == list(range(len(_moe_layers(model))))
        simulated = layer(x)
        set_routing_simulation(model, "off")
        again = layer(x)
    assert not torch.equal(simulated, plain)
    assert torch.equal(again, plain)


def test_bad_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="uniform"):
        set_routing_simulation(_model(), "random")
    with pytest.raises(ConfigError, match="moe_routing_simulation"):
        ModelConfig(moe_routing_simulation="random")


def test_engine_option_reaches_every_moe_layer() -> None:
    llm = LLM("tiny-kimi-linear", cache_memory_gb=0.02, moe_routing_simulation="uniform")
    layers = _moe_layers(llm.engine.model)
    assert layers and all(m.routing_salt is not None for m in layers)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
