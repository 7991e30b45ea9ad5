"""Weight bytes per GPU, by component, computed from the config's tensor shapes (no model is built).

`weight_tensors(config)` lists every stored tensor of the text model (HF checkpoint shapes, section 1.3 of
k3-architecture.md) with its component, its sharding group and axis. `weight_bytes(config, layout, precision)`
shards each one by the layout and prices it in its component's format (precision.py). Vectors keep their
storage dtype: bf16 norms and AttnRes projections, fp32 `A_log`, `dt_bias`, conv weights, KDA `o_norm` and the
router's `e_score_correction_bias`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenspeed.errors import ConfigError
from tokenspeed.models.config import KimiConfig
from tokenspeed.plan.layout import ParallelLayout
from tokenspeed.plan.precision import QUANTIZED_FORMATS, WeightFormat, weight_format

# Breakdown rows in print order. `kda_fp32`: conv weights, A_log, dt_bias, o_norm of the KDA layers.
COMPONENTS = ("routed_experts", "kda_proj", "kda_fp32", "mla_proj", "shared_experts", "latent_down", "latent_up",
              "router", "dense_mlp", "embeddings", "norms", "draft")


@dataclass(frozen=True)
class WeightPrecision:
    """Stored format of each matrix component: one of nvfp4, mxfp4, fp8, bf16 (precision.py).

    `attention` covers every 2-D KDA and MLA projection (f_a/f_b/b included, as the NVFP4 checkpoint stores them).
    """

    routed_experts: str = "bf16"
    attention: str = "bf16"
    shared_experts: str = "bf16"
    latent: str = "bf16"
    router: str = "bf16"
    dense_mlp: str = "bf16"
    embeddings: str = "bf16"

    def __post_init__(self) -> None:
        for key, value in self.__dict__.items():
            if value not in QUANTIZED_FORMATS:
                raise ConfigError(f"weight format {value!r} for {key} is not supported; use one of {QUANTIZED_FORMATS}")

    @classmethod
    def parse(cls, spec: str) -> WeightPrecision:
        """'nvfp4' (a preset), 'bf16,routed_experts=mxfp4', 'nvfp4,shared_experts=fp8', ... (presets: PRESETS)."""
        result = cls()
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            if "=" not in part:
                if part not in PRECISION_PRESETS:
                    raise ConfigError(
                        f"unknown weights dtype {part!r}; use a preset ({', '.join(PRECISION_PRESETS)}) and/or "
                        f"COMPONENT=FORMAT overrides, COMPONENT in {', '.join(PRECISION_ALIASES)}"
                    )
                result = PRECISION_PRESETS[part]
                continue
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in PRECISION_ALIASES:
                raise ConfigError(f"unknown weight component {key!r}; choose from {', '.join(PRECISION_ALIASES)}")
            result = replace(result, **{PRECISION_ALIASES[key]: value})
        return result

    def format_of(self, component: str) -> str:
        return {"kda_proj": self.attention, "mla_proj": self.attention, "latent_down": self.latent,
                "latent_up": self.latent}.get(component) or getattr(self, component)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items())


PRECISION_PRESETS: dict[str, WeightPrecision] = {
    "bf16": WeightPrecision(),
    # nvidia/Kimi-K3-NVFP4: NVFP4 routed experts, FP8 (128x128 block scale) attention projections, BF16 rest.
    "nvfp4": WeightPrecision(routed_experts="nvfp4", attention="fp8"),
    # moonshotai/Kimi-K3: MXFP4 routed experts, everything else BF16.
    "mxfp4": WeightPrecision(routed_experts="mxfp4"),
    # every large matrix FP8 except the router and the embeddings.
    "fp8": WeightPrecision("fp8", "fp8", "fp8", "fp8", "bf16", "fp8", "bf16"),
}
PRECISION_ALIASES = {
    "routed_experts": "routed_experts", "routed": "routed_experts", "experts": "routed_experts",
    "attention": "attention", "attn": "attention", "shared_experts": "shared_experts", "shared": "shared_experts",
    "latent": "latent", "router": "router", "dense_mlp": "dense_mlp", "dense": "dense_mlp",
    "embeddings": "embeddings", "embed": "embeddings",
}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor kind: `count` copies of a [rows, cols] matrix (cols = 1 for a vector).

    group: sharding group (layout.py) or None if replicated; "experts" shards count by moe_ep and the
    intermediate axis by moe_tp. axis: the dimension the group divides. storage: "matrix" (priced in its
    component's format) or a fixed dtype for vectors ("bf16", "fp32").
    """

    component: str
    name: str
    rows: int
    cols: int
    count: int
    group: str | None = None
    axis: int = 0
    storage: str = "matrix"

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


