"""The EAGLE3-MLA draft model (k3-architecture.md section 4.2).

For one position t with input token x (the token after the one whose target features are used):

    g   = fc([f_1 ; f_2 ; f_3])                       first step: fused target features (Eagle3Draft.fuse)
        = h of the previous draft step                later steps (the pre-norm hidden returned by forward)
    u   = [input_layernorm(embed(x)) ; hidden_norm(g)]          2 * hidden
    a   = MLA(u)                                      DeepSeek MLA with RoPE/YaRN, no output gate, own latent cache
    r   = g + a                                       (hidden_norm(g) + a when norm_before_residual)
    h   = r + MLP(post_attention_layernorm(r))        SiLU MLP
    logits = lm_head(norm(h))                         draft vocab; target id = d + d2t[d]

Module names equal the checkpoint names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `embed_tokens`). The MLA
is our Kimi `MLAAttention` built from a derived config whose hidden size is 2 * hidden (its input projections),
with `o_proj` narrowed back to hidden; all attention math goes through `tokenspeed.ops`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenspeed import ops
from tokenspeed.distributed import ParallelContext
from tokenspeed.errors import ConfigError
from tokenspeed.models.batch import CacheBuffers, ForwardBatch
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.eagle3.config import Eagle3Config
from tokenspeed.models.kimi.mla import MLAAttention
from tokenspeed.models.kimi.mlp import GatedMLP
from tokenspeed.models.kimi.model import Embedding, KimiForCausalLM
from tokenspeed.models.layers import Linear, RMSNorm, weight


def mla_kimi_config(config: Eagle3Config) -> KimiConfig:
    """A one-layer KimiConfig describing the draft's MLA with its 2*hidden input (also sizes its latent cache)."""
    return KimiConfig(
        model_type="kimi_linear",
        vocab_size=config.vocab_size,
        hidden_size=2 * config.hidden_size,
        num_hidden_layers=1,
        mla_layers=(0,),
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        mla_use_nope=False,
        mla_use_output_gate=False,
        mla_norm_eps=config.rms_norm_eps,  # DeepSeek builds q_a/kv_a layernorms with rms_norm_eps
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        hidden_act="silu",
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
    )


class DraftMLAAttention(MLAAttention):
    """MLA reading the 2*hidden draft input and writing hidden: q_a/q/kv_a read 2*hidden, o_proj writes hidden."""

    def __init__(self, config: Eagle3Config, parallel: ParallelContext, dtype: torch.dtype, device=None) -> None:
        super().__init__(mla_kimi_config(config), 0, parallel, dtype, device)
        self.o_proj = Linear(self.num_heads * self.v_dim, config.hidden_size, dtype, device, shard="in")


