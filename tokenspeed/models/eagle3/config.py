"""The EAGLE3-MLA draft config: one frozen dataclass parsed from the draft checkpoint's HF `config.json`.

Supported: the DeepSeek-style MLA draft served as `Eagle3DeepseekV2ForCausalLM` / `Eagle3DeepseekV3ForCausalLM`
(k3-architecture.md section 4.2): one decoder layer (`midlayer`) whose MLA reads the 2*hidden input
[input_layernorm(embed(x)) ; hidden_norm(g)], RoPE with optional DeepSeek YaRN, no output gate, a SiLU MLP, its
own lm_head over `draft_vocab_size` tokens (mapped to target ids by `d2t`) or, when the config has no
`draft_vocab_size`, the target's lm_head.

Target feature layers (`aux_layer_ids`) are 1-based "after this layer" indices, as vLLM reads
`eagle_config.eagle_aux_hidden_state_layer_ids` (id j = the output of 0-based layer j-1). Default when absent:
[2, n // 2, n - 3] for an n-layer target. NOTE: SGLang adds 1 to ids given in the config (its id j = output of
0-based layer j); a draft trained against SGLang-captured features with explicit ids needs them shifted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenspeed.errors import ConfigError

SUPPORTED_DRAFT_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "yarn")
DEFAULT_NUM_AUX_LAYERS = 3


@dataclass(frozen=True)
class Eagle3Config:
    """Geometry of an EAGLE3-MLA draft. `vocab_size` is the target's vocabulary."""

    architecture: str = "Eagle3DeepseekV2ForCausalLM"
    model_type: str = "deepseek_v3"
    hidden_size: int = 7168
    target_hidden_size: int = 7168
    num_attention_heads: int = 64
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    intermediate_size: int = 18432
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    vocab_size: int = 163840
    draft_vocab_size: int | None = None  # None: no own lm_head, the target's is used (and no d2t)
    aux_layer_ids: tuple[int, ...] | None = None  # 1-based "after layer"; None: [2, n // 2, n - 3] of the target
    norm_before_residual: bool = False  # True: the residual is hidden_norm(g) instead of g (vLLM option)
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def has_own_lm_head(self) -> bool:
        return self.draft_vocab_size is not None

    @property
    def lm_head_vocab_size(self) -> int:
        """Rows of the head the draft's logits come from (draft vocab, or the target's vocab when borrowed)."""
        return self.draft_vocab_size if self.draft_vocab_size is not None else self.vocab_size

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids is not None else DEFAULT_NUM_AUX_LAYERS

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_layers * self.target_hidden_size

    @property
    def mla_latent_dim(self) -> int:
        """Width of one row of the draft's latent cache: kv_lora_rank + qk_rope_head_dim (576 for K2-style)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The 1-based target layers whose features the draft reads, in fc order (config ids or the default)."""
        n = num_target_layers
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else (2, n // 2, n - 3)
        bad = [i for i in ids if not 1 <= i <= n]
        if bad:
            raise ConfigError(
                f"EAGLE3 feature layers {list(ids)} name layers outside 1..{n} of the {n}-layer target: {bad}; "
                "set eagle_config.eagle_aux_hidden_state_layer_ids in the draft config.json (1-based, after layer)"
            )
        return tuple(ids)


def _validate(c: Eagle3Config) -> None:
    if c.architecture not in SUPPORTED_DRAFT_ARCHITECTURES:
        raise ConfigError(
            f"unsupported EAGLE3 draft architecture {c.architecture!r}; supported: "
            f"{', '.join(SUPPORTED_DRAFT_ARCHITECTURES)} (one DeepSeek-style MLA decoder layer)"
        )
    if c.hidden_act != "silu":
        raise ConfigError(f"EAGLE3-MLA drafts use a SiLU MLP; got hidden_act={c.hidden_act!r}")
    for name in ("hidden_size", "target_hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "intermediate_size", "vocab_size"):
        if getattr(c, name) < 1:
            raise ConfigError(f"EAGLE3 draft config: {name} must be >= 1, got {getattr(c, name)}")
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        raise ConfigError(f"q_lora_rank must be >= 1 or null, got {c.q_lora_rank}")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim must be even for RoPE, got {c.qk_rope_head_dim}")
    if c.draft_vocab_size is not None and not 1 <= c.draft_vocab_size <= c.vocab_size:
        raise ConfigError(
            f"draft_vocab_size={c.draft_vocab_size} must be in 1..vocab_size={c.vocab_size} (the target vocab)"
        )
    if c.aux_layer_ids is not None and (not c.aux_layer_ids or min(c.aux_layer_ids) < 1):
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids must be a non-empty list of 1-based layers, got {list(c.aux_layer_ids)}"
        )
    scaling = c.rope_scaling_dict
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: default, yarn (DeepSeek YaRN)")
        if kind != "default" and "factor" not in scaling:
            raise ConfigError("rope_scaling of type yarn needs a 'factor'")


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


_PLAIN = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
          "v_head_dim", "rope_theta", "intermediate_size", "hidden_act", "rms_norm_eps", "vocab_size",
          "max_position_embeddings", "norm_before_residual")


