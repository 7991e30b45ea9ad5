"""The Kimi text-model config: one frozen dataclass for K3 and Kimi Linear, parsed from an HF `config.json`.

K3's text config is itself `kimi_linear`; the two are told apart by fields (`attn_res_block_size`,
`routed_expert_hidden_size`, `hidden_act`, `gate_lower_bound`), never by name. Defaults follow Moonshot's
`KimiLinearConfig` (a missing field means the feature is off); for a `kimi_k3` wrapper the fields missing from
`text_config` take the K3 checkpoint's values (as the upstream TokenSpeed config does).
Layer lists in the HF config are 1-based; everything here is 0-based.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenspeed.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "kimi_k3": "KimiK3ForConditionalGeneration (text path; config under text_config)",
    "kimi_linear": "KimiLinearForCausalLM (Kimi-Linear-48B-A3B, or the K3 text config itself)",
}
SUPPORTED_ACTIVATIONS = ("silu", "situ")
SUPPORTED_ROUTER_SCORING = ("sigmoid", "softmax")
SUPPORTED_TOPK_METHODS = ("noaux_tc", "greedy")


@dataclass(frozen=True)
class KimiConfig:
    """Every text-model field of `k3-architecture.md` section 1 (0-based layer indices)."""

    model_type: str = "kimi_linear"  # the architecture the config came from: kimi_k3 | kimi_linear
    vocab_size: int = 163840
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    # --- KDA (linear attention) ---
    mla_layers: tuple[int, ...] = ()  # 0-based full-attention (MLA) layers; all others are KDA
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = False  # output gate: g_proj (full rank) vs g_a_proj -> g_b_proj
    gate_lower_bound: float | None = None  # K3: -5.0 -> lambda * sigmoid(...); None -> -exp(A)*softplus(...)
    # --- MLA ---
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = False  # True: nothing is rotated (K3, Kimi Linear)
    mla_use_output_gate: bool = False
    mla_norm_eps: float = 1e-6  # q_a/kv_a layernorm eps: the reference builds them without eps
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    # --- MLP / MoE ---
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    intermediate_size: int = 11008
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_experts: int | None = None
    num_experts_per_token: int = 1
    num_shared_experts: int = 0  # width multiplier of ONE shared MLP (intermediate = n * moe_intermediate_size)
    moe_intermediate_size: int = 0
    routed_expert_hidden_size: int | None = None  # LatentMoE latent width; None: experts run in hidden space
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    # --- residual stream / misc ---
    attn_res_block_size: int | None = None  # Block AttnRes block size in decoder layers; None: plain residual
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    extra: tuple[str, ...] = field(default=(), compare=False)  # notes for the log (e.g. skipped vision tower)

    def __post_init__(self) -> None:
        _validate(self)

    # ----- derived geometry -----
    def is_mla_layer(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.mla_layers)

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Width of one cached MLA row: c_kv (kv_lora_rank) + k_pe (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)


def _validate(c: KimiConfig) -> None:
    if c.model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unknown model_type {c.model_type!r}; supported: {_supported()}")
    if c.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"unsupported hidden_act {c.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if c.moe_router_activation_func not in SUPPORTED_ROUTER_SCORING:
        raise ConfigError(
            f"unsupported moe_router_activation_func {c.moe_router_activation_func!r}; "
            f"supported: {', '.join(SUPPORTED_ROUTER_SCORING)}"
        )
    if c.topk_method not in SUPPORTED_TOPK_METHODS:
        raise ConfigError(f"unsupported topk_method {c.topk_method!r}; supported: {SUPPORTED_TOPK_METHODS}")
    if c.num_expert_group != 1 or c.topk_group != 1:
        raise ConfigError(
            f"grouped top-k routing (num_expert_group={c.num_expert_group}, topk_group={c.topk_group}) is not "
            "supported; Kimi models use num_expert_group=1, topk_group=1"
        )
    bad = [i for i in c.mla_layers if not 0 <= i < c.num_hidden_layers]
    if bad:
        raise ConfigError(f"full_attn_layers name layers outside 1..{c.num_hidden_layers}: {[i + 1 for i in bad]}")
    if c.num_experts is not None and not 0 < c.num_experts_per_token <= c.num_experts:
        raise ConfigError(
            f"num_experts_per_token={c.num_experts_per_token} must be in 1..num_experts={c.num_experts}"
        )
    if c.attn_res_block_size is not None and c.attn_res_block_size < 1:
        raise ConfigError(f"attn_res_block_size must be >= 1 or absent, got {c.attn_res_block_size}")
    if not c.mla_use_nope and c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim must be even for RoPE, got {c.qk_rope_head_dim}")


def _supported() -> str:
    return "; ".join(f"{k}: {v}" for k, v in SUPPORTED_ARCHITECTURES.items())
