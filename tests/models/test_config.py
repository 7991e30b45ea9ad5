"""HF config parsing for kimi_k3 and kimi_linear.

Scenarios: every K3 field of section 1.1 is read (0-based MLA layers 3, 7, ..., 91, 92); Kimi-Linear-48B parses
with its own switches (low-rank gate, no lower bound, no q-LoRA, plain residual); a kimi_k3 text_config missing
fields takes the K3 values; unknown architectures, activations, grouped routing, broken layer lists and vision
inputs raise ConfigError naming what is supported; the full K3 geometry has the published parameter count.
"""

from __future__ import annotations

import pytest
import torch

from tokenspeed.errors import ConfigError
from tokenspeed.models import KimiForCausalLM, parse_hf_config, preset_hf_config


def test_k3_fields() -> None:
    c = parse_hf_config(preset_hf_config("kimi-k3"))
    assert c.model_type == "kimi_k3"
    assert c.mla_layers == (*range(3, 92, 4), 92) and len(c.mla_layers) == 24 and len(c.kda_layers) == 69
    assert (c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size) == (96, 128, 4)
    assert c.use_full_rank_gate and c.gate_lower_bound == -5.0
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert c.mla_use_nope and c.mla_use_output_gate and c.mla_norm_eps == 1e-6 and c.rms_norm_eps == 1e-5
    assert (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts, c.moe_intermediate_size) == (
        896, 16, 2, 3072)
    assert c.routed_expert_hidden_size == 3584 and c.latent_moe_use_norm and c.routed_scaling_factor == 1.0
    assert c.attn_res_block_size == 12 and not c.tie_word_embeddings and c.eos_token_ids == (163586,)
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))
    assert c.mla_latent_dim == 576


def test_kimi_linear_48b_fields() -> None:
    c = parse_hf_config(preset_hf_config("kimi-linear-48b-a3b"))
    assert c.model_type == "kimi_linear"
    assert c.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert not c.use_full_rank_gate and c.gate_lower_bound is None
    assert c.q_lora_rank is None and not c.mla_use_output_gate and c.mla_use_nope
    assert c.routed_expert_hidden_size is None and c.attn_res_block_size is None
    assert (c.num_experts, c.num_experts_per_token, c.routed_scaling_factor) == (256, 8, 2.446)


def test_k3_text_config_defaults_to_k3_values() -> None:
    raw = {"model_type": "kimi_k3", "text_config": {"hidden_size": 7168}, "vision_config": {"hidden_size": 1024}}
    c = parse_hf_config(raw)
    assert c.num_hidden_layers == 93 and c.attn_res_block_size == 12 and c.gate_lower_bound == -5.0
    assert any("vision" in note for note in c.extra)


def test_kimi_linear_missing_fields_mean_feature_off() -> None:
    raw = preset_hf_config("kimi-linear-48b-a3b")
    del raw["linear_attn_config"]["kda_layers"]  # derived as the complement of full_attn_layers
    c = parse_hf_config(raw)
    assert len(c.kda_layers) == 20 and c.gate_lower_bound is None and c.latent_moe_use_norm is False


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(model_type="llama", architectures=["LlamaForCausalLM"]), "supported"),
        (lambda r: r.update(hidden_act="gelu"), "silu, situ"),
        (lambda r: r.update(moe_router_activation_func="relu"), "sigmoid, softmax"),
        (lambda r: r.update(num_expert_group=8), "num_expert_group=1"),
        (lambda r: r["linear_attn_config"].update(kda_layers=[1, 2, 3]), "partition"),
        (lambda r: r["linear_attn_config"].update(full_attn_layers=[4, 99]), "partition"),
        (lambda r: r.update(num_experts_per_token=300), "num_experts_per_token"),
    ],
)
def test_unsupported_options_raise_config_error(edit, message: str) -> None:
    raw = preset_hf_config("kimi-linear-48b-a3b")
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        parse_hf_config(raw)


def test_kimi_k3_without_text_config_and_vision_inputs_raise() -> None:
    with pytest.raises(ConfigError, match="text_config"):
        parse_hf_config({"model_type": "kimi_k3"})
    with pytest.raises(ConfigError, match="vision inputs are not supported"):
        parse_hf_config(preset_hf_config("kimi-k3"), multimodal=True)


def test_full_k3_parameter_count_matches_the_spec() -> None:
    """Section 3: 2,779,484,478,208 parameters counting A_log as stored ([128] per KDA layer); we keep [96]."""
    model = KimiForCausalLM(parse_hf_config(preset_hf_config("kimi-k3")), device="meta")
    total = sum(p.numel() for p in model.parameters())
    assert total + 69 * (128 - 96) == 2_779_484_478_208


def test_fp32_islands_stay_fp32() -> None:
    model = KimiForCausalLM(parse_hf_config(preset_hf_config("tiny-k3")), dtype=torch.bfloat16, device="meta")
    fp32 = {n.rsplit(".", 1)[-1] if not n.endswith(".weight") else n.rsplit(".", 2)[-2]
            for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"A_log", "dt_bias", "conv_weight", "o_norm", "e_score_correction_bias"}
