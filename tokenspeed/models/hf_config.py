"""Parse an HF `config.json` (kimi_k3 or kimi_linear) into a `KimiConfig`."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenspeed.errors import ConfigError
from tokenspeed.models.config import SUPPORTED_ARCHITECTURES, KimiConfig

logger = logging.getLogger(__name__)

K3_ARCH = "KimiK3ForConditionalGeneration"
KIMI_LINEAR_ARCH = "KimiLinearForCausalLM"

# Scalar fields copied as-is when present (HF name == our name).
_PLAIN_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope",
    "mla_use_output_gate", "rope_theta", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
    "intermediate_size", "first_k_dense_replace", "moe_layer_freq", "num_experts", "num_experts_per_token",
    "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm",
    "moe_router_activation_func", "topk_method", "use_grouped_topk", "num_expert_group", "topk_group",
    "moe_renormalize", "routed_scaling_factor", "attn_res_block_size", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "num_nextn_predict_layers", "bos_token_id", "pad_token_id",
)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _text_config(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any], list[str]]:
    """(model_type, text-config dict, log notes) for a raw HF config."""
    model_type = raw.get("model_type")
    archs = list(raw.get("architectures") or [])
    if model_type == "kimi_k3" or K3_ARCH in archs:
        from tokenspeed.models.presets import K3_TEXT_CONFIG

        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("a kimi_k3 config must nest the text model under 'text_config'")
        notes = []
        if "vision_config" in raw:
            notes.append("kimi_k3: serving the text path only; vision_tower.* and mm_projector.* are skipped")
        return "kimi_k3", {**K3_TEXT_CONFIG, **text}, notes
    if model_type == "kimi_linear" or KIMI_LINEAR_ARCH in archs:
        return "kimi_linear", dict(raw), []
    supported = "; ".join(f"{k}: {v}" for k, v in SUPPORTED_ARCHITECTURES.items())
    raise ConfigError(f"unsupported model (model_type={model_type!r}, architectures={archs}); supported: {supported}")


def _mla_layers(text: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    lac = text.get("linear_attn_config") or {}
    full, kda = lac.get("full_attn_layers"), lac.get("kda_layers")
    everything = set(range(1, num_layers + 1))
    if full is None and kda is None:
        return tuple(range(num_layers))  # no linear attention: every layer is MLA
    full_set = set(full) if full is not None else everything - set(kda)
    kda_set = set(kda) if kda is not None else everything - full_set
    if full_set & kda_set or (full_set | kda_set) != everything:
        raise ConfigError(
            "linear_attn_config: kda_layers and full_attn_layers (1-based) must partition 1.."
            f"{num_layers}; overlap={sorted(full_set & kda_set)}, missing={sorted(everything - full_set - kda_set)}"
        )
    return tuple(sorted(i - 1 for i in full_set))


def parse_hf_config(raw: Mapping[str, Any], *, multimodal: bool = False) -> KimiConfig:
    """Build a `KimiConfig` from a parsed `config.json`. Raises `ConfigError` with what is supported.

    multimodal: the caller wants image/video inputs; not supported (text path only).
    """
    if multimodal:
        raise ConfigError("vision inputs are not supported: TokenSpeed serves the text path of Kimi models only")
    model_type, text, notes = _text_config(raw)
    fields: dict[str, Any] = {k: text[k] for k in _PLAIN_FIELDS if k in text and text[k] is not None}
    for k in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size", "num_experts"):
        if k in text:
            fields[k] = text[k]  # None is meaningful here (feature off)
    num_layers = int(fields.get("num_hidden_layers", KimiConfig.num_hidden_layers))
    lac = text.get("linear_attn_config") or {}
    for ours, theirs in (("kda_num_heads", "num_heads"), ("kda_head_dim", "head_dim"),
                         ("short_conv_kernel_size", "short_conv_kernel_size"),
                         ("use_full_rank_gate", "use_full_rank_gate"), ("gate_lower_bound", "gate_lower_bound")):
        if theirs in lac:
            fields[ours] = lac[theirs]
    if text.get("rope_scaling") is not None:
        fields["rope_scaling"] = _freeze(text["rope_scaling"])
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if eos is not None:
        fields["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
    if fields.get("num_experts") is not None and "num_experts_per_token" not in fields:
        fields["num_experts_per_token"] = text.get("num_experts_per_tok", 1)
    return KimiConfig(model_type=model_type, mla_layers=_mla_layers(text, num_layers), extra=tuple(notes), **fields)


def load_hf_config(model_dir: str | Path) -> KimiConfig:
    """Read `model_dir/config.json` and parse it; logs what is skipped (e.g. a vision tower)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: a model directory needs an HF config.json")
    config = parse_hf_config(json.loads(path.read_text()))
    for note in config.extra:
        logger.info(note)
    return config


def quantization_method(model_dir: str | Path) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (top level or text_config), if any."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    for scope in (raw, raw.get("text_config") or {}):
        quant = scope.get("quantization_config")
        if quant:
            return str(quant.get("quant_method", "unknown"))
    return None
