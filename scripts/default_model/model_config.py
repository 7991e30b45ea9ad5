"""The default model's geometry: a kimi_k3 config with every K3 feature at a few million parameters.

8 layers, hidden 256: KDA (4 heads x 48, full-rank output gate, bounded decay gate) at 1-based layers 1-3 and
5-7, gated NoPE MLA (q-LoRA, output gate) at 4 and 8; layer 0 a dense SiTU MLP (256 wide), layers 1-7 LatentMoE
(sigmoid noaux router, 8 SiTU experts of width 32, top-2, in a 128-wide latent with its norm, a 2x-wide shared
expert); Block AttnRes with blocks of 4 layers (2 blocks).
Vocab 8192 = 7936 BPE ranks + 256 K3-style special ids; untied lm_head.
"""

from __future__ import annotations

import copy
from typing import Any

from chat_format import BOS, END_OF_MSG, VOCAB_SIZE, special_id

NUM_LAYERS = 8
MLA_LAYERS_1B = [4, 8]

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": NUM_LAYERS,
    "linear_attn_config": {
        "full_attn_layers": MLA_LAYERS_1B,
        "kda_layers": [i for i in range(1, NUM_LAYERS + 1) if i not in MLA_LAYERS_1B],
        "num_heads": 4,
        "head_dim": 48,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 256,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 128,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "attn_res_block_size": 4,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": special_id(BOS),
    "eos_token_id": special_id(END_OF_MSG),
    "pad_token_id": special_id("[PAD]"),
    "torch_dtype": "bfloat16",
}


def hf_config(**text_overrides: Any) -> dict[str, Any]:
    """The full kimi_k3 config.json dict (text model under text_config; no vision tower)."""
    text = copy.deepcopy(TEXT_CONFIG)
    text.update(text_overrides)
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "torch_dtype": text["torch_dtype"],
        "tokenspeed_default_model": "kimi-k3-mini",
    }