def weight_tensors(config: KimiConfig, a_log_width: int | None = None) -> list[TensorSpec]:
    """Every tensor of the text model. `a_log_width`: stored A_log length (the K3 checkpoint pads 96 -> 128;
    None = one per head, as the engine keeps it)."""
    c, d = config, config.hidden_size
    h, hd, out = c.kda_num_heads, c.kda_head_dim, c.kda_dim
    n_kda, n_mla = len(c.kda_layers), len(c.mla_layers)
    moe = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
    n_moe, n_dense = len(moe), c.num_hidden_layers - len(moe)
    t = TensorSpec
    specs = [
        *(t("kda_proj", f"{p}_proj", out, d, n_kda, "attention") for p in ("q", "k", "v")),
        t("kda_proj", "f_a_proj", hd, d, n_kda),
        t("kda_proj", "f_b_proj", out, hd, n_kda, "attention"),
        t("kda_proj", "b_proj", h, d, n_kda, "attention"),
        t("kda_proj", "o_proj", d, out, n_kda, "attention", axis=1),
        t("kda_fp32", "q/k/v_conv1d", 3 * out, c.short_conv_kernel_size, n_kda, "attention", storage="fp32"),
        t("kda_fp32", "A_log", a_log_width or h, 1, n_kda, None if a_log_width else "attention", storage="fp32"),
        t("kda_fp32", "dt_bias", out, 1, n_kda, "attention", storage="fp32"),
        t("kda_fp32", "o_norm", hd, 1, n_kda, storage="fp32"),
    ]
    if c.use_full_rank_gate:
        specs.append(t("kda_proj", "g_proj", out, d, n_kda, "attention"))
    else:
        specs += [t("kda_proj", "g_a_proj", hd, d, n_kda), t("kda_proj", "g_b_proj", out, hd, n_kda, "attention")]
    mh, qk, v = c.num_attention_heads, c.qk_head_dim, c.v_head_dim
    if c.q_lora_rank is not None:
        specs += [t("mla_proj", "q_a_proj", c.q_lora_rank, d, n_mla),
                  t("mla_proj", "q_b_proj", mh * qk, c.q_lora_rank, n_mla, "attention"),
                  t("norms", "q_a_layernorm", c.q_lora_rank, 1, n_mla, storage="bf16")]
    else:
        specs.append(t("mla_proj", "q_proj", mh * qk, d, n_mla, "attention"))
    specs += [
        t("mla_proj", "kv_a_proj_with_mqa", c.mla_latent_dim, d, n_mla),
        t("norms", "kv_a_layernorm", c.kv_lora_rank, 1, n_mla, storage="bf16"),
        t("mla_proj", "kv_b_proj", mh * (c.qk_nope_head_dim + v), c.kv_lora_rank, n_mla, "attention"),
        t("mla_proj", "o_proj", d, mh * v, n_mla, "attention", axis=1),
    ]
    if c.mla_use_output_gate:
        specs.append(t("mla_proj", "g_proj", mh * v, d, n_mla, "attention"))
    if n_dense:
        specs += [t("dense_mlp", "gate/up_proj", c.intermediate_size, d, 2 * n_dense, "dense_mlp"),
                  t("dense_mlp", "down_proj", d, c.intermediate_size, n_dense, "dense_mlp", axis=1)]
    if n_moe:
        specs += _moe_tensors(c, n_moe)
    per_layer_norms = 2 + (2 if c.uses_attn_res else 0)
    specs.append(t("norms", "layer norms", d, 1, per_layer_norms * c.num_hidden_layers, storage="bf16"))
    if c.uses_attn_res:
        specs += [t("norms", "attn_res projections", d, 1, 2 * c.num_hidden_layers + 1, storage="bf16"),
                  t("norms", "output_attn_res_norm", d, 1, 1, storage="bf16")]
    specs += [t("norms", "model.norm", d, 1, 1, storage="bf16"),
              t("embeddings", "embed_tokens", c.vocab_size, d, 1, "embeddings")]
    if not c.tie_word_embeddings:
        specs.append(t("embeddings", "lm_head", c.vocab_size, d, 1, "embeddings"))
    return specs


