"""Built-in model geometries as HF-style config dicts (parsed by the same code as a real config.json).

- `kimi-k3`: the full K3 text geometry (section 1.1 of k3-architecture.md), for planning and dummy weights.
- `kimi-linear-48b-a3b`: the public Kimi-Linear-48B-A3B config.
- `k3-slice`: K3's exact layer widths, 12 layers (one AttnRes block, 3 MLA), 64 experts: ~33B, fits one H200.
- `tiny-k3`, `tiny-kimi-linear`: every feature at toy width, for tests (both layer kinds, >= 2 AttnRes blocks,
  8 experts, latent narrower than hidden).
"""

from __future__ import annotations

import copy
from typing import Any

from tokenspeed.errors import ConfigError

_K3_MLA_LAYERS_1B = [*range(4, 93, 4), 93]

# The K3 text config (model_type kimi_linear), as the reference checkpoint's text_config.
K3_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "linear_attn_config": {
        "full_attn_layers": _K3_MLA_LAYERS_1B,
        "kda_layers": [i for i in range(1, 94) if i not in _K3_MLA_LAYERS_1B],
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 33792,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "attn_res_block_size": 12,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
}

KIMI_K3: dict[str, Any] = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": K3_TEXT_CONFIG,
}

KIMI_LINEAR_48B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "hidden_act": "silu",
    "intermediate_size": 9216,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
}

# k3-slice: K3's exact layer widths in one AttnRes block of 12 layers (MLA at 1-based 4, 8, 12, layer 1 dense,
# 64 experts top-16 in the 3584 latent, 2 shared): about 33B parameters, a one-H200 benchmark geometry.
K3_SLICE: dict[str, Any] = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": {
        **K3_TEXT_CONFIG,
        "num_hidden_layers": 12,
        "linear_attn_config": {
            **K3_TEXT_CONFIG["linear_attn_config"],
            "full_attn_layers": [4, 8, 12],
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
        },
        "num_experts": 64,
    },
}

# tiny-k3: 6 layers, MLA at 1-based 3, 5, 6 (two adjacent, like K3's 92/93), AttnRes blocks of 2 (3 blocks).
TINY_K3: dict[str, Any] = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": {
        **K3_TEXT_CONFIG,
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "linear_attn_config": {
            "full_attn_layers": [3, 5, 6],
            "kda_layers": [1, 2, 4],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_token": 3,
        "num_shared_experts": 2,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32,
        "attn_res_block_size": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    },
}

# tiny-kimi-linear: 5 layers, MLA at 1-based 3 and 5; low-rank output gate, softplus decay, no q-LoRA.
TINY_KIMI_LINEAR: dict[str, Any] = {
    **KIMI_LINEAR_48B,
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "linear_attn_config": {
        "full_attn_layers": [3, 5],
        "kda_layers": [1, 2, 4],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k3": KIMI_K3,
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B,
    "k3-slice": K3_SLICE,
    "tiny-k3": TINY_K3,
    "tiny-kimi-linear": TINY_KIMI_LINEAR,
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """A deep copy of the named preset's HF config dict. Raises ConfigError listing the presets."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; built-in presets: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])
