"""The Kimi causal LM (K3 text model and Kimi Linear): embedding, decoder stack, final mix/norm, lm_head.

Module names mirror the checkpoint (`model.embed_tokens`, `model.layers.{l}`, `model.norm`, `lm_head`), so a
parameter's path is its checkpoint name (after the `language_model.` prefix of a kimi_k3 checkpoint).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tokenspeed.distributed import ParallelContext
from tokenspeed.models.batch import CacheBuffers, ForwardBatch
from tokenspeed.models.config import KimiConfig
from tokenspeed.models.kimi.attn_res import ResidualStream, depth_query, mix_and_norm
from tokenspeed.models.kimi.decoder import DecoderLayer
from tokenspeed.models.layers import Linear, RMSNorm, weight


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = weight((vocab, hidden), dtype, device)

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight[ids]


class KimiModel(nn.Module):
    """Embedding + decoder stack + final (AttnRes-mixed) norm. Returns final hidden states [T, hidden]."""

    def __init__(self, config: KimiConfig, parallel: ParallelContext, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, d, dtype, device)
        mla_index = {layer: i for i, layer in enumerate(config.mla_layers)}
        kda_index = {layer: i for i, layer in enumerate(config.kda_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, mla_index.get(i, kda_index.get(i, -1)), parallel, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        if config.uses_attn_res:
            self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
            self.output_attn_res_proj = Linear(d, 1, dtype, device)

    def forward(self, batch: ForwardBatch, cache: CacheBuffers) -> Tensor:
        """Run all layers over the batch; mutates the cache (new MLA rows, advanced KDA states)."""
        embeddings = self.embed_tokens(batch.input_ids)
        c = self.config
        if c.attn_res_block_size is None:
            hidden = embeddings
            for layer in self.layers:
                hidden = layer.forward_plain(hidden, batch, cache)
            return self.norm(hidden)
        stream = ResidualStream.start(embeddings, math.ceil(c.num_hidden_layers / c.attn_res_block_size))
        for layer in self.layers:
            layer.forward_attn_res(stream, batch, cache)
        query = depth_query(self.output_attn_res_norm, self.output_attn_res_proj)
        return mix_and_norm(stream, query, c.rms_norm_eps, self.norm)


class KimiForCausalLM(nn.Module):
    """The model plus its (untied unless the config ties it) lm_head."""

    def __init__(
        self,
        config: KimiConfig,
        parallel: ParallelContext | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or ParallelContext()
        self.dtype = dtype
        self.model = KimiModel(config, self.parallel, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, batch: ForwardBatch, cache: CacheBuffers, logits_indices: Tensor | None = None) -> Tensor:
        """Logits [T or len(logits_indices), vocab] fp32 (the head runs in the model dtype, as the reference)."""
        hidden = self.model(batch, cache)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden).float()