class Eagle3DecoderLayer(nn.Module):
    """The draft's single decoder layer (`midlayer`)."""

    def __init__(self, config: Eagle3Config, parallel: ParallelContext, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = DraftMLAAttention(config, parallel, dtype, device)
        mlp_config = dataclasses.replace(mla_kimi_config(config), hidden_size=d)
        self.mlp = GatedMLP(mlp_config, config.intermediate_size, parallel, dtype, device)
        self.input_layernorm = RMSNorm(d, eps, dtype, device)
        self.hidden_norm = RMSNorm(d, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, device)

    def forward(self, embeds: Tensor, hidden: Tensor, batch: ForwardBatch, cache: CacheBuffers) -> Tensor:
        """embeds, hidden: [T, hidden] -> h [T, hidden] (pre-final-norm). Writes the draft's latent rows."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        post = self.post_attention_layernorm
        x, r = ops.add_rms_norm(self.self_attn(x, batch, cache), residual, post.weight, post.eps)  # r = residual + a
        return r + self.mlp(x)


@dataclass
class _TargetRefs:
    """Tensors borrowed from the target (held outside the module tree: not parameters of the draft)."""

    embed: Tensor | None = None
    lm_head: Tensor | None = None


class Eagle3Draft(nn.Module):
    """EAGLE3-MLA draft. own_embedding=False: the token embedding is the target's (see `bind_target`); without
    `draft_vocab_size` in the config the lm_head is the target's too (and there is no d2t: ids are target ids)."""

    def __init__(
        self,
        config: Eagle3Config,
        parallel: ParallelContext | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        *,
        own_embedding: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or ParallelContext()
        self.dtype = dtype
        d = config.hidden_size
        self.cache_config = mla_kimi_config(config)  # one MLA layer: CacheBuffers.allocate sizes the draft cache
        self.fc = Linear(config.fc_in_features, d, dtype, device)
        if own_embedding:
            self.embed_tokens = Embedding(config.vocab_size, d, dtype, device)
        self.midlayer = Eagle3DecoderLayer(config, self.parallel, dtype, device)
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        if config.has_own_lm_head:
            self.lm_head = Linear(d, config.lm_head_vocab_size, dtype, device)
            self.d2t = weight((config.lm_head_vocab_size,), torch.int64, device)
        self._target = _TargetRefs()

    # ----- target binding -----
    @property
    def has_own_embedding(self) -> bool:
        return hasattr(self, "embed_tokens")

    @property
    def needs_target(self) -> bool:
        """True while a borrowed part (embedding or lm_head) is not bound yet."""
        return (not self.has_own_embedding and self._target.embed is None) or (
            not self.config.has_own_lm_head and self._target.lm_head is None
        )

    def bind_target(self, target: KimiForCausalLM) -> None:
        """Check the draft fits `target` and borrow what the draft does not own (embedding, lm_head)."""
        c, t = self.config, target.config
        if t.vocab_size != c.vocab_size:
            raise ConfigError(f"EAGLE3 draft vocab_size {c.vocab_size} != target vocab_size {t.vocab_size}")
        if t.hidden_size != c.target_hidden_size:
            raise ConfigError(
                f"EAGLE3 draft expects target features of width {c.target_hidden_size} (target_hidden_size), "
                f"the target's hidden size is {t.hidden_size}"
            )
        c.capture_layers(t.num_hidden_layers)  # validates the feature layers against the target depth
        borrow = [n for n, own in (("embedding", self.has_own_embedding), ("lm_head", c.has_own_lm_head)) if not own]
        if borrow and t.hidden_size != c.hidden_size:
            raise ConfigError(
                f"the draft borrows the target's {' and '.join(borrow)} but its hidden size {c.hidden_size} differs "
                f"from the target's {t.hidden_size}; the checkpoint must carry its own"
            )
        if not self.has_own_embedding:
            self._target.embed = target.model.embed_tokens.weight
        if not c.has_own_lm_head:
            self._target.lm_head = target.lm_head.weight

    def capture_layers(self, target: KimiForCausalLM) -> tuple[int, ...]:
        """The 1-based target layers to pass as `capture_layers` to the target forward, in fc order."""
        return self.config.capture_layers(target.config.num_hidden_layers)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def allocate_cache(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str | None = None,
        *,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> CacheBuffers:
        """The draft's own paged latent cache: one MLA layer, rows of kv_lora_rank + rope values, no KDA state."""
        return CacheBuffers.allocate(self.cache_config, num_pages, page_size, 0, self.dtype,
                                     device if device is not None else self.device, kv_cache_dtype=kv_cache_dtype)

    # ----- forward -----
    def fuse(self, features: Tensor | Sequence[Tensor]) -> Tensor:
        """g = fc([f_1 ; ... ; f_k]): target features ([T, k*target_hidden] or k tensors [T, target_hidden])."""
        x = features if isinstance(features, Tensor) else torch.cat(list(features), dim=-1)
        if x.shape[-1] != self.config.fc_in_features:
            raise ValueError(
                f"EAGLE3 fc expects {self.config.num_aux_layers} features of width {self.config.target_hidden_size} "
                f"({self.config.fc_in_features} in all), got width {x.shape[-1]}"
            )
        return self.fc(x.to(self.dtype))

    def embed(self, token_ids: Tensor) -> Tensor:
        if self.has_own_embedding:
            return self.embed_tokens(token_ids)
        if self._target.embed is None:
            raise RuntimeError("this EAGLE3 draft borrows the target's embedding: call bind_target(target) first")
        return self._target.embed[token_ids]

    def head(self, h: Tensor) -> Tensor:
        """Logits fp32 over the head's vocab (draft vocab, or the target vocab when the head is borrowed)."""
        if self.config.has_own_lm_head:
            return self.lm_head(self.norm(h)).float()
        if self._target.lm_head is None:
            raise RuntimeError("this EAGLE3 draft uses the target's lm_head: call bind_target(target) first")
        return nn.functional.linear(self.norm(h), self._target.lm_head).float()

    def forward(
        self,
        batch: ForwardBatch,
        cache: CacheBuffers,
        token_ids: Tensor | None,
        hidden_in: Tensor,
        logits_indices: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One draft forward over a flat batch (same varlen contract as the target's).

        token_ids: [T] draft input tokens (None: batch.input_ids). hidden_in: [T, hidden], `fuse(features)` for
        positions whose target features are known, or the previous step's returned hidden.
        Returns (logits fp32 [T or len(logits_indices), head vocab] - map ids with `to_target_ids`,
        hidden [T, hidden] pre-norm, the next step's hidden_in). Writes the new tokens' rows of the draft cache.
        """
        ids = batch.input_ids if token_ids is None else token_ids
        if hidden_in.shape != (ids.shape[0], self.config.hidden_size):
            raise ValueError(f"hidden_in must be [{ids.shape[0]}, {self.config.hidden_size}], got "
                             f"{tuple(hidden_in.shape)} (fuse target features with Eagle3Draft.fuse first)")
        h = self.midlayer(self.embed(ids), hidden_in.to(self.dtype), batch, cache)
        out = h if logits_indices is None else h[logits_indices]
        return self.head(out), h

    # ----- vocabulary map -----
    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Target token ids of head-vocab ids: d + d2t[d] (identity when the head is the target's)."""
        if not self.config.has_own_lm_head:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def propose(self, logits: Tensor) -> Tensor:
        """Greedy chain proposal: argmax of each row of the draft logits, as target token ids [rows]."""
        return self.to_target_ids(logits.argmax(dim=-1))

    def target_vocab_logits(self, logits: Tensor) -> Tensor:
        """Draft logits scattered into the target vocab [rows, vocab_size]; tokens outside the draft vocab -inf."""
        if not self.config.has_own_lm_head:
            return logits
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        idx = self.to_target_ids(torch.arange(logits.shape[-1], device=logits.device))
        out[:, idx] = logits
        return out
