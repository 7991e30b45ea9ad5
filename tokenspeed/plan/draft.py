"""Draft-model geometry for planning: the EAGLE3-MLA draft of k3-architecture.md section 4.2.

The exact config of `lightseekorg/kimi-k3-eagle3-mla` is not public (section 6, open question 2). The default
here is the likely one of section 4.2 (the K2.5 MLA EAGLE3 config: 64 heads, q_lora 1536, kv_lora 512,
nope/rope/v 128/64/128, SiLU MLP 18432, full 163840 vocabulary, own embedding and lm_head), 3.016 B params,
6.03 GB in bf16: the seed's "EAGLE3 weights 6.03 GB". Its cache is one MLA layer: kv_lora + rope = 576 values
per token, replicated on every attention-TP rank like the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed.errors import ConfigError
from tokenspeed.models.config import KimiConfig
from tokenspeed.plan.weights import TensorSpec

DRAFTS = ("eagle3",)


@dataclass(frozen=True)
class Eagle3Draft:
    """One MLA decoder layer over [embed ; fc(3 target features)], its own embedding and lm_head (bf16)."""

    num_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 18432
    draft_vocab_size: int | None = None  # None: the target's vocabulary
    num_aux_layers: int = 3  # target layers whose features feed fc
    num_layers: int = 1
    own_embeddings: bool = True  # False when it borrows the target's embedding and lm_head

    @property
    def cache_values_per_token(self) -> int:
        """Values cached per token: one latent row (c_kv + k_pe) per draft layer."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)

    def tensors(self, config: KimiConfig) -> list[TensorSpec]:
        """The draft's tensors (component 'draft'); heads, MLP width and vocabulary shard by attn_tp."""
        d, h, n = config.hidden_size, self.num_heads, self.num_layers
        vocab = self.draft_vocab_size or config.vocab_size
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        t = TensorSpec
        specs = [
            t("draft", "fc", d, self.num_aux_layers * d, 1),
            t("draft", "q_a_proj", self.q_lora_rank, 2 * d, n),
            t("draft", "q_b_proj", h * qk, self.q_lora_rank, n, "draft"),
            t("draft", "kv_a_proj_with_mqa", self.kv_lora_rank + self.qk_rope_head_dim, 2 * d, n),
            t("draft", "kv_b_proj", h * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank, n, "draft"),
            t("draft", "o_proj", d, h * self.v_head_dim, n, "draft", axis=1),
            t("draft", "gate/up_proj", self.intermediate_size, d, 2 * n, "draft"),
            t("draft", "down_proj", d, self.intermediate_size, n, "draft", axis=1),
            t("draft", "norms", d, 1, 3 * n + 1, storage="bf16"),  # input, hidden, post-attention; final
            t("draft", "q_a/kv_a_layernorm", self.q_lora_rank + self.kv_lora_rank, 1, n, storage="bf16"),
        ]
        if self.own_embeddings:
            specs += [t("draft", "embed_tokens", config.vocab_size, d, 1, "draft"),
                      t("draft", "lm_head", vocab, d, 1, "draft")]
        return specs

    def parameter_count(self, config: KimiConfig) -> int:
        return sum(s.params for s in self.tensors(config))


def draft_spec(name: str | None) -> Eagle3Draft | None:
    """The draft named `name` (None: no draft); ConfigError for an unknown one."""
    if name is None or name == "none":
        return None
    if name not in DRAFTS:
        raise ConfigError(f"unknown draft {name!r}; supported: {', '.join(DRAFTS)} (or none)")
    return Eagle3Draft()