def _moe_tensors(c: KimiConfig, n_moe: int) -> list[TensorSpec]:
    t, d, e = TensorSpec, c.hidden_size, c.num_experts or 0
    width = c.routed_expert_hidden_size or d
    specs = [
        t("routed_experts", "experts.w1/w3", c.moe_intermediate_size, width, 2 * e * n_moe, "experts", axis=0),
        t("routed_experts", "experts.w2", width, c.moe_intermediate_size, e * n_moe, "experts", axis=1),
        t("router", "gate.weight", e, d, n_moe),
    ]
    if c.topk_method == "noaux_tc":
        specs.append(t("router", "gate.e_score_correction_bias", e, 1, n_moe, storage="fp32"))
    if c.num_shared_experts:
        inter = c.num_shared_experts * c.moe_intermediate_size
        specs += [t("shared_experts", "shared gate/up_proj", inter, d, 2 * n_moe, "shared_experts"),
                  t("shared_experts", "shared down_proj", d, inter, n_moe, "shared_experts", axis=1)]
    if c.routed_expert_hidden_size is not None:
        specs += [t("latent_down", "routed_expert_down_proj", width, d, n_moe, "latent_down"),
                  t("latent_up", "routed_expert_up_proj", d, width, n_moe, "latent_up", axis=1)]
        if c.latent_moe_use_norm:
            specs.append(t("norms", "routed_expert_norm", width, 1, n_moe, storage="bf16"))
    return specs


def parameter_count(config: KimiConfig, a_log_width: int | None = None) -> int:
    """Total parameters of the text model from its shapes (the K3 checkpoint: a_log_width=128)."""
    return sum(s.params for s in weight_tensors(config, a_log_width))


@dataclass(frozen=True)
class WeightBreakdown:
    """Bytes of weights held by ONE GPU, per component (COMPONENTS order; absent components are 0)."""

    components: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.components.values())

    def __getitem__(self, component: str) -> int:
        return self.components.get(component, 0)


def local_tensor_bytes(spec: TensorSpec, layout: ParallelLayout, fmt: WeightFormat) -> int:
    """Bytes of `spec` on one GPU under `layout`, stored as `fmt`."""
    rows, cols, count = spec.rows, spec.cols, spec.count
    if spec.group == "experts":
        count, div = _exact(count, layout.moe_ep, spec, "--moe-ep"), layout.moe_tp
    else:
        div = layout.dense_divisor(spec.group) if spec.group else 1
    if div > 1:
        if spec.axis == 0:
            rows = _exact(rows, div, spec, "the shard count")
        else:
            cols = _exact(cols, div, spec, "the shard count")
    return count * fmt.tensor_bytes(rows, cols)


def weight_bytes(
    config: KimiConfig,
    layout: ParallelLayout,
    precision: WeightPrecision,
    *,
    a_log_width: int | None = None,
    extra: list[TensorSpec] | None = None,
) -> WeightBreakdown:
    """Per-GPU weight bytes by component. `extra`: more tensors to add (a draft model's, component 'draft',
    priced in bf16)."""
    layout.check(config)
    out = {name: 0 for name in COMPONENTS}
    for spec in [*weight_tensors(config, a_log_width), *(extra or [])]:
        if spec.storage != "matrix":
            fmt = weight_format(spec.storage)
        else:
            fmt = weight_format("bf16" if spec.component == "draft" else precision.format_of(spec.component))
        out[spec.component] += local_tensor_bytes(spec, layout, fmt)
    return WeightBreakdown({k: v for k, v in out.items() if v})


def _exact(n: int, div: int, spec: TensorSpec, what: str) -> int:
    if n % div:
        raise ConfigError(f"{spec.name} dimension {n} is not divisible by {what} ({div}); choose sizes dividing {n}")
    return n // div
