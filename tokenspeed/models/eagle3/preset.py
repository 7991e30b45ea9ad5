"""Built-in EAGLE3-MLA draft geometries as HF-style draft config dicts (parsed like a real config.json).

- `tiny-eagle3`: toy draft for both tiny targets (`tiny-k3`, `tiny-kimi-linear`: vocab 512, hidden 64). q-LoRA,
  YaRN that matters at test lengths, a draft vocab of 256 (d2t non-trivial), features after layers 2, 3, 4.
- `kimi-k3-eagle3-mla`: the likely K3 draft geometry (section 4.2: the public K2.5 MLA EAGLE3 config shape with
  K3's feature layers 2, 46, 90). Unconfirmed against the real checkpoint; for planning and dummy weights.
- `kimi-linear-48b-a3b-eagle3`: a made-up draft for the Kimi-Linear-48B-A3B target (hidden 2304, its MLA shape),
  only for benchmarks with dummy weights and forced acceptance. No such public checkpoint exists.
"""

from __future__ import annotations

import copy
from typing import Any

from tokenspeed.errors import ConfigError

_K2_YARN = {
    "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 1.0,
}

KIMI_K3_EAGLE3_MLA: dict[str, Any] = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "target_hidden_size": 7168,
    "num_hidden_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 50000.0,
    "rope_scaling": _K2_YARN,
    "intermediate_size": 18432,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "vocab_size": 163840,
    "draft_vocab_size": 163840,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 46, 90], "use_aux_hidden_state": True},
}

KIMI_LINEAR_48B_EAGLE3: dict[str, Any] = {
    **KIMI_K3_EAGLE3_MLA,
    "hidden_size": 2304,
    "target_hidden_size": 2304,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "intermediate_size": 9216,
    "eagle_config": {"use_aux_hidden_state": True},  # default layers [2, 13, 24] of the 27-layer target
}

TINY_EAGLE3: dict[str, Any] = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 64,
    "target_hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_theta": 50000.0,
    # original 16 positions x4: tests of ~20 tokens cross the YaRN interpolation range.
    "rope_scaling": {**_K2_YARN, "factor": 4.0, "original_max_position_embeddings": 16},
    "intermediate_size": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "draft_vocab_size": 256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4], "use_aux_hidden_state": True},
}

EAGLE3_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-eagle3": TINY_EAGLE3,
    "kimi-k3-eagle3-mla": KIMI_K3_EAGLE3_MLA,
    "kimi-linear-48b-a3b-eagle3": KIMI_LINEAR_48B_EAGLE3,
}


def eagle3_preset_hf_config(name: str) -> dict[str, Any]:
    """A deep copy of the named draft preset's config dict. Raises ConfigError listing the presets."""
    if name not in EAGLE3_PRESETS:
        raise ConfigError(f"unknown EAGLE3 draft preset {name!r}; built-in: {', '.join(sorted(EAGLE3_PRESETS))}")
    return copy.deepcopy(EAGLE3_PRESETS[name])