def parse_eagle3_config(raw: Mapping[str, Any]) -> Eagle3Config:
    """Build an `Eagle3Config` from a draft `config.json` dict. Raises `ConfigError` for what we cannot run."""
    archs = list(raw.get("architectures") or [])
    arch = next((a for a in archs if a in SUPPORTED_DRAFT_ARCHITECTURES), archs[0] if archs else None)
    if arch is None:
        if "kv_lora_rank" not in raw:
            raise ConfigError(
                "draft config.json names no architecture and has no kv_lora_rank: only EAGLE3-MLA drafts "
                f"({', '.join(SUPPORTED_DRAFT_ARCHITECTURES)}) are supported"
            )
        arch = SUPPORTED_DRAFT_ARCHITECTURES[0]
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(
            f"EAGLE3 drafts have exactly one decoder layer; got num_hidden_layers={raw['num_hidden_layers']}"
        )
    if raw.get("tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings=true is not supported for EAGLE3 drafts (the head is its own or the "
                          "target's lm_head)")
    if raw.get("bias") or raw.get("attention_bias"):
        raise ConfigError("EAGLE3 drafts with biases (bias / attention_bias) are not supported")
    if raw.get("norm_output") or raw.get("use_fc_norm") or raw.get("fc_norm"):
        raise ConfigError("EAGLE3.1 variants (norm_output / fc_norm) are not supported yet")
    if raw.get("mla_use_output_gate") or raw.get("mla_use_nope"):
        raise ConfigError("this EAGLE3 draft path is a DeepSeek MLA with RoPE and no output gate; "
                          "mla_use_output_gate / mla_use_nope are not supported")
    fields: dict[str, Any] = {k: raw[k] for k in _PLAIN if raw.get(k) is not None}
    fields["architecture"] = arch
    if raw.get("model_type") is not None:
        fields["model_type"] = raw["model_type"]
    if "q_lora_rank" in raw:
        fields["q_lora_rank"] = raw["q_lora_rank"]  # None: q_proj without LoRA
    fields["target_hidden_size"] = raw.get("target_hidden_size") or fields.get("hidden_size", Eagle3Config.hidden_size)
    if raw.get("draft_vocab_size") is not None:
        fields["draft_vocab_size"] = int(raw["draft_vocab_size"])
    if raw.get("rope_scaling") is not None:
        scaling = dict(raw["rope_scaling"])
        for key in ("type", "rope_type"):
            if scaling.get(key) == "deepseek_yarn":  # vLLM's internal name for the same YaRN
                scaling[key] = "yarn"
        fields["rope_scaling"] = _freeze(scaling)
    eagle = raw.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    if ids is not None:
        fields["aux_layer_ids"] = tuple(int(i) for i in ids)
    if eagle.get("use_aux_hidden_state") is False:
        raise ConfigError("eagle_config.use_aux_hidden_state=false is an EAGLE-1/2 draft; only EAGLE3 is supported")
    if "rope_scaling" in fields and "rope_theta" not in fields:
        fields["rope_theta"] = 10000.0
    try:
        return Eagle3Config(**fields)
    except TypeError as e:  # a field of the wrong type
        raise ConfigError(f"bad EAGLE3 draft config: {e}") from e


def load_eagle3_config(model_dir: str | Path) -> Eagle3Config:
    """Read and parse `model_dir/config.json` of a draft checkpoint."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: an EAGLE3 draft directory needs an HF config.json")
    return parse_eagle3_config(json.loads(path.read_text()))
